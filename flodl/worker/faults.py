"""Faults on purpose (`simulate.nan_at_step`, `hang_at_step`, `kill_at_step`): for tests, and for users
checking that their set-up reports a bad loss, a frozen rank or a dead one the way they expect (under
fault_tolerance=survive: that the others go on)."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class FaultInjection:
    """The faults of one rank (the assembly keeps `simulate`'s only where they name this rank)."""

    nan_at_step: int | None = None
    hang_at_step: int | None = None
    kill_at_step: int | None = None
    # Where the kill lands: "window" (at that step), "round" (as the first round after it begins) or "start"
    # (as the ranks form their first averaging group; kill_at_step only arms it).
    kill_in: str = "window"

    def applied(self, loss: Tensor, step: int) -> Tensor:
        """The loss of 1-based `step`, made NaN (so its gradients and parameters go bad too) or with the
        whole process frozen or killed first, when this is the step to break."""
        if step == self.hang_at_step:
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, heartbeats included
        if step == self.kill_at_step and self.kill_in == "window":
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.nan_at_step:
            return loss * float("nan")
        return loss

    def before_start(self) -> None:
        """The rank is about to form the first averaging group with its peers."""
        if self.kill_in == "start" and self.kill_at_step is not None:
            os.kill(os.getpid(), signal.SIGKILL)

    def before_round(self, steps_taken: int) -> None:
        """The rank is about to enter a round's collective, having taken `steps_taken` steps: its peers are
        in it already, waiting for it."""
        if self.kill_in == "round" and self.kill_at_step is not None and steps_taken >= self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
