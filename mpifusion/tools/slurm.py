"""The Slurm view of a task -- job, step, nodes, tasks, PMI -- from its environment.

``mpifusion info`` prints it next to MPI's view, so a job log shows at once whether srun and
the MPI library agree (Slurm started N tasks; MPI sees a world of N, not N worlds of 1). Pure
functions of an environment mapping: testable without Slurm, and the caller decides which
environment (``os.environ`` under srun).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

#: PMI variables a launcher sets for the MPI library (Slurm's pmi2 plugin, PMIx, PMI-1):
#: which of them are present says which wire-up protocol the task was given.
PMI_VARS = ("PMI_FD", "PMI_JOBID", "PMI_RANK", "PMI_SIZE", "PMIX_NAMESPACE", "PMIX_RANK",
            "PMIX_SERVER_URI41", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3",
            "PMIX_SERVER_URI21", "PMIX_SERVER_URI2")


@dataclass(frozen=True)
class SlurmView:
    """One task's Slurm placement; ``step_*`` fields are ``None`` outside an srun step."""

    job_id: str
    job_nodes: Optional[int]
    node_list: str
    job_tasks: Optional[int]
    job_tasks_per_node: str       # Slurm's compact form, e.g. "4" or "2(x3),1"
    step_id: Optional[str]
    step_tasks: Optional[int]
    step_tasks_per_node: str
    proc_id: Optional[int]        # the task's rank in the step (SLURM_PROCID)
    mpi_type: str                 # srun --mpi= in effect (SLURM_MPI_TYPE), "" if unknown
    pmi_vars: Tuple[str, ...]     # which of PMI_VARS are set

    @property
    def tasks(self) -> Optional[int]:
        """Tasks of the step this process is in, else of the job."""
        return self.step_tasks if self.step_tasks is not None else self.job_tasks

    @property
    def pmi(self) -> str:
        """The PMI the task was given: srun's plugin, else guessed from the variables."""
        if self.mpi_type:
            return self.mpi_type
        if any(v.startswith("PMIX_") for v in self.pmi_vars):
            return "pmix"
        if "PMI_FD" in self.pmi_vars:
            return "pmi2 or pmi1"
        return "none"


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def slurm_view(env: Mapping[str, str]) -> Optional[SlurmView]:
    """The Slurm view of the task whose environment is ``env``; ``None`` outside a job."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    return SlurmView(
        job_id=job_id,
        job_nodes=_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")),
        node_list=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "",
        job_tasks=_int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")),
        job_tasks_per_node=env.get("SLURM_TASKS_PER_NODE", ""),
        step_id=step,
        step_tasks=_int(env.get("SLURM_STEP_NUM_TASKS")) if step is not None else None,
        step_tasks_per_node=env.get("SLURM_STEP_TASKS_PER_NODE", "") if step is not None
        else "",
        proc_id=_int(env.get("SLURM_PROCID")),
        mpi_type=env.get("SLURM_MPI_TYPE", ""),
        pmi_vars=tuple(v for v in PMI_VARS if v in env),
    )


def launch_problem(view: Optional[SlurmView], world_size: int) -> Optional[str]:
    """Why srun and MPI disagree on the job's size, or ``None`` when they agree (or when
    this is not an srun step, whose size MPI cannot be compared with)."""
    if view is None or view.step_id is None or view.step_tasks is None:
        return None
    if world_size == view.step_tasks:
        return None
    if world_size == 1:
        return (f"srun started {view.step_tasks} tasks but MPI's world size is 1: every task "
                f"is a world of its own, so srun's PMI plugin ({view.pmi}) does not match the "
                f"MPI library; try srun --mpi=pmi2 (MPICH) or --mpi=pmix (Open MPI), see "
                f"srun --mpi=list")
    return (f"srun started {view.step_tasks} tasks but MPI's world size is {world_size}: "
            f"the tasks were not all wired into one MPI job (PMI {view.pmi})")


def summary_lines(view: Optional[SlurmView]) -> list:
    """(label, value) rows for ``mpifusion info``; empty outside a Slurm job."""
    if view is None:
        return []
    rows = [("Slurm job", f"{view.job_id}" + (f" step {view.step_id}" if view.step_id
                                               is not None else " (batch script, no step)")),
            ("Slurm nodes", f"{view.job_nodes if view.job_nodes is not None else '?'}"
                            + (f" ({view.node_list})" if view.node_list else ""))]
    if view.step_id is not None:
        rows.append(("Slurm tasks", f"{view.step_tasks if view.step_tasks is not None else '?'}"
                     f" in this step, per node {view.step_tasks_per_node or '?'}"))
    else:
        rows.append(("Slurm tasks", f"{view.job_tasks if view.job_tasks is not None else '?'}"
                     f" in the job, per node {view.job_tasks_per_node or '?'}"))
    pmi = view.pmi
    if view.pmi_vars:
        pmi += f" ({', '.join(view.pmi_vars)} set)"
    rows.append(("Slurm PMI", pmi))
    return rows


def view_json(view: Optional[SlurmView]) -> Optional[dict]:
    """The view as JSON-ready fields (``None`` outside a Slurm job)."""
    if view is None:
        return None
    return {"job_id": view.job_id, "step_id": view.step_id, "nodes": view.job_nodes,
            "node_list": view.node_list, "tasks": view.tasks,
            "tasks_per_node": view.step_tasks_per_node or view.job_tasks_per_node,
            "proc_id": view.proc_id, "pmi": view.pmi, "pmi_vars": list(view.pmi_vars)}
