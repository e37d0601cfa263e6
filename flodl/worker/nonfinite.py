"""Non-finite losses, caught without a host read per step.

Each step's loss is copied into a device buffer (one kernel per step); the worker reads the buffer's
finiteness once at each window boundary or chunk end, where it reads the device anyway, and only then
looks for the first bad step.
"""

from __future__ import annotations

import torch
from torch import Tensor

_INITIAL_SLOTS = 256


class NonFiniteError(RuntimeError):
    """A rank's loss or the consensus stopped being finite; the message names rank and step."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        # The first step whose loss was not finite, when known (which rank's NaN came first).
        self.step = step


class NonFiniteWatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses = torch.empty(_INITIAL_SLOTS, dtype=torch.float32, device=device)
        self.count = 0
        # The step of slot 0 (steps are consecutive between takes).
        self.first_step = 0

    def observe(self, loss: Tensor, step: int) -> None:
        """Keep the loss of `step` (the step after the last one observed) until the next `take`."""
        if self.count == 0:
            self.first_step = step
        if self.count == self.losses.numel():  # rare: double, keeping what is there
            grown = torch.empty(2 * self.count, dtype=torch.float32, device=self.device)
            grown[: self.count].copy_(self.losses)
            self.losses = grown
        self.losses[self.count].copy_(loss.detach())
        self.count += 1

    def take(self) -> int | None:
        """The first non-finite step since the last call (one host read), and start over."""
        kept, self.count = self.losses[: self.count], 0
        if kept.numel() == 0:
            return None
        bad = ~torch.isfinite(kept)
        if not bool(bad.any()):
            return None
        return self.first_step + int(bad.nonzero()[0, 0])


def nonfinite_message(rank: int, step: int, on_nonfinite: str) -> str:
    return (
        f"rank {rank}: the training loss became non-finite (NaN/Inf) at step {step}. The last good "
        f"checkpoint is kept. Check the learning rate, the data and the loss; with cadence/async, "
        f"on_nonfinite=skip drops such windows instead of stopping (now: on_nonfinite={on_nonfinite})."
    )
