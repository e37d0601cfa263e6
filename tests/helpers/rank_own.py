"""The digits model with buffers each rank keeps for itself, registered persistent=False as float8's maxima
seen are (flodl/worker/float8.py): `seen`, a value of the rank's own last training batch, and `read`, what
`seen` held when the next training batch came (what a float8 cast would have scaled by)."""

from __future__ import annotations

import torch

from flodl.tasks.digits import DigitsMLP


class DigitsWithOwnBuffers(DigitsMLP):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__(hidden)
        self.register_buffer("seen", torch.zeros(()), persistent=False)
        self.register_buffer("read", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():  # not eval's passes, nor the FLOP count's
            self.read.copy_(self.seen)
            self.seen.copy_(x.detach().mean())
        return super().forward(x)
