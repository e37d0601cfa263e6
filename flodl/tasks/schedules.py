"""Learning-rate schedules for the built-in tasks, as partials a task's `scheduler` names (each is called
with the optimizer and stepped once per step of the run's LR clock: an optimizer step under sync, every
rank's steps summed under local SGD; see docs/policies.md)."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(
    optimizer: Optimizer, warmup_steps: int, total_steps: int, final_ratio: float = 0.1
) -> LambdaLR:
    """Linear warm-up from 0 to the optimizer's lr over `warmup_steps`, then a cosine decay to
    `final_ratio` of it at `total_steps`, held there after."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"warmup_cosine: need 0 <= warmup_steps ({warmup_steps}) < total_steps ({total_steps})"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * done))

    return LambdaLR(optimizer, factor)
