"""One weighted consensus over a process group, on whatever tensors it is handed (device or host).

The mechanism (the weights `n^gamma / Σ n^gamma`, their two ways: on the device, replayed as a CUDA graph
on a GPU, or read on the host first; skipped and exact rounds; the chunks and the delta wires) is described
once, in docs/architecture.md, "Local SGD reduce". Here `Reducer.weighs_on_device` picks the way for the
tensors at hand (the same answer on every rank), `Reducer.reduce` runs it, whole or in `chunk_spans` with
the caller's `ChunkStages` around each chunk's collective, and `ReduceResult` carries what the step clocks
advance by.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flodl.averaging.replayed import ReplayedRound, Settle
from flodl.averaging.stages import ChunkStages
from flodl.averaging.weights import prescale_factors, rank_contribution
from flodl.averaging.wire import FP32, Deltas, Wire

# torch 2.13 renamed all_gather_into_tensor (older torch only has the old name).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Chunks of a pipelined reduce: enough to hide the per-chunk work behind the wire, few and large enough
# that NCCL keeps its bus bandwidth and the host its launch budget (a 10M-parameter model is one piece).
PIPELINE_CHUNKS = 4
MIN_CHUNK_BYTES = 64 << 20
# Eager rounds before a round weighted on the device is captured as a CUDA graph (see `replayed.py`).
CAPTURE_AFTER = 2


@dataclass(frozen=True)
class ReduceResult:
    skipped: bool
    # What this rank put on the wire for the parameters and buffers (after compression).
    payload_bytes: int
    # Σ over ranks of the steps since the last reduce, or the round weighted on the device that holds it.
    steps: int | ReplayedRound

    @property
    def total_steps(self) -> int:
        """A round weighted on the device has its totals read when first asked for (the host can queue the
        rest of the round's work before it waits)."""
        if isinstance(self.steps, ReplayedRound):
            return round(self.steps.read_totals()[2])
        return self.steps


def chunk_spans(
    numel: int, element_size: int, chunks: int = PIPELINE_CHUNKS, min_bytes: int = MIN_CHUNK_BYTES
) -> list[slice]:
    """Split `numel` elements into at most `chunks` contiguous spans of at least `min_bytes` each."""
    count = max(1, min(chunks, numel * element_size // min_bytes))
    size = -(-numel // count)
    return [slice(start, min(start + size, numel)) for start in range(0, numel, size)]


class Reducer:
    def __init__(
        self,
        gamma: float,
        wire: Wire = FP32,
        group: dist.ProcessGroup | None = None,
        backend: str | None = None,
        settle: Settle = dist.Work.wait,
    ) -> None:
        """`wire`: what crosses the wire (see `wire.py`). `backend`: the group's, for a group built outside
        torch's registry (survive's averaging group).
        `settle`: how a collective is waited for (survive: given up once the group is cut)."""
        self.gamma = gamma
        self.wire = wire
        # A delta wire's encoder per float32 tensor reduced (a quantized one keeps its error feedback).
        self.deltas: dict[int, Deltas] = {}
        self.chunks = PIPELINE_CHUNKS
        self.min_chunk_bytes = MIN_CHUNK_BYTES
        # Off: every round reads its weights on the host (the benchmark compares the two).
        self.weights_on_device = True
        # Rounds before a round weighted on the device is replayed from a CUDA graph (None: always eager).
        self.capture_after: int | None = CAPTURE_AFTER
        self._own_totals: Tensor | None = None
        self._replayed: ReplayedRound | None = None
        self.group: dist.ProcessGroup | None = None
        self.premul = False
        self.settle = settle
        self.set_group(group, backend)

    def set_group(self, group: dist.ProcessGroup | None, backend: str | None = None) -> None:
        """Average over `group` from the next round on (a captured round belongs to the old one)."""
        self.release()
        self.group = group
        backend = backend or dist.get_backend(group)
        self.premul = backend == "nccl" and hasattr(dist, "_make_nccl_premul_sum")
        # Survive's group is a bare backend, which torch's all-gather function does not take: its own entry.
        self._gathers_bare = group is not None and not isinstance(group, dist.ProcessGroup)

    def weighs_on_device(self, params: Sequence[Tensor], exact: bool) -> bool:
        """Whether a round on these tensors gets its weights on the device (the same answer on every rank:
        it depends only on the model, the config and the coordinator's order). Only a round reduced in one
        piece does: in chunks the host read before the payload is a small share of the round."""
        return (
            self.weights_on_device
            and not exact
            and not self.wire.needs_reference
            and len(params) == 1
            and params[0].dtype == torch.float32
            and len(self._spans(params[0])) == 1
        )

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
        `refs` (same shapes as `params`, identical on every rank) is needed with a delta wire. `params` must
        be 1-D when `stages` is given (the flat parameter buffers). On a skipped round the stages may have
        run on garbage; their results mean nothing.
        """
        if self.weighs_on_device(params, exact):
            return self._reduce_on_device(params[0], buffers, steps, stages)
        device = params[0].device
        own = self._pinned_totals([*rank_contribution(steps, self.gamma), steps, kept], device)
        totals = own.to(device, non_blocking=True)
        self.settle(self._async(dist.all_reduce(totals, group=self.group, async_op=True)))
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
            ref = refs[i] if refs else None
            if self._travels_as_delta(tensor):
                sent += self._reduce_delta(i, tensor, ref, scale.param_factor, stages)
                continue
            if stages is None:
                self._weighted_sum(tensor, scale.param_factor)
            else:
                self._pipeline(i, tensor, scale.param_factor, plans[i], stages, first_prepared=i == 0)
            sent += tensor.numel() * tensor.element_size()
        if buffers is not None:
            sent += self._weighted_sum(buffers, scale.buffer_factor)
        return ReduceResult(False, sent, round(total_steps))

    def _reduce_on_device(
        self, tensor: Tensor, buffers: Tensor | None, steps: int, stages: ChunkStages | None
    ) -> ReduceResult:
        replayed = self._replayed
        if replayed is None or not (replayed.tensor is tensor and replayed.stages is stages):
            self.release()
            capture_after = self.capture_after if self.premul else None  # gloo cannot be captured
            replayed = ReplayedRound(
                tensor, buffers, stages, self._all_reduce, self.settle, self.group, capture_after
            )
            self._replayed = replayed
        if replayed.run(steps, self.gamma):
            return ReduceResult(True, 0, 0)
        sent = sum(t.numel() * t.element_size() for t in (tensor, buffers) if t is not None)
        return ReduceResult(False, sent, replayed)

    def release(self) -> None:
        """Free a captured round (before the process group is destroyed)."""
        if self._replayed is not None:
            self._replayed.release()
            self._replayed = None

    def _pinned_totals(self, values: list[float], device: torch.device) -> Tensor:
        """This rank's float64 totals in a host buffer kept for the purpose, pinned for a GPU: copied from
        there, the round's first transfer does not wait for the queued training steps (from pageable
        memory it would). The previous round's copy out of it is done: its totals were read since."""
        if self._own_totals is None:
            self._own_totals = torch.empty(len(values), dtype=torch.float64, pin_memory=device.type == "cuda")
        self._own_totals.numpy()[:] = values
        return self._own_totals

    def _spans(self, tensor: Tensor) -> list[slice]:
        if self._travels_as_delta(tensor):  # gathered whole: no chunked path
            return [slice(0, tensor.numel())]
        return chunk_spans(tensor.numel(), tensor.element_size(), self.chunks, self.min_chunk_bytes)

    def _travels_as_delta(self, tensor: Tensor) -> bool:
        return self.wire.needs_reference and tensor.dtype == torch.float32

    def feedback_state(self) -> dict[int, Tensor]:
        """A quantized wire's error feedback per reduced tensor (a rank's own: saved with its part)."""
        return {i: d.feedback for i, d in self.deltas.items() if d.feedback is not None}

    def feedback_tensors(self, params: list[Tensor]) -> list[Tensor]:
        """A quantized wire's error feedback for each tensor of `params` it carries, this rank's own (zero
        until its first round): what a cut round gives back."""
        return [
            feedback
            for i, tensor in enumerate(params)
            if self._travels_as_delta(tensor)
            for feedback in self._deltas(i).own_state(tensor)
        ]

    def load_feedback_state(self, state: dict[int, Tensor], params: list[Tensor]) -> None:
        for i, feedback in state.items():
            self._deltas(i).load_state(feedback, params[i])

    def _deltas(self, index: int) -> Deltas:
        if index not in self.deltas:
            self.deltas[index] = self.wire.deltas()
        return self.deltas[index]

    def _pipeline(
        self,
        index: int,
        tensor: Tensor,
        factor: float,
        spans: list[slice],
        stages: ChunkStages,
        *,
        first_prepared: bool = False,
    ) -> None:
        """Chunk k+1 is prepared and put on the wire before chunk k's result is waited for and settled,
        so the stages' work overlaps the transfer of the next chunk."""
        in_flight: deque[tuple[slice, dist.Work | None]] = deque()
        for k, span in enumerate(spans):
            if not (first_prepared and k == 0):
                stages.before(index, span)
            in_flight.append((span, self._all_reduce(tensor[span], factor, async_op=True)))
            if len(in_flight) == 2:
                self._settle(index, stages, *in_flight.popleft())
        while in_flight:
            self._settle(index, stages, *in_flight.popleft())

    def _settle(self, index: int, stages: ChunkStages, span: slice, work: dist.Work | None) -> None:
        self.settle(self._async(work))  # on a GPU: the current stream waits for the chunk; the host does not
        stages.after(index, span)

    @staticmethod
    def _async(work: dist.Work | None) -> dist.Work:
        assert work is not None  # async_op: torch hands back the work
        return work

    def _all_gather(self, gathered: Tensor, payload: Tensor) -> dist.Work:
        """Every rank's `payload` into `gathered`, in rank order."""
        if self._gathers_bare:
            assert self.group is not None
            return self.group._allgather_base(gathered, payload)
        return self._async(_all_gather_flat(gathered, payload, group=self.group, async_op=True))

    def _all_reduce(self, tensor: Tensor, factor: float | Tensor, async_op: bool = False) -> dist.Work | None:
        """SUM of `factor * tensor` over the group; a tensor `factor` (one element) is read on the device."""
        op: dist.ReduceOp | dist.ReduceOp.RedOpType
        if self.premul:
            op = dist._make_nccl_premul_sum(factor)
        else:
            tensor.mul_(factor)
            op = dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def _weighted_sum(self, tensor: Tensor, factor: float) -> int:
        self.settle(self._async(self._all_reduce(tensor, factor, async_op=True)))
        return tensor.numel() * tensor.element_size()

    def _reduce_delta(
        self, index: int, tensor: Tensor, ref: Tensor | None, factor: float, stages: ChunkStages | None
    ) -> int:
        """Gathered whole, so the stages run around the one collective."""
        assert ref is not None, "a delta wire needs the shared reference parameters"
        whole = slice(0, tensor.numel())
        if stages is not None and index > 0:  # the first tensor was prepared while the host read the totals
            stages.before(index, whole)
        deltas = self._deltas(index)
        payload = deltas.encode((tensor - ref).view(-1), factor)
        world = dist.get_world_size(self.group)
        gathered = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
        self.settle(self._all_gather(gathered, payload))
        # Summed in float32: ref + Σ_k w_k (θ_k - ref) = Σ_k w_k θ_k, since the weights sum to 1.
        summed = deltas.sum_gathered(gathered.view(world, -1), tensor.numel())
        torch.add(ref, summed.view_as(tensor), out=tensor)
        if stages is not None:
            stages.after(index, whole)
        return payload.numel() * payload.element_size()
