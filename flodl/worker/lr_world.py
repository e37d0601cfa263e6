"""The world a sync rank's learning rate is scaled for, and scaling it when that world changes (a survive
cut or admission, a resume on another number of ranks).

The learning rate is `lr x (1 + (n - 1) x lr_scale_ratio)` for a global batch of n ranks' steps (as the task
was built). n counts steps of the world the run is laid out for (flodl/config/layout.py, handed down by the
assembly): a rank's own step, unless keep_global_batch resumed the run on another world, where each rank's
step holds several of that world's and the learning rate stays the one its global batch had.
"""

from __future__ import annotations

import logging
from typing import Any

from flodl.config.layout import Layout
from flodl.worker.stepper import Stepper
from flodl.worker.task_setup import lr_scale_factor

log = logging.getLogger("flodl")


class LrWorld:
    def __init__(self, stepper: Stepper, world_size: int, ratio: float, layout: Layout) -> None:
        self.stepper = stepper
        self.ratio = ratio
        self.layout = layout
        # The world the learning rate is scaled for now, in ranks of the layout's step.
        self.world = world_size

    def state(self) -> dict[str, Any]:
        return {"lr_world": self.world}

    def restore(self, state: dict[str, Any], world_size: int) -> None:
        """As a checkpoint left it (its learning rate scaled for its world), scaled for this one. (A part of
        an older flodl holds its `layout_step` too: the run's layout says it now.)"""
        self.world = int(state.get("lr_world", world_size))

    def batch_world(self, size: int) -> int:
        """The global batch of `size` ranks, in ranks of the world the run was laid out for."""
        return self.layout.world_of(size, self.stepper.step_samples)

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
                world * self.layout.step,
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
