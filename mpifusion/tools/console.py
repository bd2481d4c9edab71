"""What every ``mpifusion`` command prints, once per job: exit codes, the rank, one-line errors.

Every rank of an ``mpiexec`` job runs the same command; only rank 0 prints. The rank comes
from MPI when a command has initialised it, else from the launcher's variables, so commands
that need no MPI (layout, check) still print once per job without initialising it.
"""
from __future__ import annotations

import os
import sys

EXIT_PASS, EXIT_FAIL, EXIT_INPUT = 0, 1, 2

#: Rank variables launchers set (MPICH/hydra, Open MPI, PMIx, Slurm)
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def rank() -> int:
    """This process's rank in the job: MPI's when it is running, else the launcher's."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None and mod.Is_initialized() and not mod.Is_finalized():
        return mod.COMM_WORLD.Get_rank()
    for key in RANK_ENV:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def say(line: str = "") -> None:
    """Print ``line`` on rank 0."""
    if rank() == 0:
        print(line, flush=True)


def error(command: str, message: str) -> int:
    """Rank 0 prints ``mpifusion COMMAND: error: MESSAGE`` on stderr; every rank gets the
    input-error exit code."""
    if rank() == 0:
        print(f"mpifusion {command}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_INPUT
