"""The run's timeline, kept by its host: what each rank trained when, rounds, anchor changes, divergence.

Times are seconds since the run started, on the host's clock (a span's end is when its report arrived).
Written as it happens to `timeline.jsonl` (one event a line; a run that resumes appends, after a `start`
line), so that a long run's coordinator holds none of it and a run that dies keeps it up to there; drawn as
`timeline.png` (one lane per rank) at the end of the run. `read_timeline` gives a run's as one record.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

TIMELINE_JSONL = "timeline.jsonl"
TIMELINE_PNG = "timeline.png"
# Rounds held in memory for their acks, newest last (one is in flight at a time; a redo keeps its number).
_ROUNDS_HELD = 2
# The drawing shows at most this many spans, rounds and epochs (the run's last ones): past it bars merge at
# any width, and matplotlib's time grows with them.
_LAST_DRAWN = 50_000
# Each kind of event, and the list of the record (read_timeline) it goes to.
_LISTS = {
    "span": "spans",
    "round": "rounds",
    "epoch": "epochs",
    "anchor": "anchors",
    "membership": "membership",
}
# The lists a long run has many of (the others hold a change each).
_LONG_LISTS = ("spans", "rounds", "epochs")


@dataclass
class Timeline:
    world_size: int
    started: float = field(default_factory=time.perf_counter)
    # The rounds not yet written: start (ordered), end (last rank acknowledged), per-rank divergence and steps
    # (the round's weights), and the epochs whose eval is the round's consensus.
    _rounds: list[dict[str, Any]] = field(default_factory=list, repr=False)
    # Lines not yet written (all of them while no file is open).
    _pending: list[str] = field(default_factory=list, repr=False)
    _file: IO[str] | None = field(default=None, repr=False)

    def start(self, run_dir: Path) -> None:
        """The run starts now: times count from here, and the events go to the run dir's timeline."""
        self.started = time.perf_counter()
        path = run_dir / TIMELINE_JSONL
        cut_short = path.is_file() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
        self._file = path.open("a", encoding="utf-8")
        if cut_short:  # the run before died mid-line: that line ends here, not in this run's first
            self._file.write("\n")
        self._write({"kind": "start", "world_size": self.world_size, "wall": time.time()})
        self.flush()

    def now(self) -> float:
        return time.perf_counter() - self.started

    def chunk(self, rank: int, epoch: int, busy_ms: float, batches: int) -> None:
        end = self.now()
        span = {"rank": rank, "epoch": epoch, "start": end - busy_ms / 1000, "end": end, "batches": batches}
        self._write({"kind": "span", **span})

    def round_started(self, number: int, evaluates: tuple[int, ...]) -> None:
        entry: dict[str, Any] = {"round": number, "start": self.now(), "end": None, "divergence": {}}
        self._rounds.append({**entry, "steps": {}, "evaluates": list(evaluates)})
        while len(self._rounds) > _ROUNDS_HELD:
            self._write({"kind": "round", **self._rounds.pop(0)})

    def round_acked(self, number: int, rank: int, divergence: float, steps: int) -> None:
        entry = self._round(number)
        entry["divergence"][str(rank)] = divergence
        entry["steps"][str(rank)] = steps
        entry["end"] = self.now()

    def round_redone(self, number: int) -> None:
        """A membership change cut the round: its acks so far are void, the members run it again."""
        entry = self._round(number)
        entry["divergence"], entry["steps"], entry["redone"] = {}, {}, True

    def membership_changed(self, event: dict[str, Any]) -> None:
        self._write({"kind": "membership", "time": self.now(), **event})
        self.flush()

    def anchor_changed(self, old: int, new: int, reason: str) -> None:
        self._write({"kind": "anchor", "time": self.now(), "from": old, "to": new, "reason": reason})

    def epoch_done(self, epoch: int) -> None:
        self._write({"kind": "epoch", "epoch": epoch, "time": self.now()})
        self.flush()

    def flush(self) -> None:
        if self._file is not None and self._pending:
            self._file.write("".join(self._pending))
            self._file.flush()
            self._pending.clear()

    def close(self, run_dir: Path, plot: bool = True) -> None:
        """Write what is held, and draw timeline.png unless `plot` is false (drawing takes seconds a stop has
        not)."""
        for entry in self._rounds:
            self._write({"kind": "round", **entry})
        self._rounds.clear()
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if not plot:
            return
        from flodl.metrics.plots import plot_timeline

        plot_timeline(read_timeline(run_dir, last=_LAST_DRAWN), run_dir / TIMELINE_PNG)

    def _round(self, number: int) -> dict[str, Any]:
        return next(r for r in reversed(self._rounds) if r["round"] == number)

    def _write(self, event: dict[str, Any]) -> None:
        self._pending.append(json.dumps(event) + "\n")


def read_timeline(run_dir: Path, last: int | None = None) -> dict[str, Any]:
    """The timeline of the run dir's last start (a resumed run's own, as its times count from it): its
    world size and, each in order, its spans, rounds, epochs, anchor changes and membership changes. `last`:
    only the last that many spans, rounds and epochs (a long run's whole would take the memory the timeline
    is written to spare), and `totals`, how many of each the run had."""
    record: dict[str, Any] = {}
    totals: dict[str, int] = {}
    for event in _events(run_dir / TIMELINE_JSONL):
        kind = event.pop("kind")
        if kind == "start":
            record = {"world_size": event["world_size"], "anchors": [], "membership": []}
            record.update({key: deque(maxlen=last) for key in _LONG_LISTS})
            totals = dict.fromkeys(_LONG_LISTS, 0)
        else:
            key = _LISTS[kind]
            record[key].append(event)
            if key in totals:
                totals[key] += 1
    if not record:
        raise FileNotFoundError(f"{run_dir / TIMELINE_JSONL}: no timeline (the run did not start)")
    record.update({key: list(record[key]) for key in _LONG_LISTS})
    if last is not None:
        record["totals"] = totals
    return record


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1)


def _events(path: Path) -> Iterator[dict[str, Any]]:
    """The file's events, but for a line a kill cut short (the last, or the last before a resumed run's)."""
    with path.open(encoding="utf-8") as lines:
        broken: int | None = None
        for number, line in enumerate(lines, 1):
            if broken is not None and not line.startswith('{"kind": "start"'):
                raise ValueError(f"{path}, line {broken}: not an event of flodl's timeline")
            broken = None
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                broken = number
