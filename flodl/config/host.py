"""What this host and its launcher say: the one reader of the torchrun environment, and the host probe.

Every place that needs torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_*) asks `RankEnv.from_environ()`; flodl/cluster_env.py writes them from Slurm's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flodl.config.schema import FlodlConfig


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    # Ranks on this host (torchrun's LOCAL_WORLD_SIZE; 1 for a plain run).
    local_world_size: int
    # Set by torchrun / the elastic launcher; absent for a plain single-process run.
    launched: bool = False
    # The rendezvous store (MASTER_ADDR / MASTER_PORT; None outside a launcher).
    master_addr: str | None = None
    master_port: int | None = None
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True, the default since torch 2.3).
    agent_store: bool = False
    # TORCHELASTIC_RESTART_COUNT: how often the elastic agent restarted this group.
    restart_count: int = 0
    # TORCHELASTIC_RUN_ID: the same across the restarts of one torchrun launch.
    run_id: str = ""

    @classmethod
    def from_environ(cls) -> RankEnv:
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            launched="RANK" in env and "WORLD_SIZE" in env,
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        )

    @property
    def spans_hosts(self) -> bool:
        """The job has ranks on more than this host (torchrun --nnodes > 1)."""
        return self.world_size > self.local_world_size


@dataclass(frozen=True)
class HostFacts:
    """What the rules need to know about the host this config will run on."""

    gpus: int
    # Ranks this host will run (torchrun's LOCAL_WORLD_SIZE, or launch.nproc_per_node).
    ranks_per_node: int
    # Ranks in the whole job (torchrun's WORLD_SIZE, or launch.nproc_per_node).
    world_size: int
    under_torchrun: bool
    # Free bytes in the disk stage dir; None when the dir does not exist.
    stage_dir_free_bytes: int | None
    # RAM available to this host's ranks (the cgroup limit honoured), as the data plane reads it.
    available_ram: int

    @classmethod
    def probe(cls, cfg: FlodlConfig) -> HostFacts:
        import torch

        from flodl.data.memory import available_ram

        env = RankEnv.from_environ()
        under_torchrun = env.launched
        ranks = env.local_world_size if under_torchrun else cfg.launch.nproc_per_node
        world = env.world_size if under_torchrun else cfg.launch.nproc_per_node
        stage_dir = stage_dir_of(cfg)
        free = shutil.disk_usage(stage_dir).free if os.path.isdir(stage_dir) else None
        return cls(torch.cuda.device_count(), ranks, world, under_torchrun, free, available_ram())


def stage_dir_of(cfg: FlodlConfig) -> str:
    return cfg.disk_stage_dir or tempfile.gettempdir()
