"""Where a job's W&B run stands across the job's starts (pure but for its file): one run, its history's
`_step` going on and each epoch once, as `metrics.jsonl` has it.

A start that crashes or stops after its last checkpoint has logged epochs (and progress) that the resumed
start trains again. `metrics.jsonl` is cut back to the checkpoint and written again; a W&B history cannot be
cut back, so the resumed start leaves out what W&B already holds: an epoch's row once that epoch was logged,
an eval's row once an eval at its step was, a rank's progress rows up to the step it had logged. W&B keeps the
first start's record of such an epoch.

The cursor is written after each row is logged (`CURSOR_FILE` in the run dir; a rename, not synced). A start
killed between a row and its cursor may have sent that row: the next start's first `_step` is two past the
cursor's, so no step is used twice (that one row may then be logged twice; killed between two rows, none is).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

CURSOR_FILE = "wandb-cursor.json"


@dataclass
class Cursor:
    # The `_step` of the last row logged (-1: none yet).
    step: int = -1
    # The last epoch whose record was logged (-1: none yet).
    epoch: int = -1
    # The `train/step` of the last eval logged (an eval's row stands at the step its model was taken).
    eval: int = -1
    # Each rank's last progress step logged.
    ranks: dict[int, int] = field(default_factory=dict)

    @classmethod
    def resumed(cls, path: Path) -> Cursor:
        """The cursor an earlier start of the job left, past the row it may have sent unrecorded; a fresh one
        where there is none (or it is unreadable: W&B's `_step` then starts over)."""
        try:
            saved = json.loads(path.read_text())
            ranks = {int(rank): int(step) for rank, step in saved["ranks"].items()}
            found = cls(int(saved["step"]), int(saved["epoch"]), int(saved["eval"]), ranks)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return cls()
        found.step += 1
        return found

    def wants_epoch(self, epoch: int) -> bool:
        """The epoch's row is not in the run yet."""
        return epoch > self.epoch

    def wants_eval(self, step: int) -> bool:
        """The eval whose model was taken at `train/step` `step` is not in the run yet."""
        return step > self.eval

    def wants_progress(self, rank: int, step: int) -> bool:
        """The rank's progress row at `step` is not in the run yet."""
        return step > self.ranks.get(rank, -1)

    def next_step(self) -> int:
        """The `_step` of the row about to be logged (taken: the next is one more)."""
        self.step += 1
        return self.step

    def logged_epoch(self, epoch: int) -> None:
        self.epoch = max(self.epoch, epoch)

    def logged_eval(self, step: int) -> None:
        self.eval = max(self.eval, step)

    def logged_progress(self, rank: int, step: int) -> None:
        self.ranks[rank] = max(self.ranks.get(rank, -1), step)

    def save(self, path: Path) -> None:
        """Written whole or not at all: a new file renamed over the old."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(asdict(self)))
        os.replace(partial, path)
