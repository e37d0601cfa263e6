"""Checkpoints of survive by groups (docs/sharded-groups.md#checkpoints): 4 CPU ranks as 2 groups of 2 under
cadence or async with fault_tolerance=survive and a checkpoint every epoch, a rank SIGKILLed at a step drawn
from a seed, with or without a restart. Each checkpoint holds the sharded state of exactly the groups in at
its round, each group's own save (the groups share no process group: a process's world is its group); the
run resumed (resume=auto) on the same layout for 2 epochs more trains every sample of them once, a group
that was out at the checkpoint taking the optimizer state of a group in, and its checkpoints hold both
groups'. About 30 s a case (two runs) on 2 busy cores."""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from flodl.checkpoints.sharded import SHARDED_DIR, optimizer_key, save_of, saved_groups, saved_keys
from tests.helpers.chaos_job import Job, Trial, read_samples
from tests.helpers.runs import epochs_of
from tests.helpers.sharded_survive import (
    RANK_STEPS,
    WORLD,
    K,
    check_left_and_back_whole,
    groups_of_two,
    logs_of,
)
from tests.helpers.survive_runs import STOP_ONCE_ADMITTED

pytestmark = pytest.mark.multiproc


def groups_in(checkpoints: Path) -> dict[str, tuple[int, ...]]:
    """Each committed checkpoint's groups in (of its manifest's ranks), checked to be the groups whose own
    optimizer states its shards hold, each under its key."""
    found = {}
    for manifest in sorted(checkpoints.glob("*/manifest.json")):
        inside = tuple(sorted({r // K for r in json.loads(manifest.read_text())["ranks"]}))
        sharded = manifest.parent / SHARDED_DIR
        for group in inside:
            assert optimizer_key(group) in saved_keys(save_of(sharded, group)), (manifest.parent, group)
        assert saved_groups(sharded) == inside, (manifest.parent, inside)
        found[manifest.parent.name] = inside
    return found


@pytest.mark.parametrize(
    ("policy", "seed"), [("cadence", 0), ("cadence", 1), ("cadence", 2), ("async", 0), ("async", 1)]
)
def test_each_checkpoint_holds_the_groups_in_and_resumes_every_sample_once(
    tmp_path: Path, policy: str, seed: int
) -> None:
    rng = random.Random(f"sharded-survive-checkpoints-{policy}-{seed}")
    victim, restarts, at = rng.randrange(WORLD), rng.randint(0, 1), rng.randint(1, 2 * RANK_STEPS)
    job = Job(tmp_path)
    restart = f"launch.max_restarts={restarts}"
    groups_of_two(job, restart, "checkpoint_every=1", until_admitted=restarts > 0, policy=policy)
    proc = job.start()
    os.kill(job.at_step(proc, victim, at), signal.SIGKILL)
    trial = Trial("sharded-survive-checkpoints", seed, f"rank {victim} SIGKILLed at its step {at}")
    check_left_and_back_whole(job, trial, job.finish(proc, trial), victim, restarts)
    held = groups_in(job.run_dir / "checkpoints")
    last = held[max(held)]
    assert last == ((0, 1) if restarts else (1 - victim // K,)), (trial.plan, held)

    # Resumed on the same layout for 2 epochs more: every sample of them once, on both groups.
    first = len(epochs_of(job.run_dir))
    args = [a for a in job.args if a != STOP_ONCE_ADMITTED and not a.startswith("epochs=")]
    result = job.finish(job.start([*args, f"epochs={first + 2}", "resume=auto"]), trial)
    assert result.ok, (trial.plan, (result.out + result.err)[-3000:])
    records = epochs_of(job.run_dir)
    assert [r["epoch"] for r in records] == list(range(first + 2)), (trial.plan, records)
    trained: dict[int, Counter[int]] = defaultdict(Counter)
    for sample in read_samples(job.log_dir):
        if sample.start == 1:
            trained[sample.epoch].update(sample.ids)
    assert sorted(trained) == [first, first + 1], (trial.plan, sorted(trained))
    for epoch, ids in trained.items():
        assert set(ids.values()) == {1} and len(ids) == records[epoch]["samples"], (trial.plan, epoch)
    if last != (0, 1):  # the group out at the checkpoint took the state of the group in
        out = victim // K
        assert f"group {out} takes saved group {1 - out}'s" in logs_of(job.run_dir), trial.plan
    resumed = groups_in(job.run_dir / "checkpoints")
    assert resumed[max(resumed)] == (0, 1), (trial.plan, resumed)
