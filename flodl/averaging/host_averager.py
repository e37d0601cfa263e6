"""The host backend (backend=cpu): a round reduces a pinned host snapshot of the parameters over a gloo
group on a background thread while training goes on (see `consensus.py`). A sharded model's (shard_group
> 1): a snapshot of the rank's shard (shards.py), reduced over the gloo group of its shard index."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flodl.averaging.averager_base import AveragerBase, RoundOutcome, after_reduce, make_refs
from flodl.averaging.divergence import divergence
from flodl.averaging.outer import OuterOptimizer, OuterSettings
from flodl.averaging.reduce_group import ReduceGroup, WorldGroup
from flodl.averaging.wire import FP32, Wire


class HostAverager(AveragerBase):
    def __init__(
        self,
        model: nn.Module,
        gamma: float,
        device: torch.device,
        group: ReduceGroup | dist.ProcessGroup | None,
        wire: Wire = FP32,
        outer: OuterSettings | None = None,
        shard_group: int = 1,
    ) -> None:
        """`group`: who the round's thread reduces with; a bare gloo process group (None: the world's) stands
        for the fixed world over it. `shard_group`: see AveragerBase."""
        if group is None or isinstance(group, dist.ProcessGroup):
            group = WorldGroup(group)
        super().__init__(model, gamma, wire, outer, group, shard_group)
        self.device = device
        pin = device.type == "cuda"
        flat = self._flat_params()
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in flat]
        self.host_pre = [torch.empty_like(t) for t in self.host]
        self.host_buffers = (
            torch.empty(self.buffers.buffer.shape, pin_memory=pin) if self.buffers is not None else None
        )
        for host, tensor in zip(self.host, flat, strict=True):
            host.copy_(tensor)
        self.outer = OuterOptimizer(outer, self.host) if outer else None
        self.refs = make_refs(self.outer, wire, self.host)
        # Device scratch: the consensus lands here before it is adopted or blended.
        self.landing = [torch.empty_like(t) for t in flat]
        self.copy_stream = torch.cuda.Stream(device) if pin else None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._begin_ms = 0.0
        # When the round began and when its thread had the consensus (perf_counter seconds).
        self._began_at = 0.0
        self._reduced_at = 0.0

    def _reduced_tensors(self) -> list[Tensor]:
        return self.host

    @torch.no_grad()
    def begin(self, steps: int, exact: bool = False, kept: bool = True) -> None:
        """Snapshot and start the round on a thread; `exact` and `kept` as in `Reducer.reduce`."""
        start = self._began_at = time.perf_counter()
        self._pull()
        self._keep_round_start()
        snapshot_done = self._to_host()
        self.thread = threading.Thread(
            target=self._round, args=(steps, exact, kept, snapshot_done), daemon=True
        )
        self.thread.start()
        self._begin_ms = (time.perf_counter() - start) * 1000

    def ready(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    @torch.no_grad()
    def finish(self) -> RoundOutcome:
        """Wait for the round (at once if it is done) and stage the consensus on the device."""
        start = time.perf_counter()
        assert self.thread is not None, "finish() without begin()"
        self.thread.join()
        self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"the cpu-backend averaging round failed: {error}") from error
        assert self.outcome is not None
        if not self.outcome.skipped:
            for landing, host in zip(self.landing, self.host, strict=True):
                landing.copy_(host, non_blocking=True)
        blocked = self._begin_ms + (time.perf_counter() - start) * 1000
        return RoundOutcome(
            self.outcome.steps,
            self.outcome.total_steps,
            self.outcome.skipped,
            self.outcome.divergence,
            blocked,
            self.outcome.payload_bytes,
            (self._reduced_at - self._began_at) * 1000,
        )

    def discard_round(self) -> None:
        """survive: the round was cut. The rank's parameters were never touched (the reduce ran on the host
        copy); its thread ends when the group is cut (or on a dead peer's closed socket, or the timeout), and
        what it changed of the averaging goes back."""
        if self.thread is not None:
            self.thread.join(timeout=self.group.timeout_s + 5)
            if self.thread.is_alive():
                raise RuntimeError("a cut averaging round did not end within the group's timeout")
        self.thread, self.error, self.outcome = None, None, None
        self.restore_averaging()

    @torch.no_grad()
    def adopt(
        self, alpha: float | None, evaluate: Callable[[], None] | None, keep_progress: bool = False
    ) -> None:
        """Overwrite (or blend) the rank's current parameters with the staged consensus; `keep_progress`
        (overlapped rounds, `alpha` None): keep what the rank trained since its snapshot instead,
        `params += consensus - snapshot`. The blend is the device backend's, `avg + (1 - alpha) (own - avg)`:
        with no step since the snapshot, the same numbers.

        An eval asked for runs on the consensus (buffers included), then the rank's own parameters
        come back for the blend; on a skipped round it runs on the rank's unchanged state. A sharded model's
        shards, trained on since the snapshot, are read here and written back after.
        """
        assert self.outcome is not None
        skipped, self.outcome = self.outcome.skipped, None
        if skipped:
            if evaluate is not None:
                evaluate()
            return
        if self.buffers is not None and self.host_buffers is not None:
            self.buffers.buffer.copy_(self.host_buffers, non_blocking=True)
        self._pull()
        flat = self._flat_params()
        if evaluate is not None:
            kept = [t.clone() for t in flat]
            torch._foreach_copy_(flat, self.landing)
            self._push()
            evaluate()
            torch._foreach_copy_(flat, kept)
        if keep_progress:
            assert alpha is None, "an overlapped round keeps the rank's progress: it is not blended"
            for landing, sent_minus_consensus in zip(self.landing, self.host_pre, strict=True):
                landing.copy_(sent_minus_consensus, non_blocking=True)
            torch._foreach_sub_(flat, self.landing)
        elif alpha is None:
            torch._foreach_copy_(flat, self.landing)
        else:
            torch._foreach_sub_(flat, self.landing)
            torch._foreach_add_(self.landing, flat, alpha=1.0 - alpha)
            torch._foreach_copy_(flat, self.landing)
        self._push()

    def _to_host(self) -> torch.cuda.Event | None:
        """Copy parameters and buffers into the host buffers without blocking the training thread."""
        flat = self._flat_params()
        buffers = self.buffers.buffer if self.buffers is not None else None
        if self.copy_stream is None:
            torch._foreach_copy_(self.host, flat)
            if buffers is not None and self.host_buffers is not None:
                self.host_buffers.copy_(buffers)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for host, tensor in zip(self.host, flat, strict=True):
                host.copy_(tensor, non_blocking=True)
            if buffers is not None and self.host_buffers is not None:
                self.host_buffers.copy_(buffers, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        # The steps trained on meanwhile (async, overlapped rounds) overwrite what the copy reads: they wait
        # for it on the device (the host goes on).
        torch.cuda.current_stream(self.device).wait_event(done)
        return done

    @torch.no_grad()
    def _round(self, steps: int, exact: bool, kept: bool, snapshot_done: torch.cuda.Event | None) -> None:
        try:
            if snapshot_done is not None:
                snapshot_done.synchronize()
            torch._foreach_copy_(self.host_pre, self.host)
            result = self.reducer.reduce(
                self.host, self.refs, self.host_buffers, steps, exact=exact, kept=kept
            )
            measured = 0.0
            if not result.skipped:
                after_reduce(self.outer, self.refs, self.host)
                # host_pre becomes snapshot - consensus: what an overlapped round's adopt subtracts.
                measured = divergence(self.host_pre, self.host, in_place=True)
            total = result.total_steps * self.shard_group
            self.outcome = RoundOutcome(steps, total, result.skipped, measured, 0.0, result.payload_bytes)
            self._reduced_at = time.perf_counter()
        except BaseException as err:  # surfaced by finish()
            self.error = err
