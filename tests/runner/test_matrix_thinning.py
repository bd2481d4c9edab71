"""The 8-rank runs' rule for ``matrix`` tests (tests/conftest.py): each parameter value once.

A matrix case left out above 4 ranks still runs at 1-4 ranks; the skip says so in words
tests/skips.py files under "ranks", whose report fails a run where a case ran nowhere.
"""
import itertools

from tests import conftest, skips


def _covers(cases, chosen):
    return ({pair for case in cases for pair in case.items()}
            == {pair for i in chosen for pair in cases[i].items()})


def test_each_choice_holds_every_value_of_every_parameter_in_few_cases():
    cases = [dict(act=a, acc=b, main=c, avg=d)
             for a, b, c, d in itertools.product("ABC", (1, 3), (False, True), (False, True))]
    chosen = conftest.each_choice(cases)
    assert _covers(cases, chosen)
    assert len(chosen) == 3  # the longest axis: A, B, C each once, the flags both ways


def test_each_choice_of_a_two_axis_product_is_its_longer_axis():
    cases = [dict(way=w, dtype=d) for w, d in itertools.product(range(5), range(4))]
    chosen = conftest.each_choice(cases)
    assert _covers(cases, chosen) and len(chosen) == 5


def test_each_choice_is_the_same_choice_every_time():
    """Every rank computes it alone: a different choice would pair different tests."""
    cases = [dict(x=i % 3, y=i % 4, z=i % 5) for i in range(60)]
    assert len({frozenset(conftest.each_choice(cases)) for _ in range(5)}) == 1


def test_a_single_case_and_no_parameters():
    assert conftest.each_choice([dict(x=1)]) == {0}
    assert conftest.each_choice([]) == set()


class _Spec:
    def __init__(self, params, indices):
        self.params, self.indices = params, indices


class _Item:
    def __init__(self, params, indices):
        self.callspec = _Spec(params, indices)


def test_names_parametrized_together_count_one_by_one_and_addresses_by_position():
    """``parametrize("strategy,window", WAYS)``: strategy and window are two parameters;
    an object whose repr is its address (different on every rank) counts by position."""
    obj = object()
    item = _Item({"strategy": "thread", "window": 2, "hook": obj},
                 {"strategy": 1, "window": 1, "hook": 4})
    assert conftest._case_values(item) == {"strategy": "'thread'", "window": "2", "hook": "#4"}


def test_the_skip_reason_is_a_rank_count_skip():
    assert skips.category(conftest.matrix_skip_reason(8)).name == "ranks"
