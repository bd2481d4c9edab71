"""The serial run's order (tests/conftest.py): its longest files first, each file's tests in
their own order, the rest after them as collected."""
from pathlib import Path

from tests import conftest

TESTS = Path(conftest.__file__).resolve().parent


def test_every_longest_file_is_a_test_file():
    """A renamed or removed file would silently drop out of the order."""
    missing = [name for name in conftest.LONGEST_FILES if not (TESTS / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FILES names no such file: {missing}"
    assert len(set(conftest.LONGEST_FILES)) == len(conftest.LONGEST_FILES)


class _Item:
    def __init__(self, name, test):
        self.fspath = TESTS / name
        self.test = test


def test_longest_files_come_first_in_their_order_and_the_rest_keep_theirs():
    first, second = conftest.LONGEST_FILES[:2]
    items = [_Item("arrays/test_a.py", 1), _Item(second, 1), _Item("arrays/test_b.py", 1),
             _Item(first, 1), _Item(second, 2), _Item("arrays/test_a.py", 2), _Item(first, 2)]
    order = [(Path(i.fspath).relative_to(TESTS).as_posix(), i.test)
             for i in conftest._longest_first(items)]
    assert order == [(first, 1), (first, 2), (second, 1), (second, 2),
                     ("arrays/test_a.py", 1), ("arrays/test_b.py", 1), ("arrays/test_a.py", 2)]
