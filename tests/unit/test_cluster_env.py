"""Ranks started by a scheduler (Slurm's srun, submitit) instead of torchrun."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from flodl.config.host import RankEnv
from flodl.config.schema import register_configs
from flodl.launcher.cluster_env import PORT_BASE, expand_nodelist, scheduler_rank_environ
from flodl.launcher.run_dir import register_resolvers
from tests.helpers.procs import CONF


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("head", ["head"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("gpu[08-10,12],login", ["gpu08", "gpu09", "gpu10", "gpu12", "login"]),
        ("a1,b[7],c[2-3]", ["a1", "b7", "c2", "c3"]),
    ],
)
def test_slurm_nodelists_expand_in_order(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


SLURM_TASK = {
    "SLURM_NTASKS": "16",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "8(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}


def test_a_slurm_task_becomes_a_rank_with_the_first_node_hosting_the_store() -> None:
    assert scheduler_rank_environ(SLURM_TASK) == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(PORT_BASE + 123456 % 20000),
    }


def test_torchrun_variables_and_a_users_port_win() -> None:
    assert scheduler_rank_environ({**SLURM_TASK, "RANK": "3", "WORLD_SIZE": "4"}) == {}
    assert scheduler_rank_environ({**SLURM_TASK, "MASTER_PORT": "29500"})["MASTER_PORT"] == "29500"


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ELASTIC_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def test_rank_env_reads_what_torchrun_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES + ELASTIC_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert RankEnv.from_environ() == RankEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    values = ("5", "8", "1", "4", "head", "29400", "True", "2", "job-7")
    for name, value in zip(TORCHRUN_VARIABLES + ELASTIC_VARIABLES, values, strict=True):
        monkeypatch.setenv(name, value)
    env = RankEnv.from_environ()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launched) == (
        5,
        8,
        1,
        4,
        True,
    )
    assert (env.master_addr, env.master_port, env.agent_store) == ("head", 29400, True)
    assert (env.restart_count, env.run_id, env.spans_hosts) == (2, "job-7", True)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # one host unless torchrun says otherwise
    assert RankEnv.from_environ().local_world_size == 8 and not RankEnv.from_environ().spans_hosts


def test_processes_that_are_not_one_task_of_many_stay_single() -> None:
    batch_script = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"}
    assert scheduler_rank_environ(batch_script) == {}
    assert scheduler_rank_environ({**SLURM_TASK, "SLURM_NTASKS": "1"}) == {}
    assert scheduler_rank_environ({}) == {}


def test_the_slurm_launcher_config_runs_one_task_per_gpu() -> None:
    # Importing the plugin's config module registers `hydra/launcher=submitit_slurm` (the CLI discovers it).
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher.config")
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=flodl_slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8
    assert cfg.launch.nproc_per_node == 1  # each task is one rank
