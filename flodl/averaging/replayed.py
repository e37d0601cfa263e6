"""A round whose weights are computed on the device, so it can be replayed as a CUDA graph.

Why and when a round goes this way is in docs/architecture.md, "Local SGD reduce". The round works on fixed
tensors (the flat parameters, the float32 buffers) and its only input is this rank's `[n^gamma, mover, n]`,
copied from a pinned host buffer, so its launches are the same every round: on a GPU over NCCL it runs
eagerly `capture_after` times, is captured once, and each later round is one graph launch. The totals are
copied to the host as soon as they land and read when asked for.

A round nobody moved in divides 0 by 0: every rank's parameters turn NaN. Only an idle rank can be in one,
so an idle rank keeps its state first and puts it back when the totals say nobody moved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from flodl.averaging.stages import ChunkStages
from flodl.averaging.weights import rank_contribution

# (tensor, factor, async_op): the reducer's weighted SUM all-reduce.
AllReduce = Callable[[Tensor, float | Tensor, bool], dist.Work | None]
# How a collective's work is waited for (survive on gloo: given up once the group is cut).
Settle = Callable[[dist.Work], object]


class ReplayedRound:
    def __init__(
        self,
        tensor: Tensor,
        buffers: Tensor | None,
        stages: ChunkStages | None,
        all_reduce: AllReduce,
        settle: Settle,
        group: dist.ProcessGroup | None,
        capture_after: int | None,
    ) -> None:
        """`capture_after`: eager rounds before the capture (None: never capture; CUDA tensors only)."""
        self.tensor, self.buffers, self.stages = tensor, buffers, stages
        self.whole = slice(0, tensor.numel())
        self.all_reduce, self.settle, self.group = all_reduce, settle, group
        cuda = tensor.is_cuda
        # This rank's [n^gamma, mover, n]: the round's only input.
        self.own_host = torch.zeros(3, dtype=torch.float64, pin_memory=cuda)
        self.own_values = self.own_host.numpy()  # written in place each round (a view costs ~5 us to make)
        self.totals = torch.zeros(3, dtype=torch.float64, device=tensor.device)
        self.totals_host = torch.zeros(3, dtype=torch.float64, pin_memory=cuda)
        self.capture_after = capture_after if cuda else None
        self.eager_rounds = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.done = torch.cuda.Event() if cuda else None

    def run(self, steps: int, gamma: float) -> bool:
        """Queue the round; True if it was skipped (nobody moved). A rank that moved knows it was not and
        does not wait for the round; an idle one reads the totals."""
        mass, mover = rank_contribution(steps, gamma)
        targets = [self.tensor] if self.buffers is None else [self.tensor, self.buffers]
        kept = [t.clone() for t in targets] if mass <= 0.0 else []
        self.own_values[:] = [mass, mover, steps]
        self._launch()
        if kept and self.read_totals()[0] <= 0.0:
            for target, own in zip(targets, kept, strict=True):
                target.copy_(own)
            return True
        return False

    def _launch(self) -> None:
        """The round's launches: eagerly for the first rounds, then captured once and replayed."""
        if self.graph is None and self.capture_after is not None and self.eager_rounds >= self.capture_after:
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the data and heartbeat threads may use CUDA meanwhile.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self._queue()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._queue()
            self.eager_rounds += 1
        if self.done is not None:
            self.done.record()

    def read_totals(self) -> list[float]:
        """`[Σ n^gamma, Σ mover, Σ n]` of the last round (waits for it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.totals_host.tolist()

    def release(self) -> None:
        """Free the graph (before the process group is destroyed: destroying it first hangs)."""
        if self.graph is not None:
            assert self.done is not None
            self.done.synchronize()  # a replay may still be running
            self.graph.reset()
            self.graph = None

    def _queue(self) -> None:
        totals = self.totals
        own = self.own_host.to(totals.device, non_blocking=True)
        totals.copy_(own)
        self._settle(dist.all_reduce(totals, group=self.group, async_op=True))
        self.totals_host.copy_(totals, non_blocking=True)
        # [n^gamma / Σ n^gamma, mover / Σ mover] in float32, the payload's dtype (PreMulSum reads it there).
        factors = (own[:2] / totals[:2]).float()
        if self.stages is not None:
            self.stages.before(0, self.whole)
        self._settle(self.all_reduce(self.tensor, factors[0:1], True))
        if self.stages is not None:
            self.stages.after(0, self.whole)
        if self.buffers is not None:
            self._settle(self.all_reduce(self.buffers, factors[1:2], True))

    def _settle(self, work: dist.Work | None) -> None:
        assert work is not None  # async_op: torch hands back the work
        self.settle(work)  # on a GPU: the current stream waits for the collective; the host does not
