"""A rank's own part of a checkpoint: written before the rank acknowledges, loaded back on resume.

The group's first member also writes the model (every member holds the same consensus at a checkpoint).
Files load with `weights_only=True`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flodl.checkpoint import MODEL_FILE, Checkpoint, CheckpointDir, Point, model_state, rank_file
from flodl.worker.rank_state import restore_stepper, stepper_state
from flodl.worker.stepper import Stepper


class RankCheckpointer:
    """A worker's side: write this rank's part of an epoch's checkpoint."""

    def __init__(self, store: CheckpointDir, rank: int, model: nn.Module, stepper: Stepper) -> None:
        self.store = store
        self.rank = rank
        self.model = model
        self.stepper = stepper

    def save(self, point: Point, worker_state: dict[str, Any], first_member: bool = True) -> None:
        """`first_member`: this rank writes the model too (every member holds the same one here: one copy is
        enough)."""
        if first_member:
            self.store.write_part(point, MODEL_FILE, model_state(self.model))
        part = {"stepper": stepper_state(self.stepper), "worker": worker_state}
        self.store.write_part(point, rank_file(self.rank), part)


def restore_rank_part(checkpoint: Checkpoint, rank: int, stepper: Stepper) -> dict[str, Any]:
    """Restore the stepper (optimizer, scheduler, RNG, counters); return the worker's own state."""
    part = checkpoint.load(rank_file(rank))
    restore_stepper(stepper, part["stepper"])
    return part["worker"]
