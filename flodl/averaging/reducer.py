"""One weighted consensus over a process group, on whatever tensors it is handed (device or host).

1. A float64 SUM all-reduce of `[n^gamma, mover, n, kept]` gives every rank the same totals, so a round where
   nobody moved is skipped everywhere (an exact one averages the ranks that kept their window instead) and
   `Σ n` advances every rank's step clock. Reading them is the
   round's one host read before the big collective; the first chunk's stage work is queued ahead of it,
   so the device is busy while the host waits.
2. Each rank scales by its weight `n^gamma / Σ n^gamma`; one SUM all-reduce leaves the consensus (NCCL
   scales while it reduces: PreMulSum with a host scalar; a factor divided out on the device and read by
   NCCL from device memory measured no faster on 2x H200). With `stages`, each tensor is reduced in chunks and
   the caller's per-chunk work (the guard's pre-reduce copy and norms) runs while the chunk itself (the
   kept copy's norm) or the next chunk (the rest) is on the wire, instead of before and after the whole
   reduce.
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

# Chunks of a pipelined reduce: enough to hide the per-chunk work behind the wire, few and large enough
# that NCCL keeps its bus bandwidth and the host its launch budget (a 10M-parameter model is one piece).
PIPELINE_CHUNKS = 4
MIN_CHUNK_BYTES = 64 << 20


class ChunkStages(Protocol):
    """Work done on each chunk `tensor[span]` of the i-th reduced tensor: `before` its reduce is launched
    (what must read the chunk first), `during` it (work on what `before` kept, which the device can overlap
    with the transfer) and `after` it (on the result)."""

    def before(self, index: int, span: slice) -> None: ...

    def during(self, index: int, span: slice) -> None: ...

    def after(self, index: int, span: slice) -> None: ...


@dataclass(frozen=True)
class ReduceResult:
    skipped: bool
    # Σ over ranks of the steps since the last reduce.
    total_steps: int
    # What this rank put on the wire for the parameters and buffers (after compression).
    payload_bytes: int


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

    def reduce(
        self,
        params: list[Tensor],
        refs: list[Tensor] | None,
        buffers: Tensor | None,
        steps: int,
        stages: ChunkStages | None = None,
        *,
        exact: bool = False,
        kept: bool = True,
    ) -> ReduceResult:
        """Replace `params` (and `buffers`) in place by the cohort's weighted consensus.

        `exact`: the round must leave every rank with the same state, so if nobody moved it averages the
        ranks that `kept` their window (see `weights.py`) instead of being skipped.

        `refs` (same shapes as `params`, identical on every rank) is needed with bf16_wire. `params` must
        be 1-D when `stages` is given (the flat parameter buffers). On a skipped round the stages may
        have run `before` on the first chunk (nothing else).
        """
        totals = self._contribution(steps, kept, params[0].device)
        dist.all_reduce(totals, group=self.group)
        plans = [self._spans(t) for t in params] if stages is not None else []
        if stages is not None:
            stages.before(0, plans[0][0])
        total_mass, total_movers, total_steps, total_kept = totals.tolist()  # once per reduce
        scale = prescale_factors(
            steps, self.gamma, total_mass, total_movers, exact=exact, kept=kept, total_kept=total_kept
        )
        if scale.skip:
            return ReduceResult(True, 0, 0)
        sent = 0
        for i, tensor in enumerate(params):
            if stages is None:
                sent += self._reduce_whole(tensor, refs[i] if refs else None, scale.param_factor)
            else:
                sent += self._reduce_staged(
                    i, tensor, refs[i] if refs else None, scale.param_factor, plans[i], stages
                )
        if buffers is not None:
            sent += self._weighted_sum(buffers, scale.buffer_factor)
        return ReduceResult(False, round(total_steps), sent)

    def _contribution(self, steps: int, kept: bool, device: torch.device) -> Tensor:
        """`[n^gamma, mover, n, kept]` on the device, queued behind the training steps: a copy from pageable
        memory would make the host wait for them (a stream sync) before the round even began."""
        mass, mover = rank_contribution(steps, self.gamma)
        own = torch.tensor([mass, mover, steps, kept], dtype=torch.float64)
        if device.type != "cuda":
            return own
        return own.pin_memory().to(device, non_blocking=True)

    def _spans(self, tensor: Tensor) -> list[slice]:
        if self._travels_bf16(tensor):  # gathered whole: no chunked path
            return [slice(0, tensor.numel())]
        return chunk_spans(tensor.numel(), tensor.element_size(), self.chunks, self.min_chunk_bytes)

    def _travels_bf16(self, tensor: Tensor) -> bool:
        return self.bf16_wire and tensor.dtype == torch.float32

    def _reduce_whole(self, tensor: Tensor, ref: Tensor | None, factor: float) -> int:
        if self._travels_bf16(tensor):
            assert ref is not None, "bf16_wire needs the shared reference parameters"
            return self._reduce_bf16_delta(tensor, ref, factor)
        return self._weighted_sum(tensor, factor)

    def _reduce_staged(
        self,
        index: int,
        tensor: Tensor,
        ref: Tensor | None,
        factor: float,
        spans: list[slice],
        stages: ChunkStages,
    ) -> int:
        """Chunk k+1 is prepared and put on the wire before chunk k's result is waited for and settled,
        so the stages' work overlaps the transfer of the next chunk."""
        if self._travels_bf16(tensor):
            self._prepare(stages, index, 0, spans[0])
            stages.during(index, spans[0])
            sent = self._reduce_whole(tensor, ref, factor)
            stages.after(index, spans[0])
            return sent
        in_flight: deque[tuple[slice, dist.Work]] = deque()
        for k, span in enumerate(spans):
            self._prepare(stages, index, k, span)
            chunk = tensor[span]
            in_flight.append((span, self._all_reduce(chunk, factor, async_op=True)))
            stages.during(index, span)
            if len(in_flight) == 2:
                self._settle(index, stages, *in_flight.popleft())
        while in_flight:
            self._settle(index, stages, *in_flight.popleft())
        return tensor.numel() * tensor.element_size()

    @staticmethod
    def _prepare(stages: ChunkStages, index: int, k: int, span: slice) -> None:
        if index > 0 or k > 0:  # the first tensor's first chunk was prepared while the host read the totals
            stages.before(index, span)

    @staticmethod
    def _settle(index: int, stages: ChunkStages, span: slice, work: dist.Work) -> None:
        work.wait()  # on a GPU: the current stream waits for the chunk; the host does not
        stages.after(index, span)

    def _all_reduce(self, tensor: Tensor, factor: float, async_op: bool = False) -> dist.Work | None:
        if self.premul:
            op = dist._make_nccl_premul_sum(factor)
        else:
            tensor.mul_(factor)
            op = dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def _weighted_sum(self, tensor: Tensor, factor: float) -> int:
        self._all_reduce(tensor, factor)
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
