"""Fault injection for the Slurm tests, loaded by Python at start-up when this folder is on
PYTHONPATH: it lets the unchanged ``scripts/mpifusion.sbatch`` run a job in which one rank
misbehaves. ``MPIFUSION_TEST_FAULT=KIND:RANK[:CALL]`` (unset: nothing happens) wraps
``FusedCommBuffer.add_grad`` once ``mpifusion`` is imported; on Slurm task RANK
(``SLURM_PROCID``):

- ``exit``: at add_grad call CALL (default 3, i.e. mid-step) the process exits with code 3;
- ``stall``: at call CALL it stops itself (SIGSTOP): alive to Slurm, silent to MPI;
- ``kill``: at call CALL it kills itself (SIGKILL), like the OOM killer or ``kill -9``;
- ``corrupt``: every grad it adds is off by 1.0, so the run's verdict is FAIL.

Nothing is imported eagerly (the batch script probes mpi4py without starting MPI).
``MPIFUSION_TEST_RECORD=DIR`` also has every task of a step write where it ran (``_record``).
"""
import os
import sys

_FAULT = os.environ.get("MPIFUSION_TEST_FAULT", "")


def _install(kind: str, rank: int, call: int) -> None:
    import importlib.abc
    import importlib.machinery

    def patch(module) -> None:
        import signal

        import numpy as np

        cls = module.FusedCommBuffer
        original = cls.add_grad
        calls = [0]

        def add_grad(self, param, *args, **kwargs):
            calls[0] += 1
            if kind == "corrupt" and kwargs.get("grad") is not None:
                kwargs["grad"] = np.asarray(kwargs["grad"]) + 1.0
            elif calls[0] == call:
                print(f"[fault hook] rank {rank}: {kind} at add_grad call {call} "
                      f"(param {param.name})", file=sys.stderr, flush=True)
                if kind == "exit":
                    os._exit(3)
                if kind == "stall":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(self, param, *args, **kwargs)

        cls.add_grad = add_grad

    class Finder(importlib.abc.MetaPathFinder):
        """Patches the ``mpifusion`` package right after it is first executed."""

        def find_spec(self, name, path=None, target=None):
            if name != "mpifusion":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if _FAULT and os.environ.get("SLURM_STEP_ID") is not None:
    _kind, _rank, *_rest = _FAULT.split(":")
    if _kind not in ("exit", "stall", "corrupt", "kill"):
        raise ValueError(f"MPIFUSION_TEST_FAULT: unknown kind {_kind!r}")
    if os.environ.get("SLURM_PROCID") == _rank:
        _install(_kind, int(_rank), int(_rest[0]) if _rest else 3)


def _record(folder: str) -> None:
    """Where this task runs, as the multi-node tests check it (``MPIFUSION_TEST_RECORD=DIR``,
    one ``step<STEP>-task<TASK>.json`` per task of a step): its host name, the Slurm node that
    started it, its network namespace, and the rank Slurm's PMI hands to MPI."""
    import json
    import socket

    step, task = os.environ.get("SLURM_STEP_ID", "?"), os.environ.get("SLURM_PROCID", "?")
    record = {"step": step, "task": task, "hostname": socket.gethostname(),
              "slurmd_node": os.environ.get("SLURMD_NODENAME", ""),
              "netns": os.readlink("/proc/self/ns/net"),
              "pmi_rank": os.environ.get("PMI_RANK", os.environ.get("PMIX_RANK", "")),
              "ucx_tls": os.environ.get("UCX_TLS")}
    path = os.path.join(folder, f"step{step}-task{task}.json")
    with open(path + f".{os.getpid()}.tmp", "w") as out:
        json.dump(record, out)
    os.replace(path + f".{os.getpid()}.tmp", path)


if os.environ.get("MPIFUSION_TEST_RECORD") and os.environ.get("SLURM_STEP_ID") is not None:
    _record(os.environ["MPIFUSION_TEST_RECORD"])
