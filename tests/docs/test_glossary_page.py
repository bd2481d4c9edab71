"""docs/glossary.md is a Sphinx glossary of the words the pages use, each defined once, and
docs/faq.md answers the questions of docs/troubleshooting.md briefly, linking to the details
instead of copying them."""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: words a newcomer meets first, each of which must be a term
REQUIRED = ("micro-step", "acc_steps", "acc_step", "main_grad", "busbw", "weak check",
            "coarse check", "segment", "stream", "strategy", "node", "link floor", "shard",
            "check in", "step", "exact reference", "bound")


def terms() -> list:
    found = []
    for block in re.findall(r"```\{glossary\}\n(.*?)```", (DOCS / "glossary.md").read_text(),
                            re.S):
        found += [line for line in block.splitlines() if line and not line.startswith(" ")]
    return found


def test_the_glossary_defines_each_word_once():
    found = terms()
    assert len(found) == len(set(found)), found
    missing = [t for t in REQUIRED if t not in found]
    assert not missing, missing


def test_every_term_reference_names_a_term():
    known = set(terms())
    for page in DOCS.glob("*.md"):
        for ref in re.findall(r"\{term\}`([^`]+)`", page.read_text()):
            target = re.search(r"<([^>]+)>$", ref)
            assert (target.group(1) if target else ref) in known, (page.name, ref)


def test_the_faq_links_to_the_details_without_copying_them():
    faq = (DOCS / "faq.md").read_text()
    troubleshooting = (DOCS / "troubleshooting.md").read_text()
    questions = re.findall(r"^### (.+)$", faq, re.M)
    assert len(questions) >= 10
    assert faq.count("](troubleshooting.md") >= 2
    # each answer links somewhere or names a term
    for answer in re.split(r"^### .+$", faq, flags=re.M)[1:]:
        assert re.search(r"\]\([\w-]+\.md|\{term\}", answer), answer[:120]
    # no long stretch of the troubleshooting page is repeated
    for sentence in re.split(r"(?<=[.:;])\s", " ".join(troubleshooting.split())):
        if len(sentence) > 90:
            assert sentence not in " ".join(faq.split()), sentence[:100]
