"""Outer optimizers: a step on the global parameters after each consensus (SlowMo, DiLoCo).

The pseudo-gradient is `g = prev_global - consensus` (the weighted mean of what the ranks moved away from
the last global). Every rank runs the same deterministic step on the same inputs, so the outer state
stays replicated without any extra collective.

- slowmo: `v = mu v + g; new = prev - lr v`                 (heavy-ball momentum)
- diloco: `v = mu v + g; new = prev - lr (mu v + g)`        (Nesterov; by default resets the inner optimizer)
Both are torch's SGD on the pseudo-gradient (momentum `mu`, dampening 0, nesterov for DiLoCo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

DEFAULTS = {"slowmo": (1.0, 0.9), "diloco": (0.7, 0.9)}


@dataclass(frozen=True)
class OuterSettings:
    kind: str
    lr: float
    momentum: float
    # The inner optimizer's state is cleared after each adopted round (flodl's original does for DiLoCo).
    resets_inner: bool = False

    @classmethod
    def resolve(
        cls, kind: str, lr: float | None, momentum: float | None, reset_inner: bool | None = None
    ) -> OuterSettings | None:
        """None for `avg` (adopt the consensus as is); else the settings with defaults filled in."""
        if kind == "avg":
            return None
        default_lr, default_momentum = DEFAULTS[kind]
        return cls(
            kind,
            default_lr if lr is None else lr,
            default_momentum if momentum is None else momentum,
            kind == "diloco" if reset_inner is None else reset_inner,
        )


class OuterOptimizer:
    def __init__(self, settings: OuterSettings, initial: list[Tensor]) -> None:
        self.settings = settings
        # The global parameters: the starting point of every rank's window.
        self.global_params = [t.detach().clone() for t in initial]
        self.optimizer = torch.optim.SGD(
            self.global_params,
            lr=settings.lr,
            momentum=settings.momentum,
            nesterov=settings.kind == "diloco",
        )
        self._momentum_from_zero()

    def _momentum_from_zero(self) -> None:
        """Every momentum buffer exists from the start, zero: torch's first step would start it at the
        pseudo-gradient, which `mu 0 + g` is too, and a cut round can go back to a state of the same shape."""
        if self.settings.momentum == 0:  # torch's SGD keeps no buffer then
            return
        for param in self.global_params:
            self.optimizer.state[param].setdefault("momentum_buffer", torch.zeros_like(param))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        self._momentum_from_zero()  # a checkpoint of a run that had not stepped yet holds none

    def state_tensors(self) -> list[Tensor]:
        """What every rank holds alike: the global parameters and their momentum."""
        momentum = [self.optimizer.state[param].get("momentum_buffer") for param in self.global_params]
        return [*self.global_params, *(buffer for buffer in momentum if buffer is not None)]

    @torch.no_grad()
    def step(self, consensus: list[Tensor]) -> None:
        """Step the global parameters on `prev - consensus`; write the new global into `consensus`."""
        for prev, cons in zip(self.global_params, consensus, strict=True):
            prev.grad = prev - cons
        self.optimizer.step()
        for prev, cons in zip(self.global_params, consensus, strict=True):
            cons.copy_(prev)
            prev.grad = None
