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

from flodl.checkpoint import evaluated_model_path, save_model
from flodl.counting import shown_epoch
from flodl.wire.messages import ChunkReport, EvalResult, Message, ModelSaved, Progress, SaveModel, Shutdown
from flodl.wire.transport import COORDINATOR, InboxReader, Mailbox
from flodl.worker.checkpoint_part import RankCheckpointer
from flodl.worker.nonfinite import NonFiniteError, nonfinite_message
from flodl.worker.stepper import Stepper
from flodl.worker.survival import Survival

_WAIT_S = 0.5
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
    """What a worker reads of the run's config (mapped once, by flodl/assembly.py)."""

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
    ) -> None:
        self.stepper = stepper
        self.on_nonfinite = settings.on_nonfinite
        # Writes this rank's checkpoint parts (None: checkpoint_every is off).
        self.checkpointer = checkpointer
        self.rank = link.rank
        self.world_size = link.world_size
        self.reader = link.reader
        self.outbox = link.outbox
        self.log_every = settings.log_every
        self.evaluated_models = settings.evaluated_models
        # fault_tolerance=survive: the averaging group and the waits around it (None: a death ends the run).
        self.survival: Survival | None = None
        # The last epoch this rank trained any batch of.
        self.last_epoch: int | None = None
        self._recent_loss: torch.Tensor | None = None
        self._recent_steps = 0
        self._recent_since = time.perf_counter()

    def run(self, alive: Callable[[], None]) -> None:
        """`alive` raises when this rank must stop waiting (rank 0: the coordinator failed)."""
        self.reader.start()
        try:
            self.on_start()
            while True:
                message = self.reader.next_message(None if self.has_work() else _WAIT_S)
                if isinstance(message, Shutdown):
                    if message.reason != "done":
                        log.info("rank %d stops %s: %s", self.rank, self._trained_so_far(), message.reason)
                    self.on_done()
                    return
                if isinstance(message, SaveModel):
                    self._save_model(Path(message.path))
                elif message is not None:
                    self.handle(message)
                elif self.has_work():
                    self.work()
                else:
                    alive()
        finally:
            self.reader.stop(self.outbox)
            self.release()

    def _trained_so_far(self) -> str:
        if self.last_epoch is None:
            return "before its first epoch"
        return f"after epoch {shown_epoch(self.last_epoch)}"

    def on_start(self) -> None:
        """Before the first message is handled (the inbox is being read)."""

    def on_done(self) -> None:
        """The coordinator ended the run (its last epoch trained, or stopped early)."""

    def release(self) -> None:
        """Free what this worker holds on the device for the process group (it is destroyed next)."""

    def report(self, message: Message) -> None:
        if isinstance(message, ChunkReport):
            self.last_epoch = max(message.epoch, self.last_epoch if self.last_epoch is not None else -1)
        self.outbox.send(COORDINATOR, message)

    def _save_model(self, path: Path) -> None:
        """The run's end: every member holds the final model; the coordinator asked this one to write it."""
        save_model(self.stepper.parts.model, path)
        log.info("rank %d: the final model is %s", self.rank, path)
        self.report(ModelSaved(self.rank))

    def report_evals(self, result: EvalResult, epochs: list[int]) -> None:
        """Report this rank's eval `result` for each epoch it stands for; the group's first member first
        writes the parameters it evaluated when a callback keeps them (they are the consensus: every member
        evaluated the same)."""
        if self.evaluated_models is not None and self.is_first_member:
            first = evaluated_model_path(self.evaluated_models, epochs[0])
            first.parent.mkdir(exist_ok=True)
            save_model(self.stepper.parts.model, first)
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

    def _generation(self) -> int:
        """The averaging group's generation (survive; 0 otherwise): what reports of this group carry."""
        return self.survival.membership.generation if self.survival is not None else 0

    @property
    def group_size(self) -> int:
        """The ranks training together now: the members of the group (survive), else the world."""
        return self.survival.membership.size if self.survival is not None else self.world_size

    @property
    def is_first_member(self) -> bool:
        """The group's first member (rank 0 unless survive cut it): it writes what one copy of the members'
        shared state is enough for (a checkpoint's model, an evaluated model)."""
        return self._eval_shard()[0] == 0

    def _eval_shard(self) -> tuple[int, int]:
        """Which share of the eval set this rank evaluates, of how many: one per member of the group."""
        index = self.survival.membership.index if self.survival is not None else self.rank
        return index, self.group_size

    def state(self) -> dict[str, Any]:
        """This worker's own state for a checkpoint (beyond the stepper's)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` as saved in a checkpoint."""

    def work(self) -> None:
        """One unit of training between message checks."""

    def handle(self, message: Message) -> None:
        raise NotImplementedError
