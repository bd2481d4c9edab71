"""mpifusion.tools.timing: the rounds of ``timeit_many`` and the ratios taken from them
(COMM_SELF: the rounds' logic, not MPI's speed)."""
import collections

import pytest
from mpi4py import MPI

from mpifusion.tools.timing import balanced_orders, best_per_round, round_ratio, timeit_many


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_each_candidate_follows_each_other_equally_often(k):
    """A candidate that leaves the machine busy (a progress thread still polling) must not
    always delay the same successor, as a fixed order (or a rotation of it) does."""
    orders = balanced_orders(k)
    assert all(sorted(o) == list(range(k)) for o in orders)
    pairs = collections.Counter((o[i], o[i + 1]) for o in orders for i in range(k - 1))
    assert len(pairs) == k * (k - 1) and len(set(pairs.values())) <= 1, pairs


def test_timeit_many_runs_the_balanced_orders():
    ran = []
    fns = {name: (lambda name=name: ran.append(name)) for name in "abc"}
    res = timeit_many(fns, MPI.COMM_SELF, iters=6, warmup=1)
    names = list(fns)
    want = [names[j] for i in range(7) for j in balanced_orders(3)[i % 6]]
    assert ran == want
    assert all(len(r["times_s"]) == 6 for r in res.values())


def test_ratios_are_taken_round_by_round():
    a = {"times_s": [2.0, 10.0, 4.0], "median_s": 4.0}
    b = {"times_s": [1.0, 10.0, 2.0], "median_s": 2.0}
    assert round_ratio(a, b) == 2.0  # per round 2, 1, 2: median 2
    best = best_per_round([a, b])
    assert best["times_s"] == [1.0, 10.0, 2.0] and best["median_s"] == 2.0


def test_self_timed_candidates_report_their_own_seconds():
    """bench's small buffers time each step and report the median: the round keeps what
    the candidate returned, not the wall time around it (which includes its other steps)."""
    own = {"a": iter([9.0, 0.5, 0.75]), "b": iter([9.0, 0.25, 1.0])}  # warm-up first
    fns = {name: (lambda it=it: next(it)) for name, it in own.items()}
    res = timeit_many(fns, MPI.COMM_SELF, iters=2, warmup=1, self_timed=True)
    assert res["a"]["times_s"] == [0.5, 0.75] and res["b"]["times_s"] == [0.25, 1.0]
