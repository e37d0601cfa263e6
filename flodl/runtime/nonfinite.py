"""Non-finite losses, caught without a host read per step.

The first step whose loss is NaN or Inf is recorded on the device (three scalar kernels per step); the
worker reads it once at each window boundary or chunk end, where it reads the device anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor


class NonFiniteError(RuntimeError):
    """A rank's loss or the consensus stopped being finite; the message names rank and step."""


# "No bad step yet": larger than any step a run reaches.
_NONE = torch.iinfo(torch.long).max


class NonFiniteWatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.first_bad = torch.full((), _NONE, dtype=torch.long, device=device)

    def observe(self, loss: Tensor, step: int) -> None:
        """Remember `step` if it is the first non-finite loss since the last `take`. Steps only grow, so
        the first bad one is the smallest: three kernels, no branch and no host read."""
        bad_here = torch.where(torch.isfinite(loss), _NONE, step)
        torch.minimum(self.first_bad, bad_here, out=self.first_bad)

    def take(self) -> int | None:
        """The first non-finite step since the last call (one host read), and start over."""
        step = int(self.first_bad)
        self.first_bad.fill_(_NONE)
        return step if step != _NONE else None


def nonfinite_message(rank: int, step: int, on_nonfinite: str) -> str:
    return (
        f"rank {rank}: the training loss became non-finite (NaN/Inf) at step {step}. The last good "
        f"checkpoint is kept. Check the learning rate, the data and the loss; with cadence/async, "
        f"on_nonfinite=skip drops such windows instead of stopping (now: on_nonfinite={on_nonfinite})."
    )
