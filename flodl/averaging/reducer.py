"""One weighted consensus over a process group, on whatever tensors it is handed (device or host).

1. A float64 SUM all-reduce of `[n^gamma, mover, n]` gives every rank the same totals. Each rank's
   factors `n^gamma / Σ n^gamma` (params) and `mover / Σ mover` (float32 buffers) are divided out on the
   device, so a rank that moved never waits for the host between the two collectives. Only a rank with
   no mass reads the totals first: if nobody moved, every rank is such a rank, and all skip the round.
2. One SUM all-reduce of the pre-scaled tensors leaves the consensus (NCCL scales while it reduces:
   PreMulSum with the factor read from device memory). With `stages`, each tensor is reduced in chunks
   and the caller's per-chunk work (the guard's pre-reduce copy and norms) runs while the next chunk is
   on the wire, instead of before and after the whole reduce.
3. With `bf16_wire`, float32 tensors travel as the bf16 difference from a reference every rank shares
   (the last global parameters), gathered and summed in float32: half the bytes, and the rounding falls on
   the small per-round change instead of on the parameters themselves.
4. Float32 buffers average with equal weight among ranks that moved; they always travel as float32.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from flodl.averaging.weights import prescale_factors, rank_contribution

# torch 2.13 renamed all_gather_into_tensor (older torch only has the old name).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Chunks of a pipelined reduce: enough to hide the per-chunk work behind the wire, few enough that
# each chunk stays large (NCCL's bus bandwidth drops below tens of MB).
PIPELINE_CHUNKS = 4
MIN_CHUNK_BYTES = 16 << 20


class ChunkStages(Protocol):
    """Work done on each chunk `tensor[span]` of the i-th reduced tensor, before and after its reduce."""

    def before(self, index: int, span: slice) -> None: ...

    def after(self, index: int, span: slice) -> None: ...


@dataclass(frozen=True)
class ReduceResult:
    skipped: bool
    # `[Σ n^gamma, Σ mover, Σ n]` on the tensors' device; Σ n advances every rank's step clock. Read it
    # (`read_total_steps`) once the caller has nothing more to queue.
    totals: Tensor | None
    # What this rank put on the wire for the parameters and buffers (after compression).
    payload_bytes: int


def read_total_steps(result: ReduceResult) -> int:
    return 0 if result.totals is None else round(result.totals[2].item())


def chunk_spans(
    numel: int, element_size: int, chunks: int = PIPELINE_CHUNKS, min_bytes: int = MIN_CHUNK_BYTES
) -> list[slice]:
    """Split `numel` elements into at most `chunks` contiguous spans of at least `min_bytes` each."""
    count = max(1, min(chunks, numel * element_size // min_bytes))
    size = -(-numel // count)
    return [slice(start, min(start + size, numel)) for start in range(0, numel, size)]


class Reducer:
    def __init__(self, gamma: float, bf16_wire: bool, group: dist.ProcessGroup | None = None) -> None:
        self.gamma = gamma
        self.bf16_wire = bf16_wire
        self.group = group
        self.premul = dist.get_backend(group) == "nccl" and hasattr(dist, "_make_nccl_premul_sum")
        self.chunks = PIPELINE_CHUNKS
        self.min_chunk_bytes = MIN_CHUNK_BYTES
        # The factors NCCL reads from device memory, kept alive while the round's collectives may still run.
        self._factors: dict[tuple[int, torch.dtype], Tensor] = {}

    def reduce(
        self,
        params: list[Tensor],
        refs: list[Tensor] | None,
        buffers: Tensor | None,
        steps: int,
        stages: ChunkStages | None = None,
    ) -> ReduceResult:
        """Replace `params` (and `buffers`) in place by the cohort's weighted consensus.

        `refs` (same shapes as `params`, identical on every rank) is needed with bf16_wire. `params` must
        be 1-D when `stages` is given (the flat parameter buffers).
        """
        mass, mover = rank_contribution(steps, self.gamma)
        own = torch.tensor([mass, mover, steps], dtype=torch.float64, device=params[0].device)
        totals = own.clone()
        dist.all_reduce(totals, group=self.group)
        # A rank with mass knows the round happens; one without must learn whether anybody moved.
        if mass <= 0.0 and totals[0].item() <= 0.0:
            return ReduceResult(True, None, 0)
        factors = prescale_factors(own, totals)
        self._factors = {}
        sent = 0
        for i, tensor in enumerate(params):
            factor = self._factor(factors, 0, tensor.dtype)
            if self.bf16_wire and tensor.dtype == torch.float32:
                assert refs is not None, "bf16_wire needs the shared reference parameters"
                whole = slice(0, tensor.numel())
                if stages is not None:
                    stages.before(i, whole)
                sent += self._reduce_bf16_delta(tensor, refs[i], factor)
                if stages is not None:
                    stages.after(i, whole)
            elif stages is not None:
                sent += self._pipelined_sum(i, tensor, factor, stages)
            else:
                sent += self._weighted_sum(tensor, factor)
        if buffers is not None:
            sent += self._weighted_sum(buffers, self._factor(factors, 1, buffers.dtype))
        return ReduceResult(False, totals, sent)

    def _factor(self, factors: Tensor, which: int, dtype: torch.dtype) -> Tensor:
        """`factors[which]` as a 1-element tensor of `dtype` (NCCL reads the factor in the tensor's type)."""
        key = (which, dtype)
        if key not in self._factors:
            self._factors[key] = factors[which : which + 1].to(dtype)
        return self._factors[key]

    def _sum_op(self, tensor: Tensor, factor: Tensor) -> dist.ReduceOp:
        if self.premul:
            return dist._make_nccl_premul_sum(factor)
        tensor.mul_(factor)
        return dist.ReduceOp.SUM

    def _weighted_sum(self, tensor: Tensor, factor: Tensor) -> int:
        dist.all_reduce(tensor, op=self._sum_op(tensor, factor), group=self.group)
        return tensor.numel() * tensor.element_size()

    def _pipelined_sum(self, index: int, tensor: Tensor, factor: Tensor, stages: ChunkStages) -> int:
        """Chunk k+1 is prepared and put on the wire before chunk k's result is waited for and settled,
        so the stages' work overlaps the transfer of the next chunk."""
        in_flight: deque[tuple[slice, dist.Work]] = deque()
        for span in chunk_spans(tensor.numel(), tensor.element_size(), self.chunks, self.min_chunk_bytes):
            stages.before(index, span)
            chunk = tensor[span]
            work = dist.all_reduce(chunk, op=self._sum_op(chunk, factor), group=self.group, async_op=True)
            in_flight.append((span, work))
            if len(in_flight) == 2:
                self._settle(index, stages, *in_flight.popleft())
        while in_flight:
            self._settle(index, stages, *in_flight.popleft())
        return tensor.numel() * tensor.element_size()

    @staticmethod
    def _settle(index: int, stages: ChunkStages, span: slice, work: dist.Work) -> None:
        work.wait()  # on a GPU: the current stream waits for the chunk; the host does not
        stages.after(index, span)

    def _reduce_bf16_delta(self, tensor: Tensor, ref: Tensor, factor: Tensor) -> int:
        payload = ((tensor - ref) * factor).to(torch.bfloat16)
        world = dist.get_world_size(self.group)
        gathered = torch.empty(world * payload.numel(), dtype=torch.bfloat16, device=payload.device)
        _all_gather_flat(gathered, payload.reshape(-1), group=self.group)
        # Accumulate in float32: ref + Σ_k w_k (θ_k - ref) = Σ_k w_k θ_k, since the weights sum to 1.
        summed = gathered.view(world, -1).float().sum(dim=0).view_as(tensor)
        torch.add(ref, summed, out=tensor)
        return payload.numel() * payload.element_size()
