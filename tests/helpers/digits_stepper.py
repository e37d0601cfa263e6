"""A 1-process Stepper on the digits task, and a few steps of it, for the step and checkpoint tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from hydra import compose, initialize_config_dir

from flodl.config.host import RankEnv
from flodl.config.schema import register_configs, to_config
from flodl.job.settings import stepper_settings, task_settings
from flodl.launcher.run_dir import register_resolvers
from flodl.links.messages import EpochSlice
from flodl.sharding.fsdp import shard_model
from flodl.worker.stepper import Stepper
from flodl.worker.task_setup import build_task
from tests.helpers.procs import CONF

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def digits_stepper(*overrides: str, device: str = "cpu", shard_over: DeviceMesh | None = None) -> Stepper:
    """A 1-process Stepper on the digits task, composed as train.py composes it (the rules not applied);
    with `shard_over`, its model sharded over that mesh as a sharded group's is (collective)."""
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=[f"device={device}", *overrides]))
    where = torch.device(device)
    parts = build_task(task_settings(cfg), where, 1)
    if shard_over is not None:
        shard_model(parts.model, parts.optimizer, shard_over)
    return Stepper(stepper_settings(cfg, RankEnv(0, 1, 0, 1), where.type), parts, where, parts.model)


def train_steps(stepper: Stepper, steps: int) -> None:
    size = stepper.step_samples
    picks = stepper.picks(EpochSlice(0, 0, steps * size))
    for s in range(steps):
        stepper.step(stepper.load_step(picks[s * size : (s + 1) * size], 0))
