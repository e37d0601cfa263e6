"""The local-SGD worker (cadence / async): trains the batches it is handed, averages when told.

Policy-agnostic: the coordinator's messages carry the policy. `ExtendPartition` appends batches to the
rank's queue and says at how many steps since the last reduce to report `Reached`; `AverageNow` starts a
consensus round on the averaging backend. The device backend finishes it at once; the cpu backend runs it
on a background thread, and when `keep_training` (async) the rank trains on and adopts the consensus at a
later step boundary (a sharded group's members at one: group_steps.py), so steps taken meanwhile count
toward the next round. With `overlap` (cadence, cpu backend) the rank trains the next window, sent with the
round, meanwhile and, once the round is done (a full replica) or at that window's end (a sharded group's
members), keeps what it trained since its snapshot on top of the consensus; a segment's last round is waited
for, exact. Between steps the worker only checks a local queue for control messages; the device is read
once per chunk (the loss) and once per window.

Under fault_tolerance=survive the rank's group (flodl/worker/group.py) carries each membership change out:
the worker lets go of a round the change cut (back to its state before it, when that round must be redone),
and the members share the first one's state when the change says so.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from flodl.averaging.consensus import DeviceAverager, HostAverager
from flodl.checkpoints.disk import Point
from flodl.links.membership import AveragingGroup
from flodl.links.messages import (
    AverageNow,
    EpochSlice,
    ExtendPartition,
    Message,
    Reached,
    Regroup,
    Regrouped,
    RoundAck,
)
from flodl.worker.base import RankLink, WorkerBase, WorkerSettings
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.group import RankGroup
from flodl.worker.group_steps import GroupSteps
from flodl.worker.joiner_state import share_with_joiners
from flodl.worker.local_chunk import Chunk
from flodl.worker.local_round import FinishedRound, RoundInFlight
from flodl.worker.nonfinite import NonFiniteError
from flodl.worker.stepper import Stepper

log = logging.getLogger("flodl")


class LocalSgdWorker(WorkerBase):
    def __init__(
        self,
        stepper: Stepper,
        link: RankLink,
        settings: WorkerSettings,
        averager: DeviceAverager | HostAverager,
        easgd_alpha: float | None,
        keep_training: bool,
        checkpointer: RankCheckpointer | None = None,
        group: RankGroup | None = None,
        overlap: bool = False,
        group_steps: GroupSteps | None = None,
    ) -> None:
        super().__init__(stepper, link, settings, checkpointer, group)
        self.group_steps = group_steps  # async over sharded groups: the members' vote before each step
        self.averager = averager
        self.easgd_alpha = easgd_alpha
        # Train on while a (cpu-backend) round is in flight, instead of waiting for its consensus.
        self.keep_training = keep_training
        self.overlap = overlap  # the next window trains while a round (not a segment's last) is in flight
        # The round begun and not adopted yet, and the last one finished (a change may still cut it).
        self.round: RoundInFlight | None = None
        self.finished: FinishedRound | None = None
        self.pending: deque[EpochSlice] = deque()
        self.chunk: Chunk | None = None
        self.steps_since_avg = 0
        self.target: int | None = None
        self.window_busy_s = 0.0
        # When the current window began: the last round's end (the first window: the first dispatch).
        self.window_started: float | None = None
        # Σ over ranks of the steps at every reduce so far (the LR schedule's clock, see schedule_position).
        self.global_steps = 0
        # on_nonfinite=skip dropped this rank's window: it adopts the consensus exactly and starts afresh. The
        # window's, not its round's: a round cut meanwhile is redone without it too.
        self.dropped_window = False

    def state(self) -> dict[str, Any]:
        return {"global_steps": self.global_steps, "averager": self.averager.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.global_steps = int(state["global_steps"])
        self.averager.load_state_dict(state["averager"])

    def shared_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The round clock and the outer optimizer are every rank's; a wire's error feedback (what that
        rank's earlier rounds left out) is its own: a rank taking it would send it a second time."""
        averager = {key: value for key, value in state["averager"].items() if key != "wire_feedback"}
        return {**state, "averager": averager}

    def release(self) -> None:
        self.averager.release()

    def on_nonfinite_progress(self) -> None:  # skip: the window boundary handles it
        if self.on_nonfinite == "error":
            self.raise_if_nonfinite()

    def has_work(self) -> bool:
        return (self.round is not None and not self.round.awaiting_window) or self._has_batches()

    def on_done(self) -> None:
        """The state every member holds after the run's last, exact round (a fingerprint)."""
        final = self.finished.final_round if self.finished is not None else None
        if final is not None:
            self.group.say_state(lambda: f"final round {final}: {self.averager.state_digest()}")

    def handle(self, message: Message) -> None:
        if isinstance(message, ExtendPartition):
            if self.finished is not None:  # a new window: the last round is every member's for good
                self.finished = replace(self.finished, cuttable=False)
            if self.round is not None:
                self.round.awaiting_window = False
            if self.window_started is None:
                self.window_started = time.perf_counter()
            self.pending.extend(message.slices)
            for part in message.slices:
                self.stepper.advise(part)
            if message.target is not None:
                self.target = message.target
                self._report_if_reached()
        elif isinstance(message, AverageNow):
            if message.generation == self.group.generation:  # else meant for a group never formed
                self._begin_round(message)
        else:
            raise RuntimeError(f"rank {self.rank}: unexpected message under local SGD: {message!r}")

    def queued_batches(self) -> int:
        in_chunk = self.chunk.batches - self.chunk.done if self.chunk else 0
        return in_chunk + sum(part.size // self.stepper.step_samples for part in self.pending)

    def work(self) -> None:
        done = self.averager.ready()  # a sharded group's members adopt together (see the module's doc)
        if self.round is not None and ((done and self.averager.shards is None) or not self._has_batches()):
            self._finish_round(self.round)
            return
        if self.group_steps is not None:
            step = self.group_steps.may_step(self.round is None or done)
            if self.group_steps.adopts and self.round is not None:
                self._finish_round(self.round)
            if not step:
                return
        stepper = self.stepper
        step_samples = stepper.step_samples
        if self.chunk is None:
            part = self.pending.popleft()
            zero = torch.zeros((), device=stepper.device)
            self.chunk = Chunk(part.epoch, part.offset, stepper.picks(part), part.size // step_samples, zero)
        chunk = self.chunk
        if chunk.done == 0:
            chunk.started_at = time.time()
        started = time.perf_counter()
        micro_batches = stepper.load_step(
            chunk.picks[chunk.done * step_samples : (chunk.done + 1) * step_samples], chunk.epoch
        )
        loaded = time.perf_counter()
        loss = stepper.step(micro_batches)
        chunk.loss_sum += loss
        chunk.done += 1
        self.steps_since_avg += 1
        stepper.schedule_to(self.schedule_position())
        self.observe(loss, chunk.epoch)
        finished = time.perf_counter()
        # Compiling is neither training (ElChe's speed) nor round overhead (idle): the window starts after it.
        compile_s = stepper.take_compile_s()
        chunk.compile_s += compile_s
        chunk.started_at += compile_s
        if self.window_started is not None:
            self.window_started += compile_s
        chunk.data_s += loaded - started
        chunk.busy_s += finished - started - compile_s
        self.window_busy_s += finished - started - compile_s
        if chunk.done == chunk.batches:
            self.chunk = None
            self.report(chunk.report(self.rank, stepper))
        self._report_if_reached()

    def schedule_position(self) -> int:
        """The LR schedule's clock, as in the original: every rank's steps up to the last reduce (shared by
        all ranks) plus this rank's steps since."""
        return self.global_steps + self.steps_since_avg

    def _report_if_reached(self) -> None:
        # A round in flight averages the steps (and their time) before its snapshot: the open window after.
        in_flight = self.round
        steps = self.steps_since_avg - (in_flight.steps if in_flight else 0)
        if self.target is None or steps < self.target:
            return
        if self.stepper.device.type == "cuda":
            # Once per window: the host runs steps ahead of the device, so the window's busy time ends when
            # the device has finished them (counted as idle, the drain would inflate ElChe's overhead).
            drain_started = time.perf_counter()
            torch.cuda.current_stream(self.stepper.device).synchronize()
            self.window_busy_s += time.perf_counter() - drain_started
        busy_s = self.window_busy_s - (in_flight.busy_s if in_flight else 0.0)
        self.report(Reached(self.rank, steps, busy_s * 1000))
        self.target = None

    def _has_batches(self) -> bool:
        """Batches to train now (none while its sharded group stopped for a round it has no order of yet)."""
        held = self.group_steps is not None and self.group_steps.held
        return (self.chunk is not None or bool(self.pending)) and not held

    def _begin_round(self, order: AverageNow) -> None:
        if self.group_steps is not None:
            self.group_steps.before_round(self._has_batches())
        steps = self.steps_since_avg
        if self.on_nonfinite == "error":
            self.raise_if_nonfinite()
        else:
            bad_step = self.first_nonfinite_step()
            if bad_step is not None:
                log.warning("rank %d: non-finite loss at step %d; its window is dropped", self.rank, bad_step)
                self.averager.discard_own()
                self.dropped_window = True
                steps = 0  # no weight in the average
        chunk = self.chunk
        if chunk is not None and chunk.done:
            # The round averages the slice's trained start: reported now, a death hands out only the rest.
            self.chunk = chunk.rest(self.stepper.step_samples)
            self.report(chunk.report(self.rank, self.stepper))
        self.stepper.fault.before_round(self.stepper.steps_total)
        overlapped = self.overlap and not order.final and not self.dropped_window
        begun = RoundInFlight(order, self.steps_since_avg, self.window_busy_s, overlapped, overlapped)
        try:  # a run's or segment's last round leaves every rank with one state, even if nobody moved
            self.averager.begin(steps, exact=order.final, kept=not self.dropped_window)
        except Exception as err:
            self._cut(begun, err)
            return
        self.round = begun
        if not (self.keep_training or overlapped) or self.dropped_window:
            self._finish_round(begun)

    def _finish_round(self, begun: RoundInFlight) -> None:
        order = begun.order
        try:
            outcome = self.averager.finish()
        except Exception as err:
            self._cut(begun, err)
            return
        if self.group.aborted:
            self._cut(begun, None)  # an aborted NCCL round returns what it had: not a consensus
            return
        if self._agreed(order) and not self.group.round_stands(True):
            # Cut for a member of its sharded group: left as that one leaves it.
            self._cut(begun, None, told=True)
            return
        evaluate = None
        # Evals and checkpoints ride on some rounds; they are not the round's own cost (idle_ms).
        epoch_work_s = 0.0
        if self._evaluates(order):
            # The consensus holds every rank's steps up to this round, and only those.
            step = self.global_steps + outcome.total_steps
            samples = step * self.stepper.step_samples
            # This rank's steps in it: not those it trained while the round was in flight (cpu backend).
            own_steps = self.stepper.steps_total - (self.steps_since_avg - begun.steps)

            def evaluate() -> None:  # on the consensus itself, before an async rank blends it
                nonlocal epoch_work_s
                started = time.perf_counter()
                group = self.group
                epoch = order.evaluate_epochs[0]
                result = self.stepper.evaluate(group.index, group.size, epoch, step, samples, own_steps)
                result = replace(result, generation=group.generation)
                # One eval of this consensus stands for every epoch it is due for.
                self.report_evals(result, order.evaluate_epochs)
                epoch_work_s += time.perf_counter() - started

        if self.dropped_window and outcome.skipped:
            raise NonFiniteError(
                f"rank {self.rank}: every rank's window had a non-finite loss (round {order.round}); "
                "there is no consensus to restart from"
            )
        exact = order.final or self.dropped_window
        self.averager.adopt(None if exact else self.easgd_alpha, evaluate, begun.overlapped)
        self.stepper.storage.check(f"round {order.round}")
        if (self.averager.resets_inner and not outcome.skipped) or self.dropped_window:
            self.stepper.parts.optimizer.state.clear()
        self.dropped_window = False
        self.global_steps += outcome.total_steps
        if order.checkpoint_epoch is not None and self.checkpointer is not None:
            started = time.perf_counter()
            self.save_part(Point(order.checkpoint_epoch, order.checkpoint_into))
            epoch_work_s += time.perf_counter() - started
        now = time.perf_counter()
        window_s = now - (self.window_started if self.window_started is not None else now)
        idle_s = max(0.0, window_s - self.window_busy_s - epoch_work_s)
        self.report(
            RoundAck(
                rank=self.rank,
                round=order.round,
                steps=outcome.steps,
                skipped=outcome.skipped,
                divergence=outcome.divergence,
                round_ms=outcome.blocked_ms,
                queued=self.queued_batches(),
                steps_during_round=self.steps_since_avg - begun.steps,
                payload_bytes=outcome.payload_bytes,
                idle_ms=idle_s * 1000,
                generation=self.group.generation,
                comm_ms=outcome.comm_ms,
            )
        )
        self.finished = begun.finished(outcome.total_steps)
        # Steps taken while the round was in flight keep their weight (and time) for the next one.
        self.steps_since_avg -= begun.steps
        self.window_busy_s -= begun.busy_s
        self.window_started = now - self.window_busy_s  # the carried steps belong to the next window
        self.round = None

    def _evaluates(self, order: AverageNow) -> bool:
        return bool(order.evaluate_epochs) and self.stepper.parts.eval_data is not None

    def _agreed(self, order: AverageNow) -> bool:
        """Its sharded group's members agree the round stands: before its eval, and every blend (async)."""
        return self._evaluates(order) or self.group_steps is not None

    def _cut(self, begun: RoundInFlight, cause: BaseException | None, told: bool = False) -> None:
        """The round's collective failed: the group raises `cause` (fault_tolerance=none) or carries out the
        change that follows, whose Regroup names who is still in (the coordinator sends the round again).
        The members it evaluates with hear of it first, unless they `told` it (RankGroup.round_stands)."""
        if not told and self._agreed(begun.order):
            self.group.round_stands(False)
        self.round = begun
        self.group.failed(f"round {begun.order.round} was cut", cause, self)

    # --- a change of the group (survive) ----------------------------------------------------------------

    def let_go(self, change: Regroup) -> None:
        """Leave a round the change cut the way the rest of the group leaves it."""
        cut = change.cut_round
        finished = self.finished
        if self.round is not None and self.round.order.round == cut:
            # Cut here before it finished: the parameters go back to before it (a cpu-backend round never
            # touched them), and its steps stay this rank's for the round's second run.
            self.averager.discard_round()
            self.round = None
        elif finished is not None and finished.cuttable and finished.order.round == cut:
            if finished.order.final or self.easgd_alpha is None:
                # Finished here, cut elsewhere. An exact round (cadence, a final one) must leave every member
                # with one state: back to before it, and run it again with the others.
                self.averager.restore_pre_round()
                self.steps_since_avg += finished.steps
                self.global_steps -= finished.total_steps
                self.window_busy_s += finished.busy_s
                self.finished = None
            else:
                # A blend round is kept (the consensus it blended in was whole; a sharded group's, as it stood
                # for each member), but what every member holds alike goes back as theirs does for its redo.
                self.averager.restore_averaging()
        if self.finished is not None:  # the change is past it: it stands
            self.finished = replace(self.finished, cuttable=False)

    def settle(self, group: AveragingGroup, change: Regroup | None) -> None:
        """The sharer's state to every member when the change says so (every original member starts from
        rank 0's; a change before the first round closed shares it again: a member's death may have cut the
        start's broadcast; a joiner, rank 0 restarted among them, receives a member's); the averager reduces
        over the new group from the next round on."""
        if change is None or change.shares_state:
            sharer = group.members[0] if change is None else change.sharer_in(group.members)
            self._share(functools.partial(group.broadcast_from, member=sharer))
            if change is not None and change.joining:
                share_with_joiners(self.stepper, group, sharer, self.rank, change.joining)
                self.stepper.schedule_to(self.schedule_position())  # a joiner's schedule, from the sharer's
        self.averager.regroup()

    def regrouped(self, change: Regroup, formed: Regrouped) -> None:
        self.report(formed)
        self.stepper.storage.check(f"averaging group {change.generation} formed")
        if change.shares_state:
            what = f"admitting {change.joining}" if change.joining else "a member's state was shared"
            digest, optimizer = self.averager.state_digest, self.optimizer_words
            # The round clock, and the rank's own steps (a sharded group's members share at one step).
            steps = f"global steps {self.global_steps}, step {self.stepper.steps_total}"
            self.group.say_state(lambda: f"{what}: {digest()}, {steps}, {optimizer()}")

    def _share(self, send: Callable[[list[torch.Tensor]], None]) -> None:
        """One member's state to every member: parameters and f32 buffers, and its LR schedule's clock
        (every rank's steps up to the last round; a restarted rank starts there)."""
        self.averager.share(send)
        self.stepper.storage.check("a member's state was shared")
        clock = torch.tensor([self.global_steps], dtype=torch.int64, device=self.stepper.device)
        send([clock])
        self.global_steps = int(clock.item())
        self.stepper.schedule_to(self.schedule_position())
