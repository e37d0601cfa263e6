"""The fault harness's CI lane (issue 54): a fixed seed per fault kind (a stop's drawn anew each run,
tests/helpers/drawn.py) through the trial runner bench/chaos.py runs at length (tests/helpers/chaos.py), each
a 2-rank digits job faulted at a moment its seed draws and checked against every invariant: each sample of
every epoch trained once (a dead process's window the run drops by design apart), a stop's checkpoint
holding every step trained and named by its last line, no `.partial` dir left, each epoch once in
metrics.jsonl, the members' final states equal, model.pt the last checkpoint's, a rank cut off the network
ending by itself once its link is back. About 4 minutes on 2 busy cores; `python bench/chaos.py --seed S
--trials 1 --kinds K` replays one trial by hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.chaos import run_trial
from tests.helpers.drawn import drawn_seeds
from tests.helpers.procs import leftovers

pytestmark = pytest.mark.multiproc
# The disk faults mount a tmpfs of their own for the checkpoints; a partition makes a network namespace.
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs or a network namespace needs root")


@pytest.mark.parametrize(
    ("kind", "seed"),
    [
        # A stop drawn anew each run (tests/helpers/drawn.py): its policy, signal, schedule, step and the
        # world it resumes on (seed 0 was sync, SIGTERM at rank 0's step 17, every 5 steps with
        # keep_global_batch; seed 1 async, SIGINT at step 21, every 5 steps, resumed on 1 rank).
        *(("stop", seed) for seed in drawn_seeds("chaos-stop", 1)),
        ("kill", 4),  # cadence, fault_tolerance=none, rank 1 SIGKILLed at its step 41, resume=auto
        # async, rank 0 SIGKILLed at its step 34, restarted by its supervisor: a slice the last round averaged
        # in part was handed out again whole (320 samples trained twice) until ranks reported a slice's
        # trained start at each round's snapshot.
        ("survive-kill", 4),
        ("freeze", 1),  # cadence, rank 1 SIGSTOPped at its step 4, cut, then SIGCONT
        ("host-kill", 1),  # async, survive: the launcher (the run's host) SIGKILLed, resume=auto
        pytest.param("disk-full", 0, marks=ROOT),  # sync: the checkpoints' tmpfs filled at rank 1's step 20
        pytest.param("disk-ro", 1, marks=ROOT),  # sync: remounted read-only in epoch 0, then read-write
        # async, ranks started apart beside flodl-coordinator: rank 1's link down at its step 42, back once it
        # was cut; its process, which waited on for a word that never came, must end for its restart.
        pytest.param("partition", 1, marks=ROOT),
    ],
)
def test_a_faulted_run_keeps_every_invariant(tmp_path: Path, kind: str, seed: int) -> None:
    trial = run_trial(tmp_path / "trial", kind, seed)
    assert trial.violations == [], f"{kind} seed {seed} ({trial.plan}):\n" + "\n".join(trial.violations)
    assert not leftovers(tmp_path / "trial")
