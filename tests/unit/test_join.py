"""flodl-join's line for a rank that left before the run's end: how it ended, and why as the rank recorded it
(flodl/job/failures.py), on records written here."""

from __future__ import annotations

import time
from pathlib import Path

from flodl.job import failures
from flodl.launcher.join import why_left
from flodl.launcher.rank_exit import RankExit, SupervisedRankFailure

UID = "0123abcd"


def left(seat: int, code: int | None, signal: str | None = None) -> SupervisedRankFailure:
    return SupervisedRankFailure("every rank ended", [RankExit(seat, 0, code, signal)])


def test_the_line_names_the_cause_the_rank_recorded_since_the_joiner_started(tmp_path: Path) -> None:
    failures.record(tmp_path, UID, 0, 2, ValueError("an earlier joiner's, in the same seat"))
    since = time.time()
    failures.record(tmp_path, UID, 0, 3, ValueError("task.train_data: no folder /data/blobs here"))
    assert why_left(left(3, 3), tmp_path, UID, 3, since) == (
        "exit code 3: ValueError: task.train_data: no folder /data/blobs here"
    )
    assert why_left(left(2, 3), tmp_path, UID, 2, since) == "exit code 3"  # not this joiner's rank
    assert why_left(left(4, None, "SIGKILL"), tmp_path, UID, 4, since) == "signal SIGKILL"  # none recorded
    assert why_left(left(3, 3), tmp_path, "another run", 3, since) == "exit code 3"
