"""A local-SGD round as one rank holds it: in flight from its start to its consensus (`RoundInFlight`), then
finished (`FinishedRound`), which a member's death elsewhere can still cut until the next window opens."""

from __future__ import annotations

from dataclasses import dataclass

from flodl.links.messages import AverageNow


@dataclass
class RoundInFlight:
    """A round this rank began (its averager took the snapshot) and has not adopted yet."""

    order: AverageNow
    # This rank's steps since the last round, and their busy time, at the snapshot: what the round averages.
    # Steps trained while it is in flight (async, overlapped) count toward the next round.
    steps: int
    busy_s: float
    # Overlapped (cadence, cpu backend): the next window trains meanwhile, and the consensus keeps what the
    # rank trained since the snapshot.
    overlapped: bool
    # Overlapped, and the window sent with the round has not arrived yet: wait for it rather than for the
    # round (having nothing to train is then no reason to finish the round).
    awaiting_window: bool

    def finished(self, total_steps: int) -> FinishedRound:
        return FinishedRound(self.order, self.steps, total_steps, self.busy_s)


@dataclass(frozen=True)
class FinishedRound:
    """The last round this rank finished. Until the next window opens (`cuttable`) a member's death can still
    cut it elsewhere, and an exact round is then redone by everyone."""

    order: AverageNow
    # This rank's steps in it, every rank's, and the busy time the steps took.
    steps: int
    total_steps: int
    busy_s: float
    cuttable: bool = True

    @property
    def final_round(self) -> int | None:
        """The round's number if it was exact (a segment's or the run's last)."""
        return self.order.round if self.order.final else None
