"""Findings of a third red-team review of ``mpifusion check`` (the oracle): each test fails
on the code before its fix. A right result that failed, a wrong one that passed, or a
traceback where one line naming the file and key was due."""
import json

import numpy as np
import pytest

from mpifusion.oracle import check, error_bound
from mpifusion.oracle.dumps import DumpError


def spec_of(dtype="float32", nranks=2, shape=(3,), **kw):
    return {"params": [{"name": "w", "shape": list(shape), "dtype": dtype}], "nranks": nranks,
            **kw}


# -- pre-scaled half-precision averages that underflow -------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("nranks", [5, 8, 16])
def test_prescaled_half_average_in_the_subnormal_range_passes(dtype, nranks):
    """Paddle's (and FusedCommBuffer's) scale_after_comm=False on fp16/bf16 grads: every rank
    multiplies its buffer by fp32(1/R) in fp32 and rounds to the half dtype, then the ranks
    sum in fp32, rounded once. Where the scaled grads are subnormal, each rank's rounding is
    an absolute error of up to half the smallest subnormal, R of them; the bound's eta
    counted one, so a correct result failed (up to 4x the bound at 8 ranks)."""
    import ml_dtypes

    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    tiny = float(np.finfo(half).smallest_subnormal)
    rng = np.random.default_rng(nranks)
    xs = [(rng.integers(1, 12, 64) * tiny).astype(half) for _ in range(nranks)]
    scale = np.float32(1.0 / nranks)
    pre = [(x.astype(np.float32) * scale).astype(half) for x in xs]  # mpifusion's scale_
    out = np.sum([p.astype(np.float32) for p in pre], axis=0, dtype=np.float32).astype(half)
    spec = spec_of(dtype, nranks, shape=(64,), average=True)
    raw = (lambda a: a.view(np.uint16)) if dtype == "bfloat16" else (lambda a: a)
    report = check(spec, [{"in/w/0": raw(x), "out/w": raw(out)} for x in xs])
    assert report.ok, report
    # still the bound of a few roundings: one subnormal step more on every element fails
    worse = (out.astype(np.float32) + np.float32(nranks * tiny)).astype(half)
    assert not check(spec, [{"in/w/0": raw(x), "out/w": raw(worse)} for x in xs]).ok
