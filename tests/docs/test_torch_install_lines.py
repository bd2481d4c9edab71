"""Every ``pip install`` of torch that the README or a docs page shows (in a code block or an
inline code span) takes PyTorch's CPU index in the same command: PyPI's Linux torch is the
CUDA build (several GB of nvidia-* wheels), and a reader copies the command, not the prose
around it. A docs page is read as its reader sees it, with its ``{include}`` directives
resolved: the pages show the README's one install line (test_shared_blocks.py)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.docs.pages import rendered_source

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown(page: Path) -> str:
    """What a page shows: a docs page with its includes resolved, the README as it is."""
    return rendered_source(page) if page.parent.name == "docs" else page.read_text(
        encoding="utf-8")


def code(text: str) -> list:
    """The fenced blocks and inline code spans of a Markdown page."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return fenced + re.findall(r"`([^`\n]+)`", rest)


def pip_installs(snippet: str) -> list:
    """Each ``pip install`` command of a snippet, as its words."""
    joined = snippet.replace("\\\n", " ")
    found = []
    for command in re.split(r"&&|\|\||;|\n", joined):
        try:
            words = shlex.split(command, comments=True)
        except ValueError:
            words = command.split()
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                found.append(words[i + 2:])
                break
    return found


def installs_torch(words: list) -> bool:
    for w in words:
        if re.fullmatch(r"torch(\[[^\]]*\])?([=<>!~]=?.*)?", w):
            return True
        extras = re.search(r"\[([^\]]*)\]", w)
        if not w.startswith("-") and extras and "torch" in extras.group(1).split(","):
            return True  # mpifusion's torch extra: PyPI's torch too
    return False


def test_every_torch_install_shown_takes_the_cpu_index():
    seen, bad = 0, []
    for page in pages():
        for snippet in code(shown(page)):
            for words in pip_installs(snippet):
                if not installs_torch(words):
                    continue
                seen += 1
                i = words.index("--index-url") if "--index-url" in words else -1
                if i < 0 or words[i + 1:i + 2] != [CPU_INDEX]:
                    bad.append(f"{page.relative_to(ROOT)}: pip install {' '.join(words)}")
    assert seen >= 3, seen  # the README's set-up line, the oracle page, the pattern pages
    assert not bad, "torch installs without --index-url " + CPU_INDEX + ":\n" + "\n".join(bad)


def test_the_check_sees_a_missing_index():
    assert installs_torch(pip_installs("pip install torch==2.13.0")[0])
    assert installs_torch(pip_installs("pip install -e '.[test,torch]'")[0])
    assert not installs_torch(pip_installs("pip install -e '.[test]'")[0])
    assert code("a `pip install torch` b\n```bash\npip install x\n```\n") == [
        "pip install x\n", "pip install torch"]
