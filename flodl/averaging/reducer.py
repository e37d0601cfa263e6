"""One weighted consensus over a process group, on whatever tensors it is handed (device or host).

1. A float64 SUM all-reduce of `[n^gamma, mover, n]` gives every rank the same totals, so a round where
   nobody moved is skipped everywhere and `Σ n` advances every rank's step clock.
2. Each rank pre-scales by its weight `n^gamma / Σ n^gamma`; one SUM all-reduce leaves the consensus.
   With `bf16_wire`, float32 tensors travel as the bf16 difference from a reference every rank shares
   (the last global parameters), gathered and summed in float32: half the bytes, and the rounding falls on
   the small per-round change instead of on the parameters themselves.
3. Float32 buffers average with equal weight among ranks that moved; they always travel as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flodl.averaging.weights import prescale_factors, rank_contribution

# torch 2.13 renamed all_gather_into_tensor (older torch only has the old name).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class ReduceResult:
    skipped: bool
    # Σ over ranks of the steps since the last reduce.
    total_steps: int
    # What this rank put on the wire for the parameters and buffers (after compression).
    payload_bytes: int


class Reducer:
    def __init__(self, gamma: float, bf16_wire: bool, group: dist.ProcessGroup | None = None) -> None:
        self.gamma = gamma
        self.bf16_wire = bf16_wire
        self.group = group
        # NCCL scales while it reduces (PreMulSum): no separate pass over the parameters.
        self.premul = dist.get_backend(group) == "nccl" and hasattr(dist, "_make_nccl_premul_sum")

    def reduce(
        self, params: list[Tensor], refs: list[Tensor] | None, buffers: Tensor | None, steps: int
    ) -> ReduceResult:
        """Replace `params` (and `buffers`) in place by the cohort's weighted consensus.

        `refs` (same shapes as `params`, identical on every rank) is needed with bf16_wire.
        """
        mass, mover = rank_contribution(steps, self.gamma)
        totals = torch.tensor([mass, mover, steps], dtype=torch.float64, device=params[0].device)
        dist.all_reduce(totals, group=self.group)
        total_mass, total_movers, total_steps = totals.tolist()  # once per reduce, never per step
        scale = prescale_factors(steps, self.gamma, total_mass, total_movers)
        if scale.skip:
            return ReduceResult(True, 0, 0)
        sent = 0
        for i, tensor in enumerate(params):
            if self.bf16_wire and tensor.dtype == torch.float32:
                assert refs is not None, "bf16_wire needs the shared reference parameters"
                sent += self._reduce_bf16_delta(tensor, refs[i], scale.param_factor)
            else:
                sent += self._weighted_sum(tensor, scale.param_factor)
        if buffers is not None:
            sent += self._weighted_sum(buffers, scale.buffer_factor)
        return ReduceResult(False, round(total_steps), sent)

    def _weighted_sum(self, tensor: Tensor, factor: float) -> int:
        if self.premul:
            dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(factor), group=self.group)
        else:
            tensor.mul_(factor)
            dist.all_reduce(tensor, group=self.group)
        return tensor.numel() * tensor.element_size()

    def _reduce_bf16_delta(self, tensor: Tensor, ref: Tensor, factor: float) -> int:
        payload = ((tensor - ref) * factor).to(torch.bfloat16)
        world = dist.get_world_size(self.group)
        gathered = torch.empty(world * payload.numel(), dtype=torch.bfloat16, device=payload.device)
        _all_gather_flat(gathered, payload.reshape(-1), group=self.group)
        # Accumulate in float32: ref + Σ_k w_k (θ_k - ref) = Σ_k w_k θ_k, since the weights sum to 1.
        summed = gathered.view(world, -1).float().sum(dim=0).view_as(tensor)
        torch.add(ref, summed, out=tensor)
        return payload.numel() * payload.element_size()
