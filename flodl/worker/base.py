"""The message loop every worker shares: one worker per rank obeys the coordinator until Shutdown.

The step loop never reads a value back from the device: losses accumulate on the device and are
read once per window or epoch, when the rank reports.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flodl.averaging.flat import state_digest
from flodl.checkpoints.disk import Point, atomic_save, evaluated_model_path, model_state
from flodl.counting import shown_epoch
from flodl.links.membership import AveragingGroup
from flodl.links.messages import (
    ChunkReport,
    EvalResult,
    Message,
    ModelSaved,
    Progress,
    Regroup,
    Regrouped,
    Saved,
    SaveModel,
    Shutdown,
)
from flodl.links.transport import COORDINATOR, INBOX_WAIT_S, InboxReader, Mailbox
from flodl.sharding.fsdp import gathered_state, is_sharded
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.group import FixedGroup, RankGroup
from flodl.worker.nonfinite import NonFiniteError, nonfinite_message
from flodl.worker.sharded_state import ShardedState
from flodl.worker.stepper import Stepper

log = logging.getLogger("flodl")


@dataclass(frozen=True)
class RankLink:
    """Who a worker is and how it talks to the coordinator."""

    rank: int
    world_size: int
    reader: InboxReader
    outbox: Mailbox


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker reads of the run's config (mapped once, by flodl/job/assembly.py)."""

    # logger.log_every: live loss and speed every this many steps (0: per chunk only).
    log_every: int
    # error (stop, naming rank and step) or skip (drop the rank's window; local SGD only).
    on_nonfinite: str
    # Rank 0 with a callback that keeps evaluated models (BestModel): the run dir they go to (else None).
    evaluated_models: Path | None = None


class WorkerBase:
    """The message loop every worker shares: obey the coordinator until Shutdown."""

    # Whether every rank holds the same optimizer state (sync), so a rank without a part of its own in a
    # checkpoint resumes with a member's.
    shares_optimizer = False

    def __init__(
        self,
        stepper: Stepper,
        link: RankLink,
        settings: WorkerSettings,
        checkpointer: RankCheckpointer | None = None,
        group: RankGroup | None = None,
    ) -> None:
        """`group`: who this rank trains and averages with (the assembly's choice; None: the link's world)."""
        self.stepper = stepper
        self.on_nonfinite = settings.on_nonfinite
        # Writes this rank's checkpoint parts (None: checkpoints are off).
        self.checkpointer = checkpointer
        # What it reads of a checkpoint of sharded groups (any rank may resume one), given by the assembly.
        self.sharded_state: ShardedState | None = None
        # A stop that saves was asked of this rank (set from the stop watch's thread; its parts say so); under
        # sync, set as the rank writes the agreed step's part, the stop's own.
        self.stop_asked = False
        self.rank = link.rank
        self.world_size = link.world_size
        self.reader = link.reader
        self.outbox = link.outbox
        if checkpointer is not None:  # a part written in the background: its Saved goes out at once
            checkpointer.on_written = self.reader.wake
        self.log_every = settings.log_every
        self.evaluated_models = settings.evaluated_models
        self.group: RankGroup = group if group is not None else FixedGroup(link.rank, link.world_size)
        # The last epoch this rank trained any batch of.
        self.last_epoch: int | None = None
        self._recent_loss: torch.Tensor | None = None
        self._recent_steps = 0
        self._recent_since = time.perf_counter()
        # Chunks reported per epoch (a checkpoint part says how many came before it).
        self._chunks: dict[int, int] = {}
        # The signal of a stop that saved (the coordinator's Shutdown says it): the rank exits 128 + it.
        self.stopped_by: int | None = None

    def run(self, alive: Callable[[], None]) -> None:
        """`alive` raises when this rank must stop waiting (rank 0: the coordinator failed)."""
        self.reader.start()
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait_ready()
            self.group.start(self, self.stepper.fault.before_start)
            while True:
                self.report_written()
                message = self.reader.next_message(None if self.has_work() else INBOX_WAIT_S)
                if isinstance(message, Shutdown):
                    self.stopped_by = message.signum
                    if message.signum is not None:  # a stop that saved: the checkpoint holds this step
                        steps = self.stepper.steps_total
                        log.info("rank %d stops after global step %d: %s", self.rank, steps, message.reason)
                    elif message.reason != "done":
                        log.info("rank %d stops %s: %s", self.rank, self._trained_so_far(), message.reason)
                    self.on_done()
                    return
                if isinstance(message, SaveModel):
                    self._save_model(Path(message.path))
                elif isinstance(message, Regroup):
                    self.group.change(message, self)
                elif message is not None:
                    self.handle(message)
                elif self.has_work():
                    self.work()
                else:
                    alive()
        finally:
            if self.checkpointer is not None:  # a part in flight is finished (the coordinator may not wait)
                self.checkpointer.close()
                self._say_last_written()
            self.reader.stop(self.outbox)
            self.release()

    def _say_last_written(self) -> None:
        """As the rank ends, however it ends: Saved for the parts written since the last look, so that a
        checkpoint taken before a failure (a NaN a few steps later) is committed rather than lost. The
        error that ended the rank stays the one raised."""
        try:
            self.report_written()
        except Exception as err:
            log.warning("rank %d: its last checkpoint part was not written: %s", self.rank, err)

    def _trained_so_far(self) -> str:
        if self.last_epoch is None:
            return "before its first epoch"
        return f"after epoch {shown_epoch(self.last_epoch)}"

    def on_done(self) -> None:
        """The coordinator ended the run (its last epoch trained, or stopped early)."""

    def release(self) -> None:
        """Free what this worker holds on the device for the process group (it is destroyed next)."""

    def optimizer_words(self) -> str:
        """The optimizer's state fingerprinted, and its learning rate (a joiner's equal its sharer's); a
        sharded model's, this rank's shard of it (the local part of each DTensor)."""
        optimizer = self.stepper.parts.optimizer
        moments = [
            getattr(t, "to_local", lambda t=t: t)().reshape(-1)
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]
        return f"optimizer {state_digest(moments)}, lr {self.stepper.lr:.9g}"

    def report(self, message: Message) -> None:
        if isinstance(message, ChunkReport):
            self.last_epoch = max(message.epoch, self.last_epoch if self.last_epoch is not None else -1)
            self._chunks[message.epoch] = self._chunks.get(message.epoch, 0) + 1
        self.outbox.send(COORDINATOR, message)

    def save_part(self, point: Point, step: int | None = None) -> None:
        """This rank's part of the checkpoint at `point` (`step`: sync's step of the epoch, for a part no plan
        asked for); its Saved goes out once it is on disk."""
        assert self.checkpointer is not None
        chunks = self._chunks.get(point.epoch, 0)
        receipt = Saved(self.rank, point.epoch, point.into, step, chunks, self.stop_asked)
        self.checkpointer.save(point, self.state(), receipt, self.is_first_member)
        self.report_written()

    def report_written(self) -> None:
        """Say Saved for each part written in the background since the last look."""
        if self.checkpointer is not None:
            for receipt in self.checkpointer.written():
                self.report(receipt)

    def _save_model(self, path: Path) -> None:
        """The run's end: every member holds the final model; the coordinator asked this one to write it (a
        sharded model: asked every member, which gather it together for the first to write)."""
        state = self._whole_model()
        if is_sharded(self.stepper.parts.model) and not self.is_first_member:
            return
        atomic_save(state, path)
        log.info("rank %d: the final model is %s", self.rank, path)
        self.report(ModelSaved(self.rank))

    def _whole_model(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers as CPU tensors; a sharded model's gathered once, on the group's
        first member (the others get nothing: every member calls this together)."""
        model = self.stepper.parts.model
        return gathered_state(model) if is_sharded(model) else model_state(model)

    def report_evals(self, result: EvalResult, epochs: list[int]) -> None:
        """Report this rank's eval `result` for each epoch it stands for; the group's first member first
        writes the parameters it evaluated when a callback keeps them (they are the consensus: every member
        evaluated the same)."""
        writes = self.is_first_member
        if self.evaluated_models is not None and (writes or is_sharded(self.stepper.parts.model)):
            state = self._whole_model()  # a sharded model: gathered by every member
            if writes:
                first = evaluated_model_path(self.evaluated_models, epochs[0])
                first.parent.mkdir(exist_ok=True)
                atomic_save(state, first)
                for epoch in epochs[1:]:
                    shutil.copyfile(first, evaluated_model_path(self.evaluated_models, epoch))
        for epoch in epochs:
            self.report(replace(result, epoch=epoch))

    def observe(self, loss: torch.Tensor, epoch: int) -> None:
        """After each step: every `logger.log_every` steps, report the recent loss and speed (the only
        read-back from the device between chunk reports)."""
        if not self.log_every:
            return
        self._recent_loss = loss if self._recent_loss is None else self._recent_loss + loss
        self._recent_steps += 1
        if self._recent_steps < self.log_every:
            return
        now = time.perf_counter()
        stepper = self.stepper
        samples = self._recent_steps * stepper.step_samples
        recent_loss = float(self._recent_loss) / self._recent_steps
        if not math.isfinite(recent_loss):
            self.on_nonfinite_progress()
        self.report(
            Progress(
                rank=self.rank,
                epoch=epoch,
                step=stepper.steps_total,
                loss=recent_loss,
                samples_per_s=samples / max(now - self._recent_since, 1e-9),
                lr=stepper.lr,
            )
        )
        self._recent_loss, self._recent_steps, self._recent_since = None, 0, now

    def has_work(self) -> bool:
        """Whether there is training to do without waiting for a message."""
        return False

    def first_nonfinite_step(self) -> int | None:
        """The first step with a non-finite loss since the last check (one read of the device)."""
        return self.stepper.nonfinite.take()

    def raise_if_nonfinite(self) -> None:
        step = self.first_nonfinite_step()
        if step is not None:
            raise NonFiniteError(nonfinite_message(self.rank, step, self.on_nonfinite), step)

    def on_nonfinite_progress(self) -> None:
        """A live loss report read a non-finite value: stop now, rather than at the window's end."""
        self.raise_if_nonfinite()

    @property
    def is_first_member(self) -> bool:
        """The group's first member (rank 0 unless survive cut it): it writes what one copy of the members'
        shared state is enough for (a checkpoint's model, an evaluated model)."""
        return self.group.index == 0

    def on_stop_request(self, agree: Callable[[int], int]) -> bool:
        """A stop that saves was asked for (called from the stop watch's thread): the coordinator ends the
        work at the next boundary (local SGD's round). False: this rank cannot get there."""
        self.stop_asked = True
        return True

    def on_checkpoint_request(self, agree: Callable[[int], int]) -> None:
        """A checkpoint by time that sync's members agree on (called from the stop watch's thread); local SGD
        takes its own at a round boundary."""

    def state(self) -> dict[str, Any]:
        """This worker's own state for a checkpoint (beyond the stepper's)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` as saved in a checkpoint."""

    def shared_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Of another rank's `state()`, what this rank takes when it has no part of its own."""
        return state

    def work(self) -> None:
        """One unit of training between message checks."""

    def handle(self, message: Message) -> None:
        raise NotImplementedError

    # --- a change of the group (survive; see flodl/worker/group.py) ---------------------------------------

    def let_go(self, change: Regroup) -> None:
        """Before the group `change` names is formed: leave what the change cut."""
        raise NotImplementedError

    def settle(self, group: AveragingGroup, change: Regroup | None) -> None:
        """On a newly formed group (None: the first): make the members' state agree."""
        raise NotImplementedError

    def regrouped(self, change: Regroup, formed: Regrouped) -> None:
        """The group `change` names is formed and settled."""
        raise NotImplementedError
