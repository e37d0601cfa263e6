"""A folded round's device work on fixed tensors, replayed as a CUDA graph once it has run eagerly.

The round (see `reducer.py`): the totals `[1, 1/m, n/m]` written in front of the parameters, one SUM
all-reduce of both scaled by this rank's mass m (NCCL PreMulSum), the totals copied to the host as soon
as they land, the parameters divided by `Σ m`, then the float32 buffers the same way with the mover flag
as their weight; the caller's stages (the guard's copy and norms) run around the all-reduce.

Every per-round number is written into one small pinned host buffer and reaches the device by a copy
inside the round, and the PreMulSum factor is read from device memory, so the same sequence of launches
serves every round. On a GPU over NCCL it is captured once, after a few eager rounds (NCCL and the
kernels' lazy set-up must be done before a capture), and each later round is one graph launch: a
10M-parameter round is latency-bound, and dispatching its ~10 operations one by one from Python cost
about a third of a plain all-reduce's time on 2x H200.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from flodl.averaging.weights import rank_contribution

if TYPE_CHECKING:
    from flodl.averaging.reducer import ChunkStages

# `[Σ m, Σ mover, Σ n]`: what travels in front of the parameters.
FOLDED_TOTALS = 3


def folded_head(steps: int, gamma: float) -> list[float]:
    """What a rank writes ahead of its parameters so that, scaled by its mass m = n^gamma and summed,
    the head holds `[Σ m, Σ mover, Σ n]`. An idle rank is scaled by 0 whatever it writes."""
    mass, _ = rank_contribution(steps, gamma)
    return [1.0, 1.0 / mass, steps / mass] if mass > 0.0 else [0.0, 0.0, 0.0]


# (tensor, factor, async_op): the reducer's weighted SUM all-reduce.
AllReduce = Callable[[Tensor, float | Tensor, bool], dist.Work | None]


class FoldedRound:
    def __init__(
        self,
        carrier: Tensor,
        tensor: Tensor,
        buffers: Tensor | None,
        stages: ChunkStages | None,
        all_reduce: AllReduce,
        capture_after: int | None,
    ) -> None:
        """`capture_after`: eager rounds before the capture (None: never capture)."""
        if carrier.numel() - tensor.numel() < FOLDED_TOTALS:
            raise ValueError(f"the carrier needs {FOLDED_TOTALS} spare elements in front of the parameters")
        self.carrier, self.tensor, self.buffers = carrier, tensor, buffers
        self.stages = stages
        self.whole = slice(0, tensor.numel())
        self.all_reduce = all_reduce
        cuda = tensor.is_cuda
        # [m, mover, head...]: the round's only inputs.
        self.inputs_host = torch.zeros(2 + FOLDED_TOTALS, pin_memory=cuda)
        self.inputs = torch.zeros(2 + FOLDED_TOTALS, device=tensor.device)
        self.totals_host = torch.zeros(FOLDED_TOTALS, pin_memory=cuda)
        self.capture_after = capture_after if cuda else None
        self.eager_rounds = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.done = torch.cuda.Event() if cuda else None

    def run(self, steps: int, gamma: float) -> None:
        """Queue the round (the host does not wait for it)."""
        self.inputs_host.numpy()[:] = [*rank_contribution(steps, gamma), *folded_head(steps, gamma)]
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

    def totals(self) -> list[float]:
        """`[Σ m, Σ mover, Σ n]` of the last round (waits for it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.totals_host.tolist()

    def release(self) -> None:
        """Free the graph (before the process group goes: it holds the communicator's work)."""
        if self.graph is not None:
            assert self.done is not None
            self.done.synchronize()  # a replay may still be running
            self.graph.reset()
            self.graph = None

    def _stage(self, name: str) -> None:
        if self.stages is not None:
            getattr(self.stages, name)(0, self.whole)

    def _queue(self) -> None:
        carrier, tensor, inputs = self.carrier, self.tensor, self.inputs
        inputs.copy_(self.inputs_host, non_blocking=True)
        carrier[:FOLDED_TOTALS].copy_(inputs[2:])
        self._stage("before")
        work = self.all_reduce(carrier, inputs[0:1], True)
        self._stage("during")
        assert work is not None
        work.wait()  # on a GPU: the current stream waits for the collective; the host does not
        self.totals_host.copy_(carrier[:FOLDED_TOTALS], non_blocking=True)
        # A foreach kernel reads Σ m once (a 0-dim operand would cost the division its vectorized loads).
        torch._foreach_div_([tensor], carrier[0])
        self._stage("after")
        if self.buffers is not None:
            self.all_reduce(self.buffers, inputs[1:2], False)
            # Σ mover, rounded: 1/m times m is not always exactly 1.
            torch._foreach_div_([self.buffers], carrier[1].round())
