"""The ``mpifusion`` command: layout, run, check, info, bench, tune.

Every rank of an ``mpiexec`` job parses the same arguments and validates the same input, so a
bad input makes every rank exit with code 2 while only rank 0 prints the one-line error;
output of the other subcommands is printed by rank 0 only as well (``console``).

Planning and checking run anywhere: this module and what it imports at the top load neither
MPI nor numpy, so ``mpifusion layout`` starts fast and never initialises MPI. The commands
that talk (run, info, tune, bench) import their MPI modules when they start.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from typing import Any, Optional, Sequence, Tuple

from .. import __version__
from ..config import STRATEGIES, CommOptions
from ..dtypes import is_half
from ..errors import FusionError, LayoutError, OptionError
from ..limits import InputLimitError, layout_problem, loads_strict_json, read_text
from ..machine import default_segment_source, segment_for
from ..plan.grouping import PlanError
from ..presets import PRESETS, PresetError, get_preset
from ..spec import Spec, SpecError, load_spec, normalize_dtype
from . import tune
from .argtypes import Parser, byte_size, hook_action, non_negative_int, positive_int
from .console import EXIT_FAIL, EXIT_INPUT, EXIT_PASS, error, say
from .render import (LayoutDocError, check_layout_doc, compare_layouts, layout_json,
                     layout_table)
from .slurm import launch_problem, slurm_view, summary_lines, view_json

__all__ = ["main", "build_parser", "spec_from_args", "collect_info", "byte_size", "UsageError",
           "EXIT_PASS", "EXIT_FAIL", "EXIT_INPUT", "EXIT_WEAK"]

#: ``mpifusion check``'s exit code for a WEAK verdict: no mismatch, but on inputs that cannot
#: reveal a missing reduction (a reducer that does nothing passes too); ``--allow-weak``
#: makes it 0. Neither 1 (a mismatch), 2 (bad input) nor 3 (srun could not start the job).
EXIT_WEAK = 4


class UsageError(FusionError, ValueError):
    """Bad input found after parsing (one line; names the option, file or field)."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", metavar="NAME",
                     help=f"built-in model (default tiny): {', '.join(PRESETS)}")
    src.add_argument("--spec", metavar="FILE", help="JSON spec file (docs/cli.md)")
    p.add_argument("--act", type=hook_action, help="all_reduce, reduce or reduce_scatter "
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
    parser = Parser(prog="mpifusion", description="Fused gradient buffers over MPI: plan "
                    "layouts, run and verify a gradient sync, check another implementation.")
    parser.add_argument("--version", action="version", version=f"mpifusion {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    lay = sub.add_parser("layout", help="print the buffers fused_parameters builds (no MPI)",
                         description="Print the buffers fused_parameters would build, in its "
                         "order, with every param's offset and (reduce_scatter) slice per rank.")
    _add_model_args(lay)
    lay.add_argument("--nranks", type=positive_int,
                     help="number of ranks (needed by reduce_scatter)")
    lay.add_argument("--json", action="store_true", help="print the layout as JSON")
    lay.add_argument("--layout", metavar="THEIRS.json",
                     help="compare another implementation's layout JSON with ours; "
                     "exit 1 and list every difference when they differ")

    run = sub.add_parser("run", help="the job: fuse, sync and verify (under mpiexec/srun)",
                         description="Fuse a model's params, emulate backward with add_grad for "
                         "--acc-steps micro-steps per step, sync, and verify every rank's result "
                         "against a float64 reference with a stated error bound.")
    _add_model_args(run)
    run.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    run.add_argument("--acc-steps", type=positive_int,
                     help="micro-steps per step (default: the spec's; 2 for presets)")
    run.add_argument("--seed", type=non_negative_int, default=0,
                     help="seed of the synthetic gradients")
    run.add_argument("--release-grads", action="store_true",
                     help="allocate grad buffers per step and free them after (release_grads)")
    run.add_argument("--reduce-avg", action="store_true",
                     help="average in the collective (use_reduce_avg) instead of SUM then 1/n")
    run.add_argument("--scale-after-comm", action="store_true",
                     help="scale by 1/n after the collective instead of before")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--inputs", choices=("random", "exact"), default="random",
                     help="random gradients checked against the error bound (default), or "
                     "mpifusion.oracle.exact_inputs, whose sums are exact in every order: the "
                     "result must be bit-exact (a mean over a non-power-of-two rank count: "
                     "within its rounding)")
    run.add_argument("--strategy", choices=STRATEGIES,
                     help="how the Communicator runs collectives (default: "
                     "$MPIFUSION_COMM_STRATEGY, else the library default)")

    chk = sub.add_parser("check", help="check another implementation's dump (no MPI)",
                         description="Recompute the reduced gradients of a dump in float64 and "
                         "compare with what the implementation held (docs/oracle.md).")
    chk.add_argument("--spec", required=True, metavar="FILE", help="JSON spec of the dump")
    chk.add_argument("dir", metavar="DIR", help="folder with rank{r}.npz per rank, or with "
                     "step{k}/ folders of them (each step checked, the failing one named)")
    chk.add_argument("--json", action="store_true", help="print the report as JSON")
    chk.add_argument("--plot", metavar="FILE.png",
                     help="also draw error/bound per param and rank into FILE.png (matplotlib)")
    chk.add_argument("--reduce-avg", action="store_true",
                     help="the implementation averaged in the collective (use_reduce_avg): "
                     "non-root ranks of reduce keep their unscaled local sum")
    chk.add_argument("--exact", action="store_true",
                     help="the inputs are exact in every order (mpifusion.oracle.exact_inputs): "
                     "demand the result bit for bit (a mean over a non-power-of-two rank "
                     "count: within its rounding); other inputs are refused (exit 2)")
    chk.add_argument("--allow-weak", action="store_true",
                     help="accept a check whose inputs cannot reveal a missing reduction "
                     "(every rank fed the same inputs to a mean, or zeros): exit 0, not "
                     f"{EXIT_WEAK} (WEAK); the last line still says it was weak")

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
    tune.add_arguments(tun)
    return parser


# --------------------------------------------------------------------------- specs


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
    """The errors that mean bad input: one line from rank 0, exit 2 on every rank."""
    from ..oracle.dumps import DumpError  # the oracle loads numpy: only once a command failed

    return (SpecError, PresetError, PlanError, LayoutError, OptionError, DumpError, UsageError)


# --------------------------------------------------------------------------- subcommands


def cmd_layout(args: argparse.Namespace) -> int:
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
            say(line)
        say(f"FAIL: {len(diffs)} difference(s) from {args.layout}" if diffs
             else f"PASS: {args.layout} matches ({len(buffers)} buffer(s))")
        return EXIT_FAIL if diffs else EXIT_PASS
    say(json.dumps(doc, indent=1) if args.json else layout_table(doc, buffers))
    return EXIT_PASS


def cmd_run(args: argparse.Namespace) -> int:
    from mpi4py import MPI  # initialises MPI: only the commands that talk import it

    from .runjob import RunOptions, agree, run_job  # MPI and numpy

    comm = MPI.COMM_WORLD
    spec, problem, comm_options = None, None, None
    try:
        spec = spec_from_args(args, run=True, world=comm.Get_size())
        comm_options = CommOptions.from_env(strategy=getattr(args, "strategy", None))
    except _input_errors() as exc:
        problem = str(exc)
    problem = agree(comm, problem)
    if problem is not None:
        return error("run", problem)
    options = RunOptions(steps=args.steps, seed=args.seed, release_grads=args.release_grads,
                         reduce_avg=args.reduce_avg, scale_after_comm=args.scale_after_comm,
                         progress=not args.no_progress, inputs=args.inputs,
                         comm_options=comm_options)
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
        sys.stderr.write(f"[rank {comm.Get_rank()}] mpifusion run failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        if comm.Get_size() > 1:
            comm.Abort(EXIT_FAIL)
        return EXIT_FAIL


def cmd_check(args: argparse.Namespace) -> int:
    """A thin layer over :func:`mpifusion.oracle.check`: print its report; exit 0 (PASS),
    1 (FAIL) or EXIT_WEAK (WEAK: no mismatch, on inputs that cannot reveal a missing
    reduction; 0 with ``--allow-weak``)."""
    from ..oracle import check  # numpy: layout starts without it
    from ..oracle.plot import PlotError, plot_path, plot_report

    plot_file = None
    if args.plot:
        try:  # a directory is refused before the check; the path printed is the one written
            plot_file = plot_path(args.plot)
        except PlotError as exc:
            raise UsageError(f"--plot: {exc}") from None
    report = check(args.spec, args.dir, reduce_avg=args.reduce_avg, exact=args.exact)
    if plot_file is not None:
        steps = getattr(report, "steps", None)  # a step{k}/ directory: plot the failing step
        shown = report if steps is None else report.report(
            (report.failing_steps or [steps[-1][0]])[0])
        try:
            plot_file = plot_report(shown, plot_file)
        except PlotError as exc:
            raise UsageError(f"--plot: {exc}") from None
    if args.json:
        say(json.dumps(report.to_json(allow_weak=args.allow_weak), indent=1))
    else:
        lines = report.lines(allow_weak=args.allow_weak)
        if plot_file is not None:  # the verdict stays the last line
            lines.insert(len(lines) - 1, f"plot: {plot_file}")
        for line in lines:
            say(line)
    return {"PASS": EXIT_PASS, "WEAK": EXIT_WEAK}.get(report.verdict(args.allow_weak),
                                                      EXIT_FAIL)


_THREAD_LEVELS = {"THREAD_SINGLE": "single", "THREAD_FUNNELED": "funneled",
                  "THREAD_SERIALIZED": "serialized", "THREAD_MULTIPLE": "multiple"}


def _segment_default() -> Tuple[Optional[int], str]:
    """This rank's default segment size and where it comes from: ranks of one job take the
    smallest, so a node with another tune file or cache shows up here (None: the setting
    is refused, and why)."""
    try:
        options = CommOptions.from_env()
    except OptionError as exc:
        return None, f"refused: {exc}"
    if options.segment_bytes is not None:
        return segment_for(options), "MPIFUSION_SEGMENT_BYTES"
    return segment_for(options), default_segment_source()


def _strategy_default() -> Tuple[str, str]:
    """The strategy a buffer built with the default options uses here, and why (a refused
    ``MPIFUSION_COMM_STRATEGY`` is shown as such, as for the segment size)."""
    from mpi4py import MPI

    from ..comm.communicator import resolve_strategy
    from ..comm.shm import node_layout

    try:
        options = CommOptions.from_env()
        _, _, per, uneven = node_layout(MPI.COMM_WORLD, options.node_size, options.timeout)
    except OptionError as exc:
        return "none", f"refused: {exc}"
    from ..comm import tuning

    strategy, why = resolve_strategy(options.strategy, MPI.COMM_WORLD.Get_size(), per, uneven)
    if strategy == "hierarchical" and options.strategy == "auto":  # and for a small buffer
        small, _ = resolve_strategy("auto", MPI.COMM_WORLD.Get_size(), per, uneven,
                                    nbytes=0)
        low = tuning.current().auto_hierarchical_min_bytes
        why += f"; {small} for buffers below {low >> 10} KiB"
    return strategy, why


#: ``mpifusion info``'s nodes line names this many nodes, then says how many more there are
#: (``--json`` lists every one)
NODES_SHOWN = 16


def _node_map(comm: Any) -> list:
    """Every node of ``comm`` and its ranks, ``[{"name": ..., "ranks": [...]}]`` in the order
    of each node's lowest rank, from every rank's ``MPI.Get_processor_name()`` (collective:
    one allgather of the names, as a node's shared-memory group cannot name itself)."""
    from mpi4py import MPI

    names = comm.allgather(MPI.Get_processor_name())
    nodes: dict = {}
    for rank, name in enumerate(names):
        nodes.setdefault(name, []).append(rank)
    return [{"name": name, "ranks": ranks} for name, ranks in nodes.items()]


def _rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'ranks 0-2, 5'``; ``[3]`` -> ``'rank 3'``."""
    parts, first = [], None
    for i, r in enumerate(ranks):
        if first is None:
            first = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == first else f"{first}-{r}")
            first = None
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


def nodes_line(nodes: Sequence[dict]) -> str:
    """``'2 (demo-n0: ranks 0-1, demo-n1: ranks 2-3)'``: the first ``NODES_SHOWN`` nodes."""
    shown = [f"{n['name']}: {_rank_ranges(n['ranks'])}" for n in nodes[:NODES_SHOWN]]
    if len(nodes) > NODES_SHOWN:
        shown.append(f"... ({len(nodes) - NODES_SHOWN} more)")
    return f"{len(nodes)} ({', '.join(shown)})"


def collect_info() -> dict:
    """What a user needs to know of the MPI and the devices this job sees (collective over
    ``COMM_WORLD``: every rank's node is gathered)."""
    import mpi4py  # MPI, numpy and the array backends: only info and run load them
    import numpy
    from mpi4py import MPI

    from ..arrays import backend, halfcast
    from ..arrays.cuda import is_cuda_aware
    from ..comm import tuning
    from ..comm.shm import ranks_on_node

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
    segment, source = _segment_default()
    strategy, strategy_why = _strategy_default()
    on_node = ranks_on_node(MPI.COMM_WORLD)

    return {
        # Open MPI ends its version string with a NUL byte
        "mpi_library": MPI.Get_library_version().replace("\0", "").strip().splitlines()[0],
        "mpi_standard": f"{version[0]}.{version[1]}",
        "thread_level": level_name,
        "world_size": MPI.COMM_WORLD.Get_size(),
        "processor": MPI.Get_processor_name(),
        "nodes": _node_map(MPI.COMM_WORLD),
        "segment_bytes": segment,
        "segment_source": source,
        "strategy": strategy,
        "strategy_source": strategy_why,
        "ranks_on_node": on_node,
        "cuda_aware_mpi": bool(is_cuda_aware()),
        "cupy": getattr(cupy, "__version__", None) if cupy is not None else None,
        "gpus": gpus,
        "numpy": numpy.__version__,
        "halfcast": f"bf16 {halfcast.kernel_path()}, fp16 {halfcast.path()}",  # kernels here
        "mpi4py": mpi4py.__version__,
        "mpifusion": __version__,
        "python": platform.python_version(),
        "slurm": view_json(slurm_view(os.environ)),  # None outside a Slurm job
        "tuning": {name: value for name, value, _ in tuning.current().rows()},
        "tuning_changed": tuning.current().changed(),
    }


def cmd_info(args: argparse.Namespace) -> int:
    """Exit 1 when srun started more tasks than MPI's world holds (PMI mismatch)."""
    info = collect_info()
    view = slurm_view(os.environ)
    problem = launch_problem(view, info["world_size"])
    if args.json:
        say(json.dumps({**info, "launch_problem": problem}, indent=1))
        return EXIT_FAIL if problem else EXIT_PASS
    labels = {"mpi_library": "MPI library", "mpi_standard": "MPI standard",
              "thread_level": "thread level", "world_size": "world size",
              "processor": "processor", "segment_bytes": "segment size",
              "cuda_aware_mpi": "CUDA-aware MPI",
              "cupy": "cupy", "gpus": "GPUs", "numpy": "numpy", "mpi4py": "mpi4py",
              "mpifusion": "mpifusion", "python": "python", "halfcast": "half kernels"}
    for key, label in labels.items():
        value = info[key]
        if key == "cupy" and value is None:
            value = "not installed"
        if key == "segment_bytes":
            value = (f"{value} bytes ({info['segment_source']})" if value is not None
                     else info["segment_source"])
        say(f"{label + ':':<16}{value}")
        if key == "segment_bytes":  # the strategy, and whether shm could run here
            say(f"{'strategy:':<16}{info['strategy']} ({info['strategy_source']})")
            whole = info["ranks_on_node"] == info["world_size"]
            say(f"{'shared memory:':<16}{info['ranks_on_node']} of {info['world_size']} "
                f"rank(s) on this node (" + ("shm can run" if whole else
                                             "shm falls back to thread") + ")")
        if key == "processor":  # every node MPI reports, then the Slurm view next to MPI's
            say(f"{'nodes:':<16}{nodes_line(info['nodes'])}")
            for slurm_label, slurm_value in summary_lines(view):
                say(f"{slurm_label + ':':<16}{slurm_value}")
    # the thresholds of comm/ (mpifusion.comm.tuning: each with the measurement behind it)
    changed = info["tuning_changed"]
    say(f"{'tuning:':<16}" + (f"changed: {changed}" if changed else "the defaults")
        + " (mpifusion.comm.tuning.Tuning)")
    for name, value in info["tuning"].items():
        say(f"  {name:<30}{value}")
    if problem:
        say(f"warning: {problem}")
        return EXIT_FAIL
    return EXIT_PASS


def cmd_tune(args: argparse.Namespace) -> int:
    return tune.run(args, say=say)


def cmd_bench(argv: Sequence[str]) -> int:
    """Bad arguments: one line from rank 0 and exit 2 on every rank (checked on every rank
    before anything is measured), as for the other subcommands."""
    from .bench import main as bench_main  # MPI and numpy: only this command loads them

    try:
        return int(bench_main(list(argv)) or 0)
    except SystemExit as exc:  # --help, usage errors (printed by rank 0)
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    except _input_errors() as exc:
        return error("bench", str(exc))


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
        return error(args.command, str(exc))
    except BrokenPipeError:  # e.g. `mpifusion layout | head`: not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PASS
