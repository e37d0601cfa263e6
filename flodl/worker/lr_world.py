"""The world a sync rank's learning rate is scaled for, and scaling it when that world changes (a survive
cut or admission, a resume on another number of ranks).

The learning rate is `lr x (1 + (n - 1) x lr_scale_ratio)` for a global batch of n ranks' steps (as the task
was built). n counts steps of `layout_step`, a rank's step in the world the run was laid out for: a rank's
own step, unless keep_global_batch resumed the run on another world (flodl/job/resize.py), where each rank's
step holds several of that world's and the learning rate stays the one its global batch had.
"""

from __future__ import annotations

import logging
from typing import Any

from flodl.worker.stepper import Stepper
from flodl.worker.task_setup import lr_scale_factor

log = logging.getLogger("flodl")


def layout_world(size: int, step_samples: int, layout_step: int) -> int:
    """The global batch of `size` ranks stepping `step_samples` each, in ranks of `layout_step`: the world the
    learning rate is scaled for."""
    return size * step_samples // layout_step


class LrWorld:
    def __init__(self, stepper: Stepper, world_size: int, ratio: float, keep_global_batch: bool) -> None:
        self.stepper = stepper
        self.ratio = ratio
        self.keep_global_batch = keep_global_batch
        # The world the learning rate is scaled for now, in ranks of `layout_step`.
        self.world = world_size
        self.layout_step = stepper.step_samples

    def state(self) -> dict[str, Any]:
        return {"lr_world": self.world, "layout_step": self.layout_step}

    def restore(self, state: dict[str, Any], world_size: int) -> None:
        """As a checkpoint left it (its learning rate scaled for its world), scaled for this one."""
        self.world = int(state.get("lr_world", world_size))
        if self.keep_global_batch:
            self.layout_step = int(state.get("layout_step", self.layout_step))

    def batch_world(self, size: int) -> int:
        """The global batch of `size` ranks, in ranks of the world the run was laid out for."""
        return layout_world(size, self.stepper.step_samples, self.layout_step)

    def scale_to(self, size: int, say: bool) -> None:
        """Scale the learning rate from the world it is scaled for to `size` ranks' global batch (`say`: log
        it)."""
        world = self.batch_world(size)
        factor = lr_scale_factor(world, self.ratio) / lr_scale_factor(self.world, self.ratio)
        if world != self.world and say:
            log.info(
                "world %d -> %d: global batch %d, learning rate x%.4g (lr_scale_ratio=%g)",
                self.world,
                world,
                world * self.layout_step,
                factor,
                self.ratio,
            )
        self.world = world
        if factor == 1.0:
            return
        parts = self.stepper.parts
        for param_group in parts.optimizer.param_groups:
            param_group["lr"] *= factor
            if "initial_lr" in param_group:  # what a scheduler that recomputes from the base starts from
                param_group["initial_lr"] *= factor
        base_lrs = getattr(parts.scheduler, "base_lrs", None)
        if base_lrs is not None:
            parts.scheduler.base_lrs = [lr * factor for lr in base_lrs]
