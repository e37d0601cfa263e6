"""The local-SGD reduce over a process group: weighted consensus, divergence, EASGD blend.

One reduce: a tiny float64 SUM all-reduce of `[n^gamma, mover]`, then each rank pre-scales its flat
parameter buffers by `n^gamma / Σ n^gamma` (float32 buffers by `mover / Σ mover`) and one SUM
all-reduce per dtype leaves the consensus in place. A pre-reduce copy gives the divergence triple and
the EASGD blend `W = W_pre + alpha (avg - W_pre)`. Optimizer state is never touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flodl.averaging.divergence import DivergenceTriple, divergence_triple
from flodl.averaging.flat import flatten_float32_buffers, flatten_parameters
from flodl.averaging.weights import prescale_factors, rank_contribution


@dataclass(frozen=True)
class RoundOutcome:
    steps: int
    # Σ over ranks of the steps since the last reduce (the run's step clock advances by this).
    total_steps: int
    # No rank moved since the last reduce: nothing was averaged, everyone kept its state.
    skipped: bool
    triple: DivergenceTriple
    sync_ms: float


class ConsensusAverager:
    """Owns the model's flat parameter/buffer storage and averages it with the other ranks."""

    def __init__(self, model: nn.Module, gamma: float, device: torch.device) -> None:
        self.gamma = gamma
        self.device = device
        self.params = flatten_parameters(model)
        self.buffers = flatten_float32_buffers(model)
        # The pre-reduce copy: divergence and the EASGD blend both need the rank's own params.
        self.pre = [torch.empty_like(g.buffer) for g in self.params]

    @torch.no_grad()
    def reduce(self, steps: int) -> RoundOutcome:
        start = time.perf_counter()
        mass, mover = rank_contribution(steps, self.gamma)
        totals = torch.tensor([mass, mover, steps], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        total_mass, total_movers, total_steps = totals.tolist()  # once per reduce, never per step
        scale = prescale_factors(steps, self.gamma, total_mass, total_movers)
        if scale.skip:
            return RoundOutcome(steps, 0, True, DivergenceTriple(0.0, 0.0, 0.0), _ms_since(start))
        for group, pre in zip(self.params, self.pre, strict=True):
            pre.copy_(group.buffer)
            group.buffer.mul_(scale.param_factor)
            dist.all_reduce(group.buffer)
        if self.buffers is not None:
            self.buffers.buffer.mul_(scale.buffer_factor)
            dist.all_reduce(self.buffers.buffer)
        triple = divergence_triple(self.pre, [g.buffer for g in self.params])
        return RoundOutcome(steps, round(total_steps), False, triple, _ms_since(start))

    @torch.no_grad()
    def blend(self, alpha: float) -> None:
        """EASGD after a reduce: move only `alpha` of the way from this rank's params to the consensus."""
        for group, pre in zip(self.params, self.pre, strict=True):
            group.buffer.copy_(pre.lerp_(group.buffer, alpha))


def _ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000
