"""The device backend (backend=nccl; gloo without a GPU): a round reduces the flat parameters in place on
their device (see `consensus.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from flodl.averaging.averager_base import AveragerBase, RoundOutcome, after_reduce, make_refs
from flodl.averaging.divergence import DivergenceSums
from flodl.averaging.outer import OuterOptimizer, OuterSettings
from flodl.averaging.reduce_group import WORLD, ReduceGroup
from flodl.averaging.reducer import ReduceResult
from flodl.averaging.wire import FP32, Wire


class DeviceAverager(AveragerBase):
    def __init__(
        self,
        model: nn.Module,
        gamma: float,
        device: torch.device,
        wire: Wire = FP32,
        outer: OuterSettings | None = None,
        keeps_own: bool = True,
        group: ReduceGroup = WORLD,
        shard_group: int = 1,
    ) -> None:
        """`keeps_own`: keep a pre-reduce copy of the rank's parameters, which the divergence and the
        EASGD blend need; without it a round is the two all-reduces and nothing else. `shard_group`: see
        AveragerBase."""
        super().__init__(model, gamma, wire, outer, group, shard_group)
        # The rank's own parameters before the reduce, turned into `own - consensus` after it (the
        # divergence is measured in place, sparing a parameter-sized temporary and a pass over memory).
        self.drift = [torch.empty_like(t) for t in self._flat_params()] if keeps_own else None
        self.sums = DivergenceSums() if keeps_own else None
        self.outer = OuterOptimizer(outer, self._flat_params()) if outer else None
        self.refs = make_refs(self.outer, wire, self._flat_params())
        # Between begin and finish: the rank's steps, the reduce's result and begin's wall time (ms).
        self.queued: tuple[int, ReduceResult, float] | None = None

    @torch.no_grad()
    def begin(self, steps: int, exact: bool = False, kept: bool = True) -> None:
        """Queue the round, in place; `exact` and `kept` as in `Reducer.reduce`. What it measured (the
        totals, the divergence) is read from the device in `finish`."""
        start = time.perf_counter()
        self._pull()
        self._keep_round_start()
        flat = self._flat_params()
        buffers = self.buffers.buffer if self.buffers is not None else None
        # The guard's copy and norms ride along chunk by chunk while the reduce is on the wire. An outer
        # optimizer's step needs the whole consensus first, so then they run before and after it.
        stages = self if self.sums is not None and self.outer is None else None
        if self.sums is not None and stages is None:
            self._for_each_whole(self.before)
        result = self.reducer.reduce(flat, self.refs, buffers, steps, stages, exact=exact, kept=kept)
        if not result.skipped:
            after_reduce(self.outer, self.refs, flat)
            if self.sums is not None and stages is None:
                self._for_each_whole(self.after)
            self._push()
        self.queued = (steps, result, (time.perf_counter() - start) * 1000)

    def before(self, index: int, span: slice) -> None:
        """Keep the chunk's pre-reduce values (for the divergence and the EASGD blend). The first chunk starts
        the round's sums; a round replayed from a CUDA graph runs no stages and refills the captured ones."""
        assert self.drift is not None and self.sums is not None
        if index == 0 and span.start == 0:
            self.sums.reset()
        self.drift[index][span].copy_(self.params[index].buffer[span])

    def after(self, index: int, span: slice) -> None:
        """The chunk holds the consensus: the kept copy becomes `own - consensus`; the norms of the two are
        the divergence's pieces."""
        assert self.drift is not None and self.sums is not None
        self.sums.add([self.drift[index][span]], [self.params[index].buffer[span]], in_place=True)

    def _for_each_whole(self, stage: Callable[[int, slice], None]) -> None:
        for index, group in enumerate(self.params):
            stage(index, slice(0, group.buffer.numel()))

    def ready(self) -> bool:
        return True

    def discard_round(self) -> None:
        """survive: the round was cut (its reduce ran in place, partly): back to the pre-round state."""
        self.queued = None
        self.outcome = None
        self.restore_pre_round()

    def finish(self) -> RoundOutcome:
        """Read what the round measured (waiting for the device where it is not done yet)."""
        start = time.perf_counter()
        assert self.queued is not None, "finish() without begin()"
        (steps, result, begin_ms), self.queued = self.queued, None
        measured = 0.0
        if self.sums is not None and not result.skipped:
            measured = self.sums.read()
        total_steps = result.total_steps * self.shard_group
        blocked = begin_ms + (time.perf_counter() - start) * 1000
        self.outcome = RoundOutcome(
            steps, total_steps, result.skipped, measured, blocked, result.payload_bytes, blocked
        )
        return self.outcome

    @torch.no_grad()
    def adopt(
        self, alpha: float | None, evaluate: Callable[[], None] | None, keep_progress: bool = False
    ) -> None:
        """The parameters hold the consensus: evaluate it, then blend back toward the rank's own (EASGD):
        own + alpha (avg - own) = avg + (1 - alpha) (own - avg). `keep_progress`: the host backend's
        (overlapped rounds); this round ran in place, so nothing was trained since its snapshot."""
        assert not keep_progress, "overlapped rounds run on the host backend (the rules refuse the device's)"
        if evaluate is not None:
            evaluate()
        if alpha is not None and self.outcome is not None and not self.outcome.skipped:
            assert self.drift is not None, "the EASGD blend needs keeps_own=True"
            torch._foreach_add_(self._flat_params(), self.drift, alpha=1.0 - alpha)
            self._push()
        self.outcome = None
