"""Non-finite losses, caught without a host read per step.

The first step whose loss is NaN or Inf is recorded on the device (a few scalar kernels per step); the
worker reads it once at each window boundary or chunk end, where it reads the device anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor


class NonFiniteError(RuntimeError):
    """A rank's loss or the consensus stopped being finite; the message names rank and step."""


class NonFiniteWatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def observe(self, loss: Tensor, step: int) -> None:
        """Remember `step` if it is the first non-finite loss since the last `take`."""
        fresh = ~torch.isfinite(loss) & (self.first_bad < 0)
        self.first_bad = torch.where(fresh, torch.full_like(self.first_bad, step), self.first_bad)

    def take(self) -> int | None:
        """The first non-finite step since the last call (one host read), and start over."""
        step = int(self.first_bad)
        self.first_bad.fill_(-1)
        return step if step >= 0 else None


def nonfinite_message(rank: int, step: int, on_nonfinite: str) -> str:
    return (
        f"rank {rank}: the training loss became non-finite (NaN/Inf) at step {step}. The last good "
        f"checkpoint is kept. Check the learning rate, the data and the loss; with cadence/async, "
        f"on_nonfinite=skip drops such windows instead of stopping (now: on_nonfinite={on_nonfinite})."
    )
