"""Half <-> fp32 casts per segment: mpifusion.arrays.halfcast against the reference casts
(numpy fp16, ml_dtypes bf16) and a memcpy of the fp32 segment, timed side by side in rounds.

    python benchmarks/bench_halfcast.py [--elements 2097152] [--rounds 7] [--repeat 20]
    python benchmarks/bench_halfcast.py --sums [--elements 33554432]

Each round times every candidate once (median of ``--repeat`` calls); the table gives the
median over rounds in ms and the ratio to memcpy measured in the same round, so load that
drifts on a shared machine hits all of them alike.

``--sums``: does the bf16 sum depend on the data? ``sum_half`` of 2 sources into a third
array, 1 MiB chunks, on every bf16 kernel path this CPU has and on fp16, for normal values,
all ones and fp32-subnormal values (bf16 can hold them, fp16 cannot: its row rounds them to
0), each against the fp16 sum of the normal values in the same round; then the default
paths' mean (the sum x 1/2: a multiply). On one Intel Xeon the
bf16 sum once took twice the fp16 one on random values and the same on all ones; this is
the table to compare with on any machine.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from mpifusion.arrays import halfcast
from mpifusion.dtypes import bfloat16, float16, float32
from mpifusion.machine import cpu_model

import record  # benchmarks/record.py: results go to benchmarks/results/


def _time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))



Series = Dict[str, List[float]]


def _rounds(cands: Dict[str, Callable[[], object]], base: str, rounds: int,
            repeat: int) -> Tuple[Series, Series]:
    """Every candidate's time per round and its ratio to ``base`` in the same round."""
    times: Series = {k: [] for k in cands}
    ratios: Series = {k: [] for k in cands}
    for _ in range(rounds):
        t = {k: _time(fn, repeat) for k, fn in cands.items()}
        for k in cands:
            times[k].append(t[k])
            ratios[k].append(t[k] / t[base])
    return times, ratios


def _table(first: str, base: str, times: Series, ratios: Series, ms_digits: int) -> None:
    print(f"| {first} | ms (median) | / {base} (median, min-max over rounds) |")
    print("| --- | --- | --- |")
    for k, r in ratios.items():
        print(f"| {k} | {np.median(times[k]) * 1e3:.{ms_digits}f} | {np.median(r):.2f} "
              f"({min(r):.2f}-{max(r):.2f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=2 * 1024 * 1024,
                    help="elements per segment (default 2M: an 8 MiB fp32 segment)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--sums", action="store_true",
                    help="time sum_half per bf16 kernel path and kind of data instead")
    record.add_arguments(ap)
    args = ap.parse_args()
    if args.sums:
        with record.recorded(args, "bench_halfcast_sums", "halfcast-sums",
                             "fp16/bf16 sums of 2 sources per kernel path and kind of data"):
            run_sums(args)
        return
    with record.recorded(args, "bench_halfcast", "halfcast",
                         "half-precision casts of one segment against a memcpy (no MPI)"):
        run(args)


def _bf16_sum_on(path: str) -> Callable[..., int]:
    """``halfcast.sum_half`` for bf16 on the named kernel path (the compiled module's own
    entry, as the tests use it)."""
    from mpifusion.arrays import _halfcast as kern  # the compiled module itself
    u16, u32 = np.uint16, np.uint32

    def run_on(srcs: List[np.ndarray], dsts: List[np.ndarray], scale: Optional[float],
               acc: np.ndarray) -> int:
        factor = None if scale is None else float(np.float32(scale))
        return int(kern.sum_bf16_at(path, tuple(a.view(u16) for a in srcs),
                                    tuple(d.view(u16) for d in dsts), factor, acc.view(u32)))
    return run_on


def run_sums(args: argparse.Namespace) -> None:
    if halfcast.kernel_path() == "numpy":  # sum_half would do nothing and be timed
        raise SystemExit("bench_halfcast.py --sums: the compiled kernel is not in use here "
                         "($MPIFUSION_HALFCAST, or no build): there is no sum to time")
    n = args.elements
    chunk = (1 << 20) // 2  # 1 MiB of 2-byte elements
    rng = np.random.default_rng(0)
    normal = (rng.standard_normal(n) * 100).astype(float32)
    data = {"normal": normal, "ones": np.ones(n, float32),
            "subnormal": (normal * np.float32(1e-41)).astype(float32)}
    acc = np.empty(chunk, float32)

    def summer(fn: Callable[..., int], dtype: Any, values: np.ndarray,
               scale: Optional[float] = None) -> Callable[[], None]:
        a, b, out = values.astype(dtype), values[::-1].astype(dtype), np.empty(n, dtype)

        def run_all() -> None:
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                fn([a[s:e], b[s:e]], [out[s:e]], scale, acc[:e - s])
        return run_all

    cands: Dict[str, Callable[[], object]] = {}
    for kind, values in data.items():
        cands[f"fp16, {kind}"] = summer(halfcast.sum_half, float16, values)
        for path in halfcast.kernel_paths():
            cands[f"bf16 {path}, {kind}"] = summer(_bf16_sum_on(path), bfloat16, values)
    # a mean (x 1/2, the multiply of an average): the default paths only
    for kind, values in data.items():
        cands[f"fp16, {kind}, mean"] = summer(halfcast.sum_half, float16, values, 0.5)
        cands[f"bf16 {halfcast.kernel_path()}, {kind}, mean"] = summer(
            halfcast.sum_half, bfloat16, values, 0.5)
    base = "fp16, normal"
    times, ratios = _rounds(cands, base, args.rounds, 3)
    print(f"# sum_half of 2 sources into a third array, {n} elements in 1 MiB chunks, "
          f"{args.rounds} rounds x 3 calls; bf16 paths here: "
          f"{', '.join(halfcast.kernel_paths()) or 'none (no compiled kernel)'} (default "
          f"{halfcast.kernel_path()}); {cpu_model()}; numpy {np.__version__}")
    _table("sum, data", base, times, ratios, ms_digits=2)


def run(args: argparse.Namespace) -> None:
    n = args.elements
    rng = np.random.default_rng(0)
    f32 = (rng.standard_normal(n) * 100).astype(float32)
    dst32 = np.empty(n, float32)
    h16, b16 = f32.astype(float16), f32.astype(bfloat16)
    o16, ob16 = np.empty(n, float16), np.empty(n, bfloat16)

    def ref(dst, src):
        return lambda: np.copyto(dst, src, casting="unsafe")

    cands: Dict[str, Callable[[], object]] = {
        "memcpy fp32": lambda: np.copyto(dst32, f32),
        "fp16 widen, numpy": ref(dst32, h16),
        "fp16 widen, halfcast": lambda: halfcast.widen(h16, dst32),
        "fp16 round, numpy": ref(o16, f32),
        "fp16 round, halfcast": lambda: halfcast.narrow(f32, o16),
        "bf16 widen, ml_dtypes": ref(dst32, b16),
        "bf16 widen, halfcast": lambda: halfcast.widen(b16, dst32),
        "bf16 round, ml_dtypes": ref(ob16, f32),
        "bf16 round, halfcast": lambda: halfcast.narrow(f32, ob16),
    }
    if halfcast.path() == "f16c":  # the kernel is in use: its portable loops, for comparison
        from mpifusion.arrays import _halfcast as kern  # the compiled module itself
        u16, u32 = np.uint16, np.uint32
        cands["fp16 widen, portable C loop"] = lambda: kern.widen_f16_int(h16.view(u16),
                                                                       dst32.view(u32))
        cands["fp16 round, portable C loop"] = lambda: kern.narrow_f16_int(f32.view(u32),
                                                                        o16.view(u16))
        cands["bf16 round, portable C loop"] = lambda: kern.narrow_bf16_int(f32.view(u32),
                                                                         ob16.view(u16))
    times, ratios = _rounds(cands, "memcpy fp32", args.rounds, args.repeat)
    print(f"# {n} elements ({n * 4 / 2**20:.1f} MiB fp32), {args.rounds} rounds x "
          f"{args.repeat} calls; halfcast path: {halfcast.path()}, bf16 {halfcast.kernel_path()}; "
          f"{cpu_model()}; numpy {np.__version__}")
    _table("cast", "memcpy", times, ratios, ms_digits=3)


if __name__ == "__main__":
    main()
