"""What the local-SGD planner (rounds/planner.py) hands the coordinator to carry out, and what it is told of
a rank's window."""

from __future__ import annotations

from dataclasses import dataclass

from flodl.links.messages import EpochSlice


@dataclass(frozen=True)
class Dispatch:
    rank: int
    slices: tuple[EpochSlice, ...]
    # The rank reports Reached once it has taken this many steps since the last reduce (None: rounds/supply).
    target: int | None


@dataclass(frozen=True)
class Average:
    round: int
    # Epochs whose eval is this round's consensus (one eval, reported for each: every wanted epoch gets one).
    evaluate_epochs: tuple[int, ...]
    # The last reduce of a segment (or of the run): every rank adopts the consensus exactly (no EASGD blend).
    final: bool
    # Take a checkpoint once the round is done, at (epoch, batches of it handed out: None, the epoch whole);
    # None: no checkpoint.
    checkpoint_at: tuple[int, int | None] | None = None
    # The round of the same number redone among the members left after a rank died during it.
    redo: bool = False


# What the planner hands the coordinator to carry out (a guard's advice is another thing: rounds/guard.py).
Instruction = Dispatch | Average


@dataclass(frozen=True)
class WindowReport:
    rank: int
    steps: int
    # Time spent training this window (data + compute), excluding waits for control messages.
    busy_ms: float
