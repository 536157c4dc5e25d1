"""ds_strategy/scheduler_env.py: one reader of the schedulers' variables for init_distributed and the
launcher's bootstrap (issue 19). Each scheduler's variables, as its documentation names them."""

from __future__ import annotations

import pytest

from ds_strategy.scheduler_env import SchedulerEnvError, read_scheduler

SRUN = {  # srun's task 3 of a 5-task step over 3 nodes (2, 2, 1 tasks)
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_NODELIST": "gpu[07-09]",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "OMPI_COMM_WORLD_NODE_RANK": "1",
            },
            ("openmpi", 5, 8, 1, 4, 1, None),
        ),
        (
            {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0"},
            ("mvapich", 2, 4, 0, None, None, None),
        ),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            ("pmi", 1, 2, 1, 2, None, None),
        ),
        (SRUN, ("slurm", 3, 5, 1, 2, 1, "gpu07")),
    ],
)
def test_each_scheduler(env: dict[str, str], expected: tuple[object, ...]) -> None:
    found = read_scheduler(env)
    assert found is not None
    got = (found.scheme.name, found.rank, found.world_size, found.local_rank, found.local_size, found.node_rank)
    assert (*got, found.master_addr) == expected


def test_a_batch_script_is_not_a_rank_but_a_known_srun_task_is() -> None:
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert read_scheduler(batch) is None  # sbatch's own variables: one process
    task = read_scheduler({**batch, "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2(x2)"}, srun_task=True)
    assert task is not None and (task.world_size, task.local_size, task.master_addr) == (4, 2, "n1")


def test_master_address_and_port_precedence() -> None:
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2"}
    assert read_scheduler({**mpich, "AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"}).master_addr == "10.0.0.4"  # type: ignore[union-attr]
    az = read_scheduler({**mpich, "AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"})
    assert az is not None and az.master_port == 6105
    own = read_scheduler({**mpich, "MASTER_ADDR": "h0", "MASTER_PORT": "7", "AZ_BATCH_MASTER_NODE": "x:1"})
    assert own is not None and (own.master_addr, own.master_port) == ("h0", 7)
    assert read_scheduler({**mpich, "AZ_BATCHAI_MPI_MASTER_NODE": "m"}).master_addr == "m"  # type: ignore[union-attr]


def test_errors_name_the_variable() -> None:
    with pytest.raises(SchedulerEnvError, match="PMI_SIZE='two' is not an integer"):
        read_scheduler({"PMI_RANK": "0", "PMI_SIZE": "two"})
    with pytest.raises(SchedulerEnvError, match="MPICH / Intel MPI started this process but MPI_LOCALNRANKS"):
        read_scheduler({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, complete=True)
    with pytest.raises(SchedulerEnvError, match="SLURM_NODEID=3 but SLURM_STEP_TASKS_PER_NODE lists 3 nodes"):
        read_scheduler({**SRUN, "SLURM_NODEID": "3"})
    assert read_scheduler({}) is None
