"""What the survive and growth runs (tests/runs/test_survive.py, test_grow.py) read back from a run: each
epoch's record, the state fingerprints ranks log after a change, the membership changes."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

from flodl.launcher.join_card import CARD
from flodl.metrics.timeline import read_timeline
from tests.helpers.procs import PYTHON, Child, Result, child_env, finish, kill_left, start, wait_for

# The launcher a joiner runs (flodl-join), beside the Python the tests run.
JOIN = str(Path(PYTHON).parent / "flodl-join")

# A bound, not a length: a restart test stops its run (StopOnceAdmitted) once the restarted rank is in,
# however long the restarted process takes to start on a loaded machine.
EPOCHS_AT_MOST = 10_000
STOP_ONCE_ADMITTED = "callbacks=[{_target_:tests.helpers.callback_log.StopOnceAdmitted}]"


def digests(out: str, what: str) -> dict[int, str]:
    """The last state fingerprint each rank logged after `what` ('final round' or 'admitting'; an admission
    also gives the global steps, the LR schedule's clock at the last round)."""
    found = {}
    for rank, digest in re.findall(
        rf"rank (\d+): state after {what}[^:]*: ([0-9a-f]+(?:, global steps \d+)?)", out
    ):
        found[int(rank)] = digest
    return found


def epoch_records(run: Path, epochs: int | None) -> list[dict]:
    """The records, one per epoch in order (`epochs` of them; None: a run StopOnceAdmitted ended)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(len(records) if epochs is None else epochs))
    if epochs is None:
        assert len(records) < EPOCHS_AT_MOST, "the run did not stop once the rank was admitted"
    return records


def check_every_epoch_once(run: Path, epochs: int | None = None) -> list[dict]:
    records = epoch_records(run, epochs)
    per_epoch = {r["samples"] for r in records}
    assert len(per_epoch) == 1, f"every epoch trains the same samples: {per_epoch}"
    return records


def membership(run: Path) -> list[dict]:
    return read_timeline(run)["membership"]


def check_sync_epochs(run: Path, epochs: int | None = None) -> tuple[list[dict], int]:
    """Every epoch once (as check_every_epoch_once), with the optimizer steps each took (and the samples of
    a whole epoch: the last). A cut epoch trains every pick of a whole one but less than a global step: the
    steps before the cut with every member, the rest with the survivors (who report)."""
    records = epoch_records(run, epochs)
    whole = records[-1]["samples"]  # the last epoch is every member's again
    steps = [records[0]["step"]] + [b["step"] - a["step"] for a, b in itertools.pairwise(records)]
    for record, taken in zip(records, steps, strict=True):
        record["steps_taken"] = taken
    return records, whole


def rest_lines(out: str) -> list[tuple[int, int, list[int], int, int]]:
    """Each re-planned epoch: (epoch, counted from 1 as lines count; steps the members had trained, the ranks
    that share its rest, their steps each, picks dropped)."""
    found = re.findall(
        r"epoch (\d+): the members trained (\d+) steps of it; its rest goes to ranks \[([\d, ]+)\], "
        r"(\d+) steps of \d+ each \((\d+) picks",
        out,
    )
    return [(int(e), int(k), [int(r) for r in m.split(",")], int(s), int(d)) for e, k, m, s, d in found]


def finish_with_joiners(job: Child, run: Path, cwd: Path, count: int) -> tuple[Result, list[int]]:
    """`count` `flodl-join` processes for the job writing `run`, started at once (each takes a seat of its
    own) once the job wrote its join card; the job's result and the joiners' exit codes. A process that
    outlives them (a failure) has its group killed."""
    joiners: list[Child] = []
    try:
        wait_for((run / CARD).is_file, job, what="the job wrote its join card")
        joiners = [start([JOIN, str(run)], cwd, child_env()) for _ in range(count)]
        result = finish(job, 240)
        codes = [finish(j, 60).code for j in joiners]
    finally:
        kill_left([job, *joiners])
    return result, codes
