"""``mpifusion bench``'s arguments, checked on every rank before anything is measured.

Every rank parses the same command line, so a bad value makes every rank refuse alike: one
line naming the option (OptionError, PresetError or SpecError), exit 2.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from ...config import STRATEGIES, parse_strategy, parse_window
from ...errors import OptionError
from ...presets import get_preset
from ...spec import normalize_dtype
from ..argtypes import Parser, non_negative_int, positive_float, positive_int
from .cluster import DEFAULT_SIZES, parse_sizes
from .workload import MiB

#: what ``--only`` may name: the sections that run alone (the run's meta always runs)
ONLY = ("cluster",)

#: the first paragraph of ``mpifusion bench --help``
DESCRIPTION = ("``mpifusion bench``: mpifusion's gradient sync side by side with raw MPI, "
               "OSU/nccl-tests style.")


def build_parser() -> argparse.ArgumentParser:
    """``mpifusion bench``'s options; usage errors are printed by rank 0 only, exit 2."""
    ap = Parser(prog="mpifusion bench", description=DESCRIPTION,
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", default="gpt2-small", help="model whose grads are synced")
    ap.add_argument("--dtype", default=None,
                    help="dtype of every param, as in spec files (float32, bf16, ...)")
    ap.add_argument("--group-mb", type=positive_float, default=256.0,
                    help="fusion group size of the main measurements (Paddle's default 256)")
    ap.add_argument("--group-sweep", default="auto",
                    help="fusion group sizes in MiB to sweep, e.g. 0,16,64,256,1024 (0: one "
                    "buffer per param); auto: four sizes up to the model's grads, and 0")
    ap.add_argument("--size-sweep", default="auto",
                    help="message sizes 2^a..2^b bytes, step c in the exponent (a:b:c); "
                    "auto: 2^12 up to the model's grad bytes (at most 2^28), step 2")
    ap.add_argument("--segments-mb", default="4,8,16,32",
                    help="segment sizes (MiB) of the raw blocking candidates")
    ap.add_argument("--iters", type=positive_int, default=5)
    ap.add_argument("--warmup", type=non_negative_int, default=1)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--windows", default="1,2,4,8",
                    help="nonblocking windows (segments in flight) swept against thread")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed gloo")
    ap.add_argument("--cluster-sizes", default=DEFAULT_SIZES,
                    help="fp32 grads per rank of the cluster section (only where the job "
                    "spans nodes): sizes (K, M binary) and 'preset' (the model's grads)")
    ap.add_argument("--only", default=None, choices=ONLY,
                    help="run this section alone (cluster: the multi-node section; it "
                    "measures nothing on one node)")
    ap.add_argument("--out", default="bench_out", metavar="DIR",
                    help="folder for the JSON results and the plot (created; git-ignored)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="results file (default: DIR/bench_PRESET_nRANKS.json)")
    ap.add_argument("--png", default=None, metavar="FILE",
                    help="plot file (default: DIR/bench_PRESET_nRANKS.png; '' for none)")
    return ap


def _bad(option: str, expected: str, text: str) -> OptionError:
    return OptionError(f"{option}: expected {expected}, got {text!r}")


def _mib_list(text: str, option: str, allow_zero: bool) -> List[float]:
    """``"0,16,64"`` -> MiB values (>= 0, or > 0), in the given order."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 or (v == 0 and not allow_zero) or v != v or v == float("inf")
                         for v in values):
        raise _bad(option, f"comma-separated MiB {'>= 0' if allow_zero else '> 0'}", text)
    return values


def _windows(text: str) -> List[int]:
    """``"1,2,4,8"`` -> nonblocking windows, each checked like ``CommOptions.window``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise _bad("--windows", "comma-separated ints in [1, 64]", text)
    return list(dict.fromkeys(parse_window(x, "--windows") for x in items))


def _exponents(text: str) -> range:
    """``"12:28:2"`` -> range(12, 29, 2): message sizes 2^e bytes (4 B to 1 GiB)."""
    try:
        lo, hi, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise _bad("--size-sweep", "a:b:c with ints a <= b and c >= 1, or auto", text) from None
    if not (2 <= lo <= hi <= 30 and step >= 1):
        raise _bad("--size-sweep", "a:b:c with 2 <= a <= b <= 30 and c >= 1", text)
    return range(lo, hi + 1, step)


def auto_size_sweep(nbytes: int) -> List[int]:
    """Message sizes 4 KiB, 16 KiB, ... up to the first power of two >= ``nbytes`` (at most
    256 MiB): the sweep of a tiny model stops where its grads do."""
    top = min(28, max(12, math.ceil(math.log2(max(nbytes, 1)))))
    sizes = [1 << e for e in range(12, top + 1, 2)]
    return sizes if sizes[-1] == 1 << top else sizes + [1 << top]


def auto_group_sweep(nbytes: int) -> List[float]:
    """0 (one buffer per param) and the four sizes of the ladder 1/64, 1/16, ... 1024 MiB
    that end at the first one holding all ``nbytes`` (GPT-2-small: 0, 16, 64, 256, 1024)."""
    ladder = [4.0 ** k for k in range(-3, 6)]  # 1/64 MiB .. 1024 MiB
    upto = next((i for i, g in enumerate(ladder) if g * MiB >= nbytes), len(ladder) - 1)
    return [0.0] + ladder[max(0, upto - 3):upto + 1]


@dataclass
class Settings:
    """The validated arguments: the same on every rank, so every rank refuses alike."""

    preset: str
    dtype: Optional[str]
    group_bytes: int
    group_sweep: Optional[List[float]]  # None: auto, from the model's grad bytes
    size_sweep: Optional[List[int]]     # None: auto
    segments: List[int]
    strategies: List[str]
    windows: List[int]
    iters: int
    warmup: int
    torch: bool
    json_path: Optional[str]
    png_path: Optional[str]
    cluster_sizes: List[Any] = field(default_factory=list)
    only: Optional[str] = None


def settings(args: argparse.Namespace, nranks: int) -> Settings:
    """Check every argument before anything is measured (OptionError/PresetError/SpecError,
    one line naming the option)."""
    dtype = normalize_dtype(args.dtype, "--dtype") if args.dtype is not None else None
    get_preset(args.preset)  # PresetError names the valid presets
    strategies = [parse_strategy(s.strip(), "--strategies")
                  for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise _bad("--strategies", f"a comma-separated list of {', '.join(STRATEGIES)}",
                   args.strategies)
    base = os.path.join(args.out, f"bench_{args.preset}_n{nranks}")
    try:
        cluster_sizes = parse_sizes(args.cluster_sizes)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    return Settings(
        preset=args.preset, dtype=dtype, group_bytes=int(args.group_mb * MiB),
        group_sweep=(None if args.group_sweep == "auto"
                     else _mib_list(args.group_sweep, "--group-sweep", allow_zero=True)),
        size_sweep=(None if args.size_sweep == "auto"
                    else [1 << e for e in _exponents(args.size_sweep)]),
        segments=[int(x * MiB) for x in _mib_list(args.segments_mb, "--segments-mb", False)],
        strategies=list(dict.fromkeys(strategies)), windows=_windows(args.windows),
        iters=args.iters, warmup=args.warmup,
        torch=not args.no_torch,
        json_path=base + ".json" if args.json is None else (args.json or None),
        png_path=base + ".png" if args.png is None else (args.png or None),
        cluster_sizes=cluster_sizes, only=args.only)


def prepare_outputs(s: Settings) -> Optional[str]:
    """Create the output folders (rank 0); a one-line error, or None."""
    for path in (s.json_path, s.png_path):
        folder = os.path.dirname(path) if path else ""
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                return f"--out: cannot create {folder}: {exc.strerror or exc}"
            if not os.access(folder, os.W_OK):
                return f"--out: cannot write into {folder}"
    return None

