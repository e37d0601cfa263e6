"""The fault harness's sample invariant (tests/helpers/chaos.py) on samples written by hand: what it must call
a violation and what it must let pass, so a harness that finds none does so because the run was right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.chaos_job import (
    Job,
    Sample,
    Trial,
    check_each_sample_once,
    read_samples,
    window_of_the_dead,
)

# An epoch of 8 samples, ids 0..7: 2 ranks x 2 steps x 2 ids.
SIZE = 8


def job_of(tmp_path: Path, epochs: int = 1) -> Job:
    job = Job(tmp_path)
    job.run_dir.mkdir()
    lines = [json.dumps({"epoch": e, "samples": SIZE}) for e in range(epochs)]
    (job.run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return job


def epoch_of(start: int = 0, pids: tuple[int, int] = (10, 11), epoch: int = 0) -> list[Sample]:
    """The epoch's ids trained once: rank r's step s trains ids 4r + 2(s-1), +1."""
    return [
        Sample(start, rank, pids[rank], epoch, step, (4 * rank + 2 * (step - 1), 4 * rank + 2 * step - 1))
        for rank in (0, 1)
        for step in (1, 2)
    ]


def violated(trial: Trial) -> list[str]:
    return [v.split(":", 1)[0] for v in trial.violations]


def test_an_epoch_trained_once_passes(tmp_path: Path) -> None:
    trial = Trial("stop", 0)
    check_each_sample_once(trial, job_of(tmp_path, 2), epoch_of() + epoch_of(epoch=1), set())
    assert trial.violations == []


@pytest.mark.parametrize(
    "broken",
    [
        lambda s: [*s, Sample(1, 0, 12, 0, 3, (5,))],  # one id trained again after a resume
        lambda s: s[1:],  # a step never trained (its 2 ids)
        lambda s: [*s, Sample(0, 0, 10, 1, 3, (0,))],  # an epoch trained that has no record
    ],
    ids=["twice", "never", "unrecorded-epoch"],
)
def test_a_sample_twice_or_never_is_a_violation(tmp_path: Path, broken) -> None:
    trial = Trial("stop", 0)
    check_each_sample_once(trial, job_of(tmp_path), broken(epoch_of()), set())
    assert violated(trial) == ["each-sample-once"], trial.violations


def test_a_dead_window_trained_again_is_left_out_once_and_lost_only_under_survive(tmp_path: Path) -> None:
    job = job_of(tmp_path)
    first = epoch_of()
    dead = {s for s in first if s.rank == 1 and s.step == 2}  # rank 1's step 2, past its last checkpoint
    (step,) = dead
    again = [Sample(1, 1, 20, 0, 2, step.ids)]  # trained again by rank 1's next process
    trial = Trial("kill", 0)
    check_each_sample_once(trial, job, first + again, dead)
    assert trial.violations == [] and (trial.retrained, trial.lost) == (1, 0)
    # Not trained again: under fault_tolerance=none that is a step lost; under survive, lost with the rank.
    trial = Trial("kill", 0)
    check_each_sample_once(trial, job, first, dead)
    assert violated(trial) == ["window-of-the-dead"], trial.violations
    trial = Trial("survive-kill", 0)
    check_each_sample_once(trial, job, first, dead, may_lose=True)
    assert trial.violations == [] and (trial.retrained, trial.lost) == (0, 1)
    # Trained twice again is a violation whatever the policy.
    trial = Trial("survive-kill", 0)
    check_each_sample_once(trial, job, first + again + again, dead, may_lose=True)
    assert "window-of-the-dead" in violated(trial), trial.violations


def test_samples_read_back_as_the_hook_writes_them(tmp_path: Path) -> None:
    (tmp_path / "1-rank0-42.jsonl").write_text(json.dumps({"epoch": 2, "step": 7, "ids": [3, 1]}) + "\n")
    assert read_samples(tmp_path) == [Sample(1, 0, 42, 2, 7, (3, 1))]


def test_a_survive_window_is_the_dead_process_s_steps_past_the_rounds_before_its_cut(tmp_path: Path) -> None:
    job = job_of(tmp_path)
    events = [
        {"kind": "start", "world_size": 2},
        {"kind": "round", "round": 1, "start": 1.0, "end": 1.5, "steps": {"0": 3, "1": 3}},
        {"kind": "membership", "time": 2.0, "event": "rank_cut", "rank": 1},
        {"kind": "round", "round": 2, "start": 2.5, "end": 3.0, "steps": {"0": 4}},
    ]
    (job.run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    dead = [Sample(0, 1, 11, 0, step, (step,)) for step in range(1, 6)]
    trial = Trial("survive-kill", 0)
    assert window_of_the_dead(trial, job, dead, 1, 11) == set(dead[3:])
    assert trial.violations == []
    # Rounds that averaged more of its steps than it trained: its samples' log and the timeline disagree.
    trial = Trial("survive-kill", 0)
    window_of_the_dead(trial, job, dead[:2], 1, 11)
    assert violated(trial) == ["window-of-the-dead"], trial.violations
