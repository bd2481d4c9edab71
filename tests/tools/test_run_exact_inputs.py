"""``mpifusion run --inputs exact``: mpifusion's own sync of
:func:`mpifusion.oracle.exact_inputs` is bit-exact at 1, 2 and 4 ranks (within the rounding
of the mean at 3) for every act, dtype and accumulation, and one dropped contribution, the
smallest of its element, fails the run (where random inputs' bound lets it pass)."""
from __future__ import annotations

import numpy as np
import pytest

from mpifusion.spec import Spec
from mpifusion.tools import runjob
from mpifusion.tools.gradsource import ExactGradSource
from mpifusion.tools.runjob import RunOptions

from tests.helpers import mpiexec


@pytest.mark.parametrize("n, argv", [
    (1, ["--acc-steps", "3"]),
    (2, ["--act", "reduce_scatter", "--preset", "tiny-bf16", "--no-main-grad"]),
    (2, ["--act", "reduce", "--dst", "1", "--preset", "tiny-fp16", "--no-main-grad",
         "--scale-after-comm", "--acc-steps", "4"]),
    (3, ["--act", "reduce_scatter", "--preset", "tiny-fp16", "--reduce-avg",
         "--release-grads", "--group-size", "16K"]),
    (3, ["--act", "reduce", "--dst", "2", "--preset", "tiny-bf16", "--acc-steps", "1"]),
    (4, ["--act", "all_reduce", "--preset", "tiny-bf16", "--no-main-grad",
         "--acc-steps", "4"]),
    (4, ["--act", "reduce_scatter", "--preset", "tiny-fp16", "--scale-after-comm"]),
])
def test_run_with_exact_inputs_is_bit_exact(n, argv):
    proc = mpiexec(n, "run", "--inputs", "exact", "--no-progress", "--steps", "2", *argv,
                   timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "inputs exact" in lines[0]
    assert any(line.startswith("tolerance (oracle.exact_tolerance, ") for line in lines)
    if n in (1, 2, 4):
        assert lines[-1] == f"PASS: 11 params bit-exact (exact inputs) on {n} rank(s) for 2 step(s)"
        assert any(line.startswith("max error: 0 abs, 0 rel, ") for line in lines)
    else:
        assert lines[-1] == (f"PASS: 11 params within the rounding of the mean (exact inputs) "
                             f"on {n} rank(s) for 2 step(s)")
    if "reduce_scatter" in argv:
        assert "sync_params: exact" in lines


def _smallest(src: ExactGradSource, pidx: int, j: int) -> int:
    """An element where contribution ``j`` is the smallest (nonzero) of at least two."""
    pat = src.pattern(0, pidx)
    every = np.abs(np.stack([pat.contribution(i) for i in range(pat.contributions)]))
    smallest = np.where(every > 0, every, np.inf).min(axis=0)
    hits = (every[j] > 0) & (every[j] == smallest) & ((every > 0).sum(axis=0) > 1)
    return int(np.flatnonzero(hits)[0])


@pytest.mark.mpi(min_size=2)
def test_a_dropped_contribution_fails_the_run(comm, monkeypatch, capsys):
    """Rank 1 leaves out its smallest contribution to one element of fc1.weight (bf16 grads,
    4 micro-steps, the mean scaled after the collective): the run fails naming the param,
    at any rank count."""
    spec = Spec.from_preset("tiny", dtype="bfloat16", act="all_reduce", acc_steps=4,
                            use_main_grad=False)
    pidx = [p.name for p in spec.fused_params()].index("fc1.weight")
    element = _smallest(ExactGradSource(spec, 0, np.float32, comm.Get_size()), pidx, 1 * 4 + 2)
    real = ExactGradSource.grad

    def grad(self, rank, step, micro, p, shape):
        g = real(self, rank, step, micro, p, shape)
        if (rank, step, micro, p) == (1, 0, 2, pidx):
            g.reshape(-1)[element] = 0.0
        return g

    monkeypatch.setattr(ExactGradSource, "grad", grad)
    got = runjob.run_job(spec, RunOptions(steps=1, progress=False, inputs="exact",
                                          scale_after_comm=True), comm)
    out = capsys.readouterr().out
    assert got == 1
    if comm.Get_rank() == 0:
        last = out.strip().splitlines()[-1]
        assert (last.startswith("FAIL: 1 param(s) not bit-exact (exact inputs): fc1.weight")
                or last.startswith("FAIL: 1 param(s) beyond the rounding of the mean (exact "
                                   "inputs): fc1.weight")), out
