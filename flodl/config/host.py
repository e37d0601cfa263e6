"""What this host and its launcher say: the one reader of the torchrun environment, and the host probe.

Every place that needs RANK, LOCAL_RANK, WORLD_SIZE or LOCAL_WORLD_SIZE asks `RankEnv.from_environ()`.
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
    launched: bool

    @classmethod
    def from_environ(cls) -> RankEnv:
        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))),
            launched=launched,
        )


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

    @classmethod
    def probe(cls, cfg: FlodlConfig) -> HostFacts:
        import torch

        env = RankEnv.from_environ()
        under_torchrun = env.launched
        ranks = env.local_world_size if under_torchrun else cfg.launch.nproc_per_node
        world = env.world_size if under_torchrun else cfg.launch.nproc_per_node
        stage_dir = stage_dir_of(cfg)
        free = shutil.disk_usage(stage_dir).free if os.path.isdir(stage_dir) else None
        return cls(torch.cuda.device_count(), ranks, world, under_torchrun, free)


def stage_dir_of(cfg: FlodlConfig) -> str:
    return cfg.disk_stage_dir or tempfile.gettempdir()
