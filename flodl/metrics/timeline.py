"""The run's timeline on rank 0: what each rank trained when, averaging rounds, anchor changes, divergence.

Times are seconds since the run started, on rank 0's clock (a span's end is when its report arrived).
Written as `timeline.json` and drawn as `timeline.png` (one lane per rank) at the end of the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TIMELINE_JSON = "timeline.json"
TIMELINE_PNG = "timeline.png"


@dataclass
class Timeline:
    world_size: int
    started: float = field(default_factory=time.perf_counter)
    # Per rank: [start, end, epoch] of each trained chunk.
    spans: list[dict[str, Any]] = field(default_factory=list)
    # Averaging rounds: start (ordered), end (last rank acknowledged), per-rank divergence and steps (the
    # round's weights), and the epochs whose eval is the round's consensus.
    rounds: list[dict[str, Any]] = field(default_factory=list)
    anchors: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    # fault_tolerance=survive: each rank cut out or admitted, with how long each step of the change took.
    membership: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.started

    def chunk(self, rank: int, epoch: int, busy_ms: float, batches: int) -> None:
        end = self.now()
        self.spans.append(
            {"rank": rank, "epoch": epoch, "start": end - busy_ms / 1000, "end": end, "batches": batches}
        )

    def round_started(self, number: int, evaluates: tuple[int, ...]) -> None:
        self.rounds.append(
            {
                "round": number,
                "start": self.now(),
                "end": None,
                "divergence": {},
                "steps": {},
                "evaluates": list(evaluates),
            }
        )

    def round_acked(self, number: int, rank: int, divergence: float, steps: int) -> None:
        entry = next(r for r in reversed(self.rounds) if r["round"] == number)
        entry["divergence"][str(rank)] = divergence
        entry["steps"][str(rank)] = steps
        entry["end"] = self.now()

    def round_redone(self, number: int) -> None:
        """A membership change cut the round: its acks so far are void, the members run it again."""
        entry = next(r for r in reversed(self.rounds) if r["round"] == number)
        entry["divergence"], entry["steps"], entry["redone"] = {}, {}, True

    def membership_changed(self, event: dict[str, Any]) -> None:
        self.membership.append({"time": self.now(), **event})

    def anchor_changed(self, old: int, new: int, reason: str) -> None:
        self.anchors.append({"time": self.now(), "from": old, "to": new, "reason": reason})

    def epoch_done(self, epoch: int) -> None:
        self.epochs.append({"epoch": epoch, "time": self.now()})

    def save(self, run_dir: Path, plot: bool = True) -> None:
        """timeline.json, and timeline.png unless `plot` is false (drawing takes seconds a stop has not)."""
        record = asdict(self)
        record.pop("started")
        (run_dir / TIMELINE_JSON).write_text(json.dumps(record, indent=1))
        if not plot:
            return
        from flodl.metrics.plots import plot_timeline

        plot_timeline(record, run_dir / TIMELINE_PNG)
