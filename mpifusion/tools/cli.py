"""The ``mpifusion`` command: layout, run, check, info, bench.

Every rank of an ``mpiexec`` job parses the same arguments and validates the same input, so a
bad input makes every rank exit with code 2 while only rank 0 prints the one-line error;
output of the other subcommands is printed by rank 0 only as well.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
from typing import Any, Optional, Sequence, Tuple

from ..errors import FusionError

EXIT_PASS, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


class UsageError(FusionError, ValueError):
    """Bad input found after parsing (one line; names the option, file or field)."""


#: Rank variables launchers set (MPICH/hydra, Open MPI, PMIx, Slurm): commands that need no
#: MPI (layout, check) still print once per job without initialising MPI.
_RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def _mpi() -> Any:
    """mpi4py's MPI module, imported (and MPI initialised) only by commands that talk."""
    from mpi4py import MPI

    return MPI


def _rank() -> int:
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None and mod.Is_initialized() and not mod.Is_finalized():
        return mod.COMM_WORLD.Get_rank()
    for key in _RANK_ENV:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def _say(line: str = "") -> None:
    if _rank() == 0:
        print(line, flush=True)


def _error(command: str, message: str) -> int:
    if _rank() == 0:
        print(f"mpifusion {command}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_INPUT


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are printed by rank 0 only (every rank still exits 2)."""

    def error(self, message: str):  # type: ignore[override]
        if _rank() == 0:  # one line, like every other bad input (the usage is in --help)
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr,
                  flush=True)
        raise SystemExit(EXIT_INPUT)

    def _print_message(self, message: str, file: Any = None) -> None:
        if _rank() == 0:
            super()._print_message(message, file)


_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def byte_size(text: str) -> int:
    """``268435456``, ``256M``, ``256MiB``, ``1G``: bytes, suffixes are powers of 1024."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 268435456 or "
                                         f"256M, got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _act(text: str) -> str:
    from ..errors import LayoutError
    from ..plan.actions import HookAction

    try:
        return HookAction.parse(text).key
    except LayoutError:
        raise argparse.ArgumentTypeError(f"expected all_reduce, reduce or reduce_scatter, "
                                         f"got {text!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from ..presets import PRESETS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME",
                     help=f"built-in model (default tiny): {', '.join(PRESETS)}")
    src.add_argument("--spec", metavar="FILE", help="JSON spec file (README, 'Command line')")
    p.add_argument("--act", type=_act, help="all_reduce, reduce or reduce_scatter "
                   "(default: the spec's, all_reduce for presets)")
    p.add_argument("--group-size", type=byte_size, metavar="BYTES",
                   help="bytes per fused buffer, e.g. 256M (default: the spec's, 256 MiB)")
    p.add_argument("--main-grad", action=argparse.BooleanOptionalAction, default=None,
                   help="fp32 main grads (default: the spec's; on for fp16/bf16 presets)")
    p.add_argument("--dtype", metavar="DTYPE",
                   help="dtype of every param, as in spec files: float32, bfloat16, float16, "
                   "float64 (or fp32, bf16, fp16, fp64)")
    p.add_argument("--dst", type=int, metavar="RANK",
                   help="root rank for --act reduce (default: the spec's, else 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpifusion", description="Fused gradient buffers over MPI: plan "
                     "layouts, run and verify a gradient sync, check another implementation.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"mpifusion {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    lay = sub.add_parser("layout", help="print the buffers fused_parameters builds (no MPI)",
                         description="Print the buffers fused_parameters would build, in its "
                         "order, with every param's offset and (reduce_scatter) slice per rank.")
    _add_model_args(lay)
    lay.add_argument("--nranks", type=_positive, help="number of ranks (needed by reduce_scatter)")
    lay.add_argument("--json", action="store_true", help="print the layout as JSON")
    lay.add_argument("--layout", metavar="THEIRS.json",
                     help="compare another implementation's layout JSON with ours; "
                     "exit 1 and list every difference when they differ")

    run = sub.add_parser("run", help="the job: fuse, sync and verify (under mpiexec/srun)",
                         description="Fuse a model's params, emulate backward with add_grad for "
                         "--acc-steps micro-steps per step, sync, and verify every rank's result "
                         "against a float64 reference with a stated error bound.")
    _add_model_args(run)
    run.add_argument("--steps", type=_positive, default=3, help="training steps (default 3)")
    run.add_argument("--acc-steps", type=_positive,
                     help="micro-steps per step (default: the spec's; 2 for presets)")
    run.add_argument("--seed", type=_non_negative, default=0, help="seed of the synthetic gradients")
    run.add_argument("--release-grads", action="store_true",
                     help="allocate grad buffers per step and free them after (release_grads)")
    run.add_argument("--reduce-avg", action="store_true",
                     help="average in the collective (use_reduce_avg) instead of SUM then 1/n")
    run.add_argument("--scale-after-comm", action="store_true",
                     help="scale by 1/n after the collective instead of before")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    strategies = _strategies()
    if strategies:
        run.add_argument("--strategy", choices=strategies,
                         help="how the Communicator runs collectives (default: "
                         "$MPIFUSION_COMM_STRATEGY, else the library default)")

    chk = sub.add_parser("check", help="check another implementation's dump (no MPI)",
                         description="Recompute the reduced gradients of a dump in float64 and "
                         "compare with what the implementation held (README, 'Checking another "
                         "implementation').")
    chk.add_argument("--spec", required=True, metavar="FILE", help="JSON spec of the dump")
    chk.add_argument("dir", metavar="DIR", help="folder with rank{r}.npz per rank")
    chk.add_argument("--json", action="store_true", help="print the report as JSON")
    chk.add_argument("--plot", metavar="FILE.png",
                     help="also draw error/bound per param and rank into FILE.png (matplotlib)")
    chk.add_argument("--reduce-avg", action="store_true",
                     help="the implementation averaged in the collective (use_reduce_avg): "
                     "non-root ranks of reduce keep their unscaled local sum")

    inf = sub.add_parser("info", help="MPI library, thread level, CUDA-awareness, versions")
    inf.add_argument("--json", action="store_true", help="print as JSON")

    sub.add_parser("bench", help="benchmarks (mpifusion.bench); arguments go to it",
                   add_help=False)

    tun = sub.add_parser("tune", help="measure the best segment size here and record it "
                         "(under mpiexec -n 2 or more)",
                         description="Time mpifusion's all-reduce + 1/n at several segment "
                         "sizes and record the fastest for this machine type in a tune file "
                         "that the library takes as its default segment size "
                         "(segment_bytes= and $MPIFUSION_SEGMENT_BYTES still win).")
    from .tune import add_arguments as _tune_arguments

    _tune_arguments(tun)
    return parser


# --------------------------------------------------------------------------- specs


def _strategies() -> tuple:
    from ..config import STRATEGIES

    return STRATEGIES


def _check_dst(dst: Optional[int], world: Optional[int], nranks: Optional[int]) -> None:
    """--dst is a rank: of the job (``world``, for run), else below --nranks when given.
    (-1, a spec's "no root", is no rank: before this check ``--act reduce --dst -1`` quietly
    meant rank 0, and run's ``--dst 5`` on 2 ranks was blamed on the spec.)"""
    if dst is None:
        return
    if world is not None:
        if not 0 <= dst < world:
            raise UsageError(f"--dst: expected a rank of this job, in [0, {world}) "
                             f"({world} rank(s)), got {dst}")
    elif nranks is not None:
        if not 0 <= dst < nranks:
            raise UsageError(f"--dst: expected a rank in [0, {nranks}) (--nranks {nranks}), "
                             f"got {dst}")
    elif dst < 0:
        raise UsageError(f"--dst: expected a rank >= 0, got {dst}")


def spec_from_args(args: argparse.Namespace, *, run: bool = False,
                   world: Optional[int] = None) -> Any:
    """The spec named by --preset/--spec with the command-line overrides applied; ``world``:
    the job's number of ranks (run), which --dst must be below."""
    from ..dtypes import is_half
    from ..spec import Spec, load_spec, normalize_dtype

    _check_dst(args.dst, world, getattr(args, "nranks", None))
    overrides: dict = {}
    if args.act is not None:
        overrides["act"] = args.act
    if args.group_size is not None:
        overrides["group_size"] = args.group_size
    if args.main_grad is not None:
        overrides["use_main_grad"] = args.main_grad
    if getattr(args, "nranks", None) is not None:
        overrides["nranks"] = args.nranks
    if getattr(args, "acc_steps", None) is not None:
        overrides["acc_steps"] = args.acc_steps
    if args.dst is not None:
        overrides["dst"] = args.dst
    dtype = normalize_dtype(args.dtype, "--dtype") if args.dtype is not None else None
    if args.spec is not None:
        base = load_spec(args.spec).to_dict()
        if run:
            _refuse_sum(args.spec)
        if dtype is not None:
            base["params"] = [{**p, "dtype": dtype} for p in base["params"]]
        source = args.spec
    else:
        from ..presets import get_preset

        name = args.preset or "tiny"
        params = get_preset(name)  # --dtype: any dtype a spec file takes (float64 too)
        if dtype is not None:
            params = [{**p, "dtype": dtype} for p in params]
        base = {"params": params, "use_main_grad": is_half(params[0]["dtype"])}
        if run:
            base["acc_steps"] = 2
        source = f"preset {name}"
    merged = {**base, **overrides}
    if merged.get("act") == "reduce" and merged.get("dst", -1) == -1:
        merged["dst"] = 0
    if merged.get("act") != "reduce" and "dst" not in overrides:
        merged["dst"] = -1
    return Spec.from_dict(merged, source=source)


def _refuse_sum(path: str) -> None:
    """``run`` checks what FusedCommBuffer does, and FusedCommBuffer always averages over
    ranks (as Paddle does): a spec that explicitly asks for the sum is refused, not ignored."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):  # load_spec read it a moment ago; nothing to add
        return
    if isinstance(raw, dict) and raw.get("average") is False:
        raise UsageError(f"{path}: average: run always averages over ranks (FusedCommBuffer "
                         f"scales by 1/n, as Paddle does), but the spec asks for the sum; "
                         f"set \"average\": true or leave it out (check reads it)")


def _input_errors() -> tuple:
    from ..errors import LayoutError
    from ..oracle import DumpError
    from ..presets import PresetError
    from ..config import OptionError
    from ..plan.grouping import PlanError
    from ..spec import SpecError

    return (SpecError, PresetError, PlanError, LayoutError, OptionError, DumpError, UsageError)


# --------------------------------------------------------------------------- subcommands


def cmd_layout(args: argparse.Namespace) -> int:
    from .render import (LayoutDocError, check_layout_doc, compare_layouts, layout_json,
                         layout_table)

    from ..limits import InputLimitError, layout_problem, loads_strict_json, read_text

    spec = spec_from_args(args)
    if spec.act == "reduce_scatter" and spec.nranks is not None:
        problem = layout_problem(len(spec.fused_params()), spec.nranks)
        if problem:
            raise UsageError(problem)
    buffers = spec.plan()
    doc = layout_json(spec, buffers)
    if args.layout is not None:
        try:  # a regular file, bounded in size, depth and integer digits
            theirs = loads_strict_json(read_text(args.layout), LayoutDocError)
            check_layout_doc(theirs)  # the schema's fields of the schema's types (one line)
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{args.layout}: cannot read: {getattr(exc, 'strerror', None) or exc}")
        except (InputLimitError, LayoutDocError) as exc:
            raise UsageError(f"{args.layout}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"{args.layout}: not valid JSON: {exc}")
        diffs = compare_layouts(doc, theirs)
        for line in diffs:
            _say(line)
        _say(f"FAIL: {len(diffs)} difference(s) from {args.layout}" if diffs
             else f"PASS: {args.layout} matches ({len(buffers)} buffer(s))")
        return EXIT_FAIL if diffs else EXIT_PASS
    _say(json.dumps(doc, indent=1) if args.json else layout_table(doc, buffers))
    return EXIT_PASS


def cmd_run(args: argparse.Namespace) -> int:
    from ..config import CommOptions
    from .runjob import RunOptions, agree, run_job

    MPI = _mpi()
    comm = MPI.COMM_WORLD
    spec, error, comm_options = None, None, None
    try:
        spec = spec_from_args(args, run=True, world=comm.Get_size())
        comm_options = CommOptions.from_env(strategy=getattr(args, "strategy", None))
    except _input_errors() as exc:
        error = str(exc)
    error = agree(comm, error)
    if error is not None:
        return _error("run", error)
    options = RunOptions(steps=args.steps, seed=args.seed, release_grads=args.release_grads,
                         reduce_avg=args.reduce_avg, scale_after_comm=args.scale_after_comm,
                         progress=not args.no_progress, comm_options=comm_options)
    try:
        return run_job(spec, options, comm, source=args.spec or f"preset {args.preset or 'tiny'}")
    except MemoryError:  # past the estimate checked before building: one line, then abort
        sys.stderr.write(f"mpifusion run: error: rank {comm.Get_rank()}: out of memory during "
                         f"the run (a smaller model, fewer ranks per machine or "
                         f"--release-grads need less)\n")
        sys.stderr.flush()
        if comm.Get_size() > 1:
            comm.Abort(EXIT_INPUT)
        return EXIT_INPUT
    except Exception:  # a rank failing mid-collective must not leave the others blocked
        import traceback

        sys.stderr.write(f"[rank {comm.Get_rank()}] mpifusion run failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        if comm.Get_size() > 1:
            comm.Abort(EXIT_FAIL)
        return EXIT_FAIL


def cmd_check(args: argparse.Namespace) -> int:
    """A thin layer over :func:`mpifusion.oracle.check`: print its report, exit 0/1."""
    from ..oracle import check

    plot_file = None
    if args.plot:
        from ..oracle.plot import PlotError, plot_path, plot_report

        try:  # a directory is refused before the check; the path printed is the one written
            plot_file = plot_path(args.plot)
        except PlotError as exc:
            raise UsageError(f"--plot: {exc}") from None
    report = check(args.spec, args.dir, reduce_avg=args.reduce_avg)
    if plot_file is not None:
        try:
            plot_file = plot_report(report, plot_file)
        except PlotError as exc:
            raise UsageError(f"--plot: {exc}") from None
    if args.json:
        _say(json.dumps(report.to_json(), indent=1))
    else:
        for line in report.lines():
            _say(line)
        if plot_file is not None:
            _say(f"plot: {plot_file}")
    return EXIT_PASS if report.ok else EXIT_FAIL


_THREAD_LEVELS = {"THREAD_SINGLE": "single", "THREAD_FUNNELED": "funneled",
                  "THREAD_SERIALIZED": "serialized", "THREAD_MULTIPLE": "multiple"}


def _segment_default() -> Tuple[Optional[int], str]:
    """This rank's default segment size and where it comes from: ranks of one job take the
    smallest, so a node with another tune file or cache shows up here (None: the setting
    is refused, and why)."""
    from ..config import CommOptions
    from ..errors import OptionError
    from ..machine import default_segment_source

    try:
        options = CommOptions.from_env()
    except OptionError as exc:
        return None, f"refused: {exc}"
    if options.segment_bytes is not None:
        return options.segment, "MPIFUSION_SEGMENT_BYTES"
    return options.segment, default_segment_source()


def collect_info() -> dict:
    """What a user needs to know of the MPI and the devices this job sees."""
    import mpi4py
    import numpy

    from .. import __version__
    from ..arrays import backend
    from ..arrays.cuda import is_cuda_aware

    MPI = _mpi()

    level = MPI.Query_thread()
    level_name = next((name for attr, name in _THREAD_LEVELS.items()
                       if getattr(MPI, attr) == level), str(level))
    cupy = backend.cupy_module()
    gpus = 0
    if cupy is not None:
        try:
            gpus = int(cupy.cuda.runtime.getDeviceCount())
        except Exception:
            gpus = 0
    version = MPI.Get_version()
    from .slurm import slurm_view, view_json

    segment, source = _segment_default()

    return {
        # Open MPI ends its version string with a NUL byte
        "mpi_library": MPI.Get_library_version().replace("\0", "").strip().splitlines()[0],
        "mpi_standard": f"{version[0]}.{version[1]}",
        "thread_level": level_name,
        "world_size": MPI.COMM_WORLD.Get_size(),
        "processor": MPI.Get_processor_name(),
        "segment_bytes": segment,
        "segment_source": source,
        "cuda_aware_mpi": bool(is_cuda_aware()),
        "cupy": getattr(cupy, "__version__", None) if cupy is not None else None,
        "gpus": gpus,
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpifusion": __version__,
        "python": platform.python_version(),
        "slurm": view_json(slurm_view(os.environ)),  # None outside a Slurm job
    }


def cmd_info(args: argparse.Namespace) -> int:
    """Exit 1 when srun started more tasks than MPI's world holds (PMI mismatch)."""
    from .slurm import launch_problem, slurm_view, summary_lines

    info = collect_info()
    view = slurm_view(os.environ)
    problem = launch_problem(view, info["world_size"])
    if args.json:
        _say(json.dumps({**info, "launch_problem": problem}, indent=1))
        return EXIT_FAIL if problem else EXIT_PASS
    labels = {"mpi_library": "MPI library", "mpi_standard": "MPI standard",
              "thread_level": "thread level", "world_size": "world size",
              "processor": "processor", "segment_bytes": "segment size",
              "cuda_aware_mpi": "CUDA-aware MPI",
              "cupy": "cupy", "gpus": "GPUs", "numpy": "numpy", "mpi4py": "mpi4py",
              "mpifusion": "mpifusion", "python": "python"}
    for key, label in labels.items():
        value = info[key]
        if key == "cupy" and value is None:
            value = "not installed"
        if key == "segment_bytes":
            value = (f"{value} bytes ({info['segment_source']})" if value is not None
                     else info["segment_source"])
        _say(f"{label + ':':<16}{value}")
        if key == "processor":  # the Slurm view next to MPI's
            for slurm_label, slurm_value in summary_lines(view):
                _say(f"{slurm_label + ':':<16}{slurm_value}")
    if problem:
        _say(f"warning: {problem}")
        return EXIT_FAIL
    return EXIT_PASS


def cmd_tune(args: argparse.Namespace) -> int:
    from .tune import run

    return run(args, say=_say)


def cmd_bench(argv: Sequence[str]) -> int:
    """Bad arguments: one line from rank 0 and exit 2 on every rank (checked on every rank
    before anything is measured), as for the other subcommands."""
    bench = importlib.import_module("mpifusion.tools.bench")
    try:
        return int(bench.main(list(argv)) or 0)
    except SystemExit as exc:  # --help, usage errors (printed by rank 0)
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    except _input_errors() as exc:
        return _error("bench", str(exc))


_COMMANDS = {"layout": cmd_layout, "run": cmd_run, "check": cmd_check, "info": cmd_info,
             "tune": cmd_tune}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``mpifusion`` and ``python -m mpifusion``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    try:
        return _COMMANDS[args.command](args)
    except _input_errors() as exc:
        return _error(args.command, str(exc))
    except BrokenPipeError:  # e.g. `mpifusion layout | head`: not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PASS
