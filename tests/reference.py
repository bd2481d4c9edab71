"""Independent references for the tests: what every rank contributes, summed in float64.

Every rank's gradient is a pure function of (rank, step, micro-step, param), so any rank can
rebuild every other rank's contribution and the exact sum without communicating.
"""
import numpy as np

from mpifusion.dtypes import as_dtype

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53}


def grad_for(rank, step, micro, index, shape, dtype, seed=1234):
    """The gradient rank ``rank`` contributes, already rounded to ``dtype``."""
    rng = np.random.default_rng([seed, rank, step, micro, index])
    return rng.standard_normal(shape).astype(as_dtype(dtype))


def rank_grads(nranks, acc, shapes, seed, dtype=np.float32):
    """Per rank, ``{name: [one grad per micro-step]}`` of standard normal values rounded to
    ``dtype``, all from one generator seeded with ``seed`` (for dumps made up in a test)."""
    rng = np.random.default_rng(seed)
    return [{n: [rng.standard_normal(s).astype(dtype) for _ in range(acc)]
             for n, s in shapes.items()} for _ in range(nranks)]


def fp32_reduction(grads, average):
    """What a correct fp32 implementation of ``rank_grads``' dump holds: per-rank fp32
    accumulation of the micro-steps, the fp32 sum over ranks in rank order, then 1/n."""
    out = {}
    for n in grads[0]:
        local = [sum(g[n][1:], start=g[n][0].astype(np.float32).copy()) for g in grads]
        total = local[0].copy()
        for x in local[1:]:
            total += x
        if average:
            total *= np.float32(1.0 / len(grads))
        out[n] = total
    return out


def exact_values(shape, dtype, *key, span=8, den=8):
    """Multiples of ``1/den`` in ``[-span, span)``, a pure function of ``key`` (e.g. rank, size,
    salt), so any rank can rebuild any other's. They are exact in every dtype, and sums of a
    few of them are exact in fp32 (with span=1, den=4: in bf16 too), so a result can be
    compared bit for bit with a float64 reference."""
    rng = np.random.default_rng(list(key))
    return (rng.integers(-span * den, span * den, shape) / den).astype(dtype)


def local_sum(rank, step, acc_steps, index, shape, dtype):
    return sum(grad_for(rank, step, k, index, shape, dtype).astype(np.float64)
               for k in range(acc_steps))


def reduced(nranks, step, acc_steps, index, shape, dtype):
    """(exact float64 sum over ranks and micro-steps, sum of absolute values)."""
    total = np.zeros(shape, np.float64)
    mag = np.zeros(shape, np.float64)
    for r in range(nranks):
        for k in range(acc_steps):
            g = grad_for(r, step, k, index, shape, dtype).astype(np.float64)
            total += g
            mag += np.abs(g)
    return total, mag


def bound(mag, nranks, acc_steps, dtype):
    """Worst-case rounding error of summing nranks*acc_steps terms in ``dtype`` arithmetic,
    plus scaling and a final rounding: (k + n + 2) * u * sum|x| (Higham's gamma_m, first order)."""
    u = UNIT_ROUNDOFF[as_dtype(dtype).name]
    return (acc_steps + nranks + 2) * u * mag + 1e-30


def assert_close(actual, expected, tol, what):
    actual = np.asarray(actual, dtype=np.float64)
    err = np.abs(actual - expected)
    bad = err > tol
    if bad.any():
        i = np.flatnonzero(bad.ravel())[0]
        raise AssertionError(f"{what}: {int(bad.sum())} element(s) outside the bound; first at "
                             f"flat index {i}: got {actual.ravel()[i]!r}, expected "
                             f"{expected.ravel()[i]!r} +- {np.ravel(tol)[i] if np.ndim(tol) else tol!r}")
