"""What every policy's driver answers (`Driver`), and the run's epochs as the drivers plan them.

A driver decides what the ranks are sent: the sync driver each epoch's slices (`sync_driver.py`), the
local-SGD driver windows and rounds (`local_sgd_driver.py`). Who trains is the roster's
(`roster.py`); a driver plans for its members, admits restarted ranks at its own boundaries, and answers the
roster's changes through the hooks declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from flodl.checkpoints.disk import Point
from flodl.links.messages import ChunkReport, EvalResult, Message, Regrouped


class CoordinatorError(RuntimeError):
    pass


@dataclass(frozen=True)
class EpochSchedule:
    epochs: int
    world_size: int
    total_picks: int
    # Samples per rank per optimizer step (batch_size x grad_accum): what the plans are cut in.
    batch_size: int
    eval_every: int
    has_eval: bool

    def evaluates_after(self, epoch: int) -> bool:
        if not self.has_eval or self.eval_every == 0:
            return False
        return (epoch + 1) % self.eval_every == 0 or epoch == self.epochs - 1

    def eval_epochs(self) -> frozenset[int]:
        return frozenset(e for e in range(self.epochs) if self.evaluates_after(e))


class Driver(Protocol):
    """A policy's decisions: what to send when the run starts and as reports arrive."""

    def begin(self) -> None: ...

    def state(self) -> dict[str, Any]:
        """What a resumed driver needs (taken at a checkpoint)."""
        ...

    def on_message(self, message: Message) -> None: ...

    def on_epoch_complete(self, epoch: int) -> None: ...

    def on_chunk(self, chunk: ChunkReport) -> bool:
        """Whether the chunk counts (survive: not a cut rank's late report)."""
        ...

    def counts_eval(self, result: EvalResult) -> bool:
        """Whether the eval counts (survive: not one of a round, or a plan, that a change cut)."""
        ...

    def on_epoch_emitted(self, epoch: int) -> None: ...

    def stop(self) -> int:
        """Hand out no work past the current epoch boundary; return the last epoch any rank trains."""
        ...

    @property
    def done(self) -> bool: ...

    def tick(self) -> None:
        """Called as the coordinator waits for reports (at least every half second): what is due by time."""
        ...

    def stop_saving(self) -> None:
        """A stop that saves: end the work at the next boundary where a checkpoint can be taken."""
        ...

    @property
    def boundary(self) -> str:
        """Where a stop that saves takes its checkpoint, in words."""
        ...

    def expect_checkpoint(self, point: Point, step: int) -> None:
        """A checkpoint no plan asked for (sync: a stop's, after `step` of `point.epoch`): what the committer
        waits for and the driver's state there."""
        ...

    def on_cut(self, ranks: list[int]) -> None:
        """survive: `ranks` are out, together (a rank, or a sharded group; the roster's new generation is
        without them): hand their work to the members left and send them the Regroup."""
        ...

    def on_regrouped(self, message: Regrouped) -> None:
        """survive: a member formed the roster's newest group (`message.position`: where sync's members
        agreed they are)."""
        ...
