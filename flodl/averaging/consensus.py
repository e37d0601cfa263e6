"""Averaging backends for local SGD: how a round runs once the coordinator says when.

The reduce itself is `reducer.py`'s (the mechanism: docs/architecture.md, "Local SGD reduce").

Both backends own the model's flat parameter storage (see `flat.py`) and expose one round as
`begin(steps)` → `ready()` → `finish()` → `adopt(alpha, evaluate)`:

- `DeviceAverager` (backend=nccl; gloo without a GPU): `begin` queues the reduce on the device, in place
  (a small model's round replayed as a CUDA graph, see `replayed.py`); `finish` reads what it measured.
- `HostAverager` (backend=cpu): `begin` snapshots the parameters into host buffers and reduces them over a
  gloo group on a background thread; training goes on meanwhile (async, or overlapped rounds) and the
  consensus is adopted at a later step boundary. Steps taken during the round keep their weight for the
  next one; an overlapped round keeps them in the parameters too (`params += consensus - snapshot`).

After the reduce, an optional outer optimizer steps the global parameters (`outer.py`); `adopt` evaluates
the consensus if asked, then overwrites the rank's parameters or blends them (EASGD:
`W += alpha (avg - W)`). Float32 buffers are always overwritten. Optimizer state is never averaged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flodl.averaging.divergence import DivergenceSums, divergence
from flodl.averaging.flat import flatten_float32_buffers, flatten_parameters, state_digest
from flodl.averaging.outer import OuterOptimizer, OuterSettings
from flodl.averaging.reducer import CAPTURE_AFTER, Reducer, ReduceResult


@dataclass(frozen=True)
class RoundOutcome:
    steps: int
    # Σ over ranks of the steps since the last reduce (the run's step clock advances by this).
    total_steps: int
    # No rank moved since the last reduce: nothing was averaged, everyone kept its state.
    skipped: bool
    # ‖own - consensus‖ / ‖consensus‖ (0 when the rank kept no pre-reduce copy or the round was skipped).
    divergence: float
    # Time the round held up this rank's training thread.
    blocked_ms: float
    payload_bytes: int = 0
    # From the round's start to its consensus on this rank, whether training waited for it or not (the
    # device backend's round is all on the training thread: its blocked time).
    comm_ms: float = 0.0


class ReduceGroup(Protocol):
    """Who an averager reduces with, chosen once by the assembly (flodl/worker/group.py): the fixed world
    (`WorldGroup`), or survive's members, whose group a death or a restart replaces under a round."""

    # Eager rounds before a round weighted on the device is replayed from a CUDA graph (None: never; a graph
    # cannot follow a group to its next communicator).
    capture_after: int | None
    # How long a collective of the group may take (a cut round's thread ends within it).
    timeout_s: float

    def collective(self) -> tuple[dist.ProcessGroup | None, str | None]:
        """The members' process group now (None: the world's) and its backend (None: torch knows it)."""
        ...

    def settle(self, work: dist.Work) -> None:
        """Wait for `work`, one of the group's collectives."""
        ...

    def share_before_start(self, tensors: list[Tensor]) -> None:
        """Every member starts from the first member's `tensors`: the world's as the averager is built;
        survive's members once their first group is formed (the worker's start shares then)."""
        ...

    def keep_round_start(self, tensors: list[Tensor]) -> None:
        """A round begins on `tensors`: what a cut round goes back to (a group that cuts no round keeps
        nothing)."""
        ...

    def back_to_round_start(self, tensors: list[Tensor]) -> None:
        """A round was cut: `tensors` go back to what `keep_round_start` kept."""
        ...


class WorldGroup:
    """A group whose members never change: the world, over its default process group or `process_group` (a
    gloo group of the same ranks for host tensors). A failed collective ends the run: no round is undone."""

    capture_after: int | None = CAPTURE_AFTER

    def __init__(self, process_group: dist.ProcessGroup | None = None, timeout_s: float = 1800.0) -> None:
        """`timeout_s`: the world's collective timeout (torch's default unless the run sets its own)."""
        self.process_group = process_group
        self.timeout_s = timeout_s

    def collective(self) -> tuple[dist.ProcessGroup | None, str | None]:
        return self.process_group, None

    def settle(self, work: dist.Work) -> None:
        work.wait()

    def share_before_start(self, tensors: list[Tensor]) -> None:
        for tensor in tensors:  # over the default group: the host averager's gloo group spans the same ranks
            dist.broadcast(tensor, src=0)

    def keep_round_start(self, tensors: list[Tensor]) -> None:
        """Nothing: a failed round ends the run."""

    def back_to_round_start(self, tensors: list[Tensor]) -> None:
        raise RuntimeError("a fixed group cuts no round: there is no round start to go back to")


WORLD = WorldGroup()


class _AveragerBase:
    def __init__(
        self, model: nn.Module, gamma: float, wire: str, outer: OuterSettings | None, group: ReduceGroup
    ) -> None:
        self.params = flatten_parameters(model)
        self.buffers = flatten_float32_buffers(model)
        self.group = group
        self.share(group.share_before_start)
        process_group, backend = group.collective()
        self.reducer = Reducer(gamma, wire, process_group, backend, group.settle)
        self.reducer.capture_after = group.capture_after
        self.outer_settings = outer
        self.outer: OuterOptimizer | None = None
        self.outcome: RoundOutcome | None = None

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's momentum (its global parameters are the consensus a checkpoint holds) and
        a quantized wire's error feedback."""
        state: dict[str, Any] = {"wire_feedback": self.reducer.feedback_state()}
        if self.outer is not None:
            state["outer"] = self.outer.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer is not None and "outer" in state:
            self.outer.optimizer.load_state_dict(state["outer"])
        self.reducer.load_feedback_state(state.get("wire_feedback", {}), self._reduced_tensors())

    def _reduced_tensors(self) -> list[Tensor]:
        """The tensors the reducer is handed, in its order (the device's flat buffers, or their host copy)."""
        return self._flat_params()

    @torch.no_grad()
    def discard_own(self) -> None:
        """Zero this rank's parameters before a round it joins with no weight (its window went non-finite):
        a NaN times a zero weight would still poison the sum."""
        for group in self.params:
            group.buffer.zero_()

    @property
    def resets_inner(self) -> bool:
        """DiLoCo: the inner optimizer's state is reset after each adopted round."""
        return self.outer_settings is not None and self.outer_settings.resets_inner

    def _state_tensors(self) -> list[Tensor]:
        """What makes two ranks' models the same: the flat parameters and f32 buffers."""
        return self._flat_params() + ([self.buffers.buffer] if self.buffers is not None else [])

    @torch.no_grad()
    def share(self, send: Callable[[list[Tensor]], None]) -> None:
        """Make every rank hold the same state through `send` (a broadcast from one rank). Local SGD never
        runs DDP's initial broadcast; a rank joining a survive run receives the consensus this way."""
        send(self._state_tensors())

    @torch.no_grad()
    def restore_pre_round(self) -> None:
        """A round this rank finished was cut elsewhere: back to the state it began from."""
        self.group.back_to_round_start(self._state_tensors())

    @torch.no_grad()
    def state_digest(self) -> str:
        """The fingerprint of the rank's state (see flat.state_digest)."""
        return state_digest(self._state_tensors())

    def regroup(self) -> None:
        """Average over the group's newly formed members from the next round on."""
        self.reducer.set_group(*self.group.collective())

    def _flat_params(self) -> list[Tensor]:
        return [g.buffer for g in self.params]

    def release(self) -> None:
        """Free what the rounds hold on the device for the process group (before it is destroyed)."""
        self.reducer.release()


def _make_refs(outer: OuterOptimizer | None, wire: str, tensors: list[Tensor]) -> list[Tensor] | None:
    """The shared reference parameters: the outer optimizer's global, or the last consensus for a delta
    wire."""
    if outer is not None:
        return outer.global_params
    return [t.detach().clone() for t in tensors] if wire != "fp32" else None


def _after_reduce(outer: OuterOptimizer | None, refs: list[Tensor] | None, consensus: list[Tensor]) -> None:
    """Step the outer optimizer (new global into `consensus`), or remember the consensus as reference."""
    if outer is not None:
        outer.step(consensus)
    elif refs is not None:
        for ref, cons in zip(refs, consensus, strict=True):
            ref.copy_(cons)


class DeviceAverager(_AveragerBase):
    def __init__(
        self,
        model: nn.Module,
        gamma: float,
        device: torch.device,
        wire: str = "fp32",
        outer: OuterSettings | None = None,
        keeps_own: bool = True,
        group: ReduceGroup = WORLD,
    ) -> None:
        """`keeps_own`: keep a pre-reduce copy of the rank's parameters, which the divergence and the
        EASGD blend need; without it a round is the two all-reduces and nothing else."""
        super().__init__(model, gamma, wire, outer, group)
        # The rank's own parameters before the reduce, turned into `own - consensus` after it (the
        # divergence is measured in place, sparing a parameter-sized temporary and a pass over memory).
        self.drift = [torch.empty_like(t) for t in self._flat_params()] if keeps_own else None
        self.sums = DivergenceSums() if keeps_own else None
        self.outer = OuterOptimizer(outer, self._flat_params()) if outer else None
        self.refs = _make_refs(self.outer, wire, self._flat_params())
        # Between begin and finish: the rank's steps, the reduce's result and begin's wall time (ms).
        self.queued: tuple[int, ReduceResult, float] | None = None

    @torch.no_grad()
    def begin(self, steps: int, exact: bool = False, kept: bool = True) -> None:
        """Queue the round, in place; `exact` and `kept` as in `Reducer.reduce`. What it measured (the
        totals, the divergence) is read from the device in `finish`."""
        start = time.perf_counter()
        self.group.keep_round_start(self._state_tensors())
        flat = self._flat_params()
        buffers = self.buffers.buffer if self.buffers is not None else None
        # The guard's copy and norms ride along chunk by chunk while the reduce is on the wire. An outer
        # optimizer's step needs the whole consensus first, so then they run before and after it.
        stages = self if self.sums is not None and self.outer is None else None
        if self.sums is not None and stages is None:
            self._for_each_whole(self.before)
        result = self.reducer.reduce(flat, self.refs, buffers, steps, stages, exact=exact, kept=kept)
        if not result.skipped:
            _after_reduce(self.outer, self.refs, flat)
            if self.sums is not None and stages is None:
                self._for_each_whole(self.after)
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
        total_steps = result.total_steps
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
        self.outcome = None


class HostAverager(_AveragerBase):
    def __init__(
        self,
        model: nn.Module,
        gamma: float,
        device: torch.device,
        group: ReduceGroup | dist.ProcessGroup | None,
        wire: str = "fp32",
        outer: OuterSettings | None = None,
    ) -> None:
        """`group`: who the round's thread reduces with; a bare gloo process group (None: the world's) stands
        for the fixed world over it."""
        if group is None or isinstance(group, dist.ProcessGroup):
            group = WorldGroup(group)
        super().__init__(model, gamma, wire, outer, group)
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
        self.refs = _make_refs(self.outer, wire, self.host)
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
        self.group.keep_round_start(self._state_tensors())
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
            self.outcome.steps, self.outcome.total_steps, self.outcome.skipped, self.outcome.divergence,
            blocked, self.outcome.payload_bytes, (self._reduced_at - self._began_at) * 1000,
        )  # fmt: skip

    def discard_round(self) -> None:
        """survive: the round was cut. The rank's parameters were never touched (the reduce ran on the host
        copy); its thread ends when the group is cut (or on a dead peer's closed socket, or the timeout)."""
        if self.thread is not None:
            self.thread.join(timeout=self.group.timeout_s + 5)
            if self.thread.is_alive():
                raise RuntimeError("a cut averaging round did not end within the group's timeout")
        self.thread, self.error, self.outcome = None, None, None

    @torch.no_grad()
    def adopt(
        self, alpha: float | None, evaluate: Callable[[], None] | None, keep_progress: bool = False
    ) -> None:
        """Overwrite (or blend) the rank's current parameters with the staged consensus; `keep_progress`
        (overlapped rounds, `alpha` None): keep what the rank trained since its snapshot instead,
        `params += consensus - snapshot`.

        An eval asked for runs on the consensus (buffers included), then the rank's own parameters
        come back for the blend; on a skipped round it runs on the rank's unchanged state.
        """
        assert self.outcome is not None
        skipped, self.outcome = self.outcome.skipped, None
        if skipped:
            if evaluate is not None:
                evaluate()
            return
        if self.buffers is not None and self.host_buffers is not None:
            self.buffers.buffer.copy_(self.host_buffers, non_blocking=True)
        flat = self._flat_params()
        if evaluate is not None:
            kept = [t.clone() for t in flat]
            torch._foreach_copy_(flat, self.landing)
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
            for tensor, landing in zip(flat, self.landing, strict=True):
                tensor.lerp_(landing, alpha)

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
                _after_reduce(self.outer, self.refs, self.host)
                # host_pre becomes snapshot - consensus: what an overlapped round's adopt subtracts.
                measured = divergence(self.host_pre, self.host, in_place=True)
            self.outcome = RoundOutcome(
                steps, result.total_steps, result.skipped, measured, 0.0, result.payload_bytes
            )
            self._reduced_at = time.perf_counter()
        except BaseException as err:  # surfaced by finish()
            self.error = err
