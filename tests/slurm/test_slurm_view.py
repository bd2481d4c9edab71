"""The Slurm view of a task (mpifusion.tools.slurm), from environments srun really set."""
from __future__ import annotations

from mpifusion.tools.slurm import launch_problem, slurm_view, summary_lines, view_json

#: what srun --mpi=pmi2 -n 2 gave task 1 on the test cluster (scripts/slurm_cluster.sh)
SRUN_PMI2 = {"SLURM_JOB_ID": "30", "SLURM_JOBID": "30", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_NTASKS": "2",
             "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_PROCID": "1", "SLURM_MPI_TYPE": "pmi2",
             "PMI_FD": "11", "PMI_JOBID": "30.0", "PMI_RANK": "1", "PMI_SIZE": "2",
             "HOME": "/root"}


def test_outside_slurm_there_is_no_view():
    assert slurm_view({"HOME": "/root", "PMI_RANK": "0"}) is None
    assert summary_lines(None) == [] and view_json(None) is None
    assert launch_problem(None, 1) is None


def test_srun_step_with_pmi2():
    view = slurm_view(SRUN_PMI2)
    assert (view.job_id, view.step_id, view.job_nodes, view.node_list) == ("30", "0", 1, "vm")
    assert (view.tasks, view.step_tasks_per_node, view.proc_id) == (2, "2", 1)
    assert view.pmi == "pmi2"
    assert view.pmi_vars == ("PMI_FD", "PMI_JOBID", "PMI_RANK", "PMI_SIZE")
    assert dict(summary_lines(view)) == {
        "Slurm job": "30 step 0", "Slurm nodes": "1 (vm)",
        "Slurm tasks": "2 in this step, per node 2",
        "Slurm PMI": "pmi2 (PMI_FD, PMI_JOBID, PMI_RANK, PMI_SIZE set)"}
    assert view_json(view)["tasks_per_node"] == "2"
    assert launch_problem(view, 2) is None


def test_every_task_a_world_of_its_own_is_a_launch_problem():
    env = {k: v for k, v in SRUN_PMI2.items() if not k.startswith("PMI_")}
    env["SLURM_MPI_TYPE"] = "none"
    problem = launch_problem(slurm_view(env), 1)
    assert problem.startswith("srun started 2 tasks but MPI's world size is 1")
    assert "PMI plugin (none)" in problem and "srun --mpi=list" in problem
    assert "world size is 3" in launch_problem(slurm_view(env), 3)


def test_batch_script_multi_node_and_pmix_guess():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "n[1-3]",
           "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "3(x2),1",
           "PMIX_NAMESPACE": "slurm.pmix.7.0", "PMIX_RANK": "0"}
    view = slurm_view(env)
    assert view.step_id is None and view.tasks == 7 and view.pmi == "pmix"
    rows = dict(summary_lines(view))
    assert rows["Slurm job"] == "7 (batch script, no step)"
    assert rows["Slurm tasks"] == "7 in the job, per node 3(x2),1"
    assert launch_problem(view, 1) is None  # no step: nothing to compare with
    assert slurm_view({"SLURM_JOB_ID": "8", "SLURM_NTASKS": "x"}).job_tasks is None
