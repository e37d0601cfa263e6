"""The step's options: precision (autocast, fp16's GradScaler), grad_accum and compile, under every policy."""

from __future__ import annotations

import torch
from torch import nn

from flodl.metrics.scalars import drain_scalars
from flodl.tasks.classification import cross_entropy_loss
from flodl.worker.rank_state import restore_stepper, stepper_state
from flodl.worker.stepper import SCALER_SKIPPED
from tests.helpers.digits_stepper import digits_stepper, train_steps


def loud_cross_entropy(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy x 1000: its gradients overflow fp16 at GradScaler's initial scale (65536)."""
    return cross_entropy_loss(model, batch) * 1000.0


def test_the_gradscaler_scale_and_growth_tracker_are_part_of_a_ranks_state() -> None:
    # fp16 is refused on CPU before any rank starts (CUDA is where it pays); the scaler itself runs here.
    loud = ("precision=fp16", f"task.loss._target_={__name__}.loud_cross_entropy")
    stepper = digits_stepper(*loud)
    drain_scalars()
    train_steps(stepper, 16)
    saved = stepper_state(stepper)["scaler"]
    # It halved its scale at each skipped step, then stepped on; the skips were counted on the device.
    skipped, steps = drain_scalars()[SCALER_SKIPPED]
    assert steps == 16 and 0 < skipped < 16
    assert saved["scale"] == 65536.0 / 2**skipped and 0 < saved["_growth_tracker"] <= 16 - skipped
    fresh = digits_stepper(*loud)
    restore_stepper(fresh, stepper_state(stepper))
    assert fresh.scaler.state_dict() == saved
    # fp32 keeps no scaler state, and a checkpoint without one restores.
    plain = digits_stepper()
    assert stepper_state(plain)["scaler"] == {}
    restore_stepper(plain, stepper_state(plain))
