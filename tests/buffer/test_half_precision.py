"""fp16 and bf16 grads, with and without fp32 main grads, at any rank count, against float64.

The accumulation rule (README, "How exact"): a half-precision grad buffer is widened to fp32,
summed over ranks in fp32, multiplied by ``fp32(1/n)`` in fp32 when averaging, and rounded
once to the buffer dtype. Two checks follow from it:

* bit-exact: grads on a grid where every fp32 partial sum is exact (so MPI's order of
  additions cannot matter) must give exactly ``half(fp32(S) * fp32(1/n))``;
* bounded: random grads must be within ``u*|x| + (n-1)*u32*sum|g|/n*(1+u) + tiny`` of the
  float64 value ``x = S/n`` (``u``: unit roundoff of the buffer dtype; ``n-1`` fp32
  additions and one fp32 scaling; ``tiny``: half the smallest subnormal).

A fp32 ``main_grad`` buffer follows the fp32 rule: the same bound with ``u = u32``.
"""
import numpy as np
import pytest

from mpifusion import FusedCommBuffer, Param
from mpifusion.dtypes import bfloat16, finfo, float16, float32

pytestmark = pytest.mark.mpi

SHAPES = [(37,), (8, 33), (5,), (130,)]
DTYPES = [pytest.param(float16, id="fp16"), pytest.param(bfloat16, id="bf16")]
U32 = 2.0 ** -24


def _unit_roundoff(dtype) -> float:
    return float(finfo(dtype).eps) / 2


def _tiny(dtype) -> float:
    return float(finfo(dtype).smallest_subnormal) / 2


def _grid_grads(n: int, dtype, seed: int) -> list:
    """Per rank, per param: half values k * 2^-(p-1) with |k| <= 2^(p-1), p the significand
    bits. Any sum of <= 8 of them needs <= p + 3 bits: exact in fp32, whatever the order."""
    p = finfo(dtype).nmant + 1
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        out.append([(rng.integers(-2 ** (p - 1), 2 ** (p - 1) + 1, size=s)
                     * 2.0 ** -(p - 1)).astype(dtype) for s in SHAPES])
    return out


def _random_grads(n: int, dtype, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        # mixed magnitudes, so that sums cancel and spread over many binades
        out.append([(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 2, size=s)).astype(dtype)
                    for s in SHAPES])
    return out


def _build(comm, dtype, use_main_grad: bool, **kw):
    params = [Param(f"w{i}", np.zeros(s, dtype)) for i, s in enumerate(SHAPES)]
    if use_main_grad:
        kw["use_main_grad"] = True
    return params, FusedCommBuffer(0, params, comm, **kw)


def _run_step(buf, params, mine, use_main_grad):
    for p, g in zip(params, mine):
        buf.add_grad(p, grad=g.astype(np.float32) if use_main_grad else g)


def _grad(p, use_main_grad):
    return p.main_grad if use_main_grad else p.grad


# --------------------------------------------------------------------------- bit-exact rule
@pytest.mark.matrix
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["reduce_avg", "scale_after_comm"])
def test_average_rounds_once_to_the_buffer_dtype(comm, dtype, mode, request):
    n, r = comm.Get_size(), comm.Get_rank()
    grads = _grid_grads(n, dtype, seed=11)
    kw = {"use_reduce_avg": True} if mode == "reduce_avg" else {"scale_after_comm": True}
    params, buf = _build(comm, dtype, False, act="all_reduce", **kw)
    _run_step(buf, params, grads[r], False)
    buf.scale_grads()
    inv = np.float32(1.0 / n)
    for i, p in enumerate(params):
        total = np.sum([grads[k][i].astype(np.float64) for k in range(n)], axis=0)
        assert np.array_equal(total.astype(np.float32).astype(np.float64), total)  # grid is exact
        expected = (total.astype(np.float32) * inv).astype(dtype)
        got = p.grad
        bad = np.flatnonzero(got.view(np.uint16).ravel() != expected.view(np.uint16).ravel())
        assert bad.size == 0, (
            f"rank {r}/{n} {mode} {np.dtype(dtype).name} {p.name}: {bad.size} element(s) not "
            f"rounded once, e.g. sum {total.ravel()[bad[0]]!r}: got {got.ravel()[bad[0]]!r}, "
            f"expected {expected.ravel()[bad[0]]!r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_is_the_fp32_sum_rounded_once(comm, dtype):
    """The reduction rule itself, on the communicator a buffer uses (no 1/n involved)."""
    from mpifusion.comm import Communicator

    n, r = comm.Get_size(), comm.Get_rank()
    grads = _grid_grads(n, dtype, seed=12)
    channel = Communicator(comm)
    for i, mine in enumerate(grads[r]):
        work = mine.ravel().copy()
        channel.allreduce(work, name=f"raw sum {i}").wait()
        total = np.sum([grads[k][i].astype(np.float64).ravel() for k in range(n)], axis=0)
        expected = total.astype(np.float32).astype(dtype)
        assert np.array_equal(work.view(np.uint16), expected.view(np.uint16)), f"tensor {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_shard_rounds_once(comm, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    grads = _grid_grads(n, dtype, seed=13)
    params, buf = _build(comm, dtype, False, act="reduce_scatter", use_reduce_avg=True)
    _run_step(buf, params, grads[r], False)
    buf.scale_grads()
    full = np.zeros(buf.buffer_size, np.float64)
    for i, p in enumerate(params):
        slot = buf.layout[p.name]
        full[slot.offset:slot.end] = np.sum([grads[k][i].astype(np.float64).ravel()
                                             for k in range(n)], axis=0)
    begin, end = buf.layout.shard_range(r)
    expected = (full[begin:end].astype(np.float32) * np.float32(1.0 / n)).astype(dtype)
    assert np.array_equal(buf.grad_storage[begin:end].view(np.uint16), expected.view(np.uint16))


# --------------------------------------------------------------------------- float64 bound
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_main_grad", [False, True], ids=["half-grads", "fp32-main-grads"])
@pytest.mark.parametrize("act", ["all_reduce", "reduce"])
def test_random_grads_meet_the_documented_bound(comm, dtype, use_main_grad, act):
    n, r = comm.Get_size(), comm.Get_rank()
    grads = _random_grads(n, dtype, seed=14)
    kw = {"dst": 0} if act == "reduce" else {}
    params, buf = _build(comm, dtype, use_main_grad, act=act, use_reduce_avg=True, **kw)
    _run_step(buf, params, grads[r], use_main_grad)
    buf.scale_grads()
    if act == "reduce" and r != 0:
        return  # only the root holds the result
    out_dtype = float32 if use_main_grad else dtype
    u = U32 if use_main_grad else _unit_roundoff(dtype)
    for i, p in enumerate(params):
        parts = np.stack([grads[k][i].astype(np.float64) for k in range(n)])
        x = parts.sum(axis=0) / n
        mag = np.abs(parts).sum(axis=0) / n
        bound = u * np.abs(x) + n * U32 * mag * (1 + u) + _tiny(out_dtype)
        got = _grad(p, use_main_grad)
        assert got.dtype == out_dtype
        err = np.abs(got.astype(np.float64) - x)
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), (
            f"rank {r}/{n} {p.name}: |got - x| = {err.ravel()[worst]:.3g} > bound "
            f"{bound.ravel()[worst]:.3g} at x = {x.ravel()[worst]!r}")
