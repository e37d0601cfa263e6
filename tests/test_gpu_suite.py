"""bench/gpu_suite.py: each arm's result from its runs (pure), and its refusal of a bad --repeat."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_suite import Measured, combine  # noqa: E402


def runs(*throughputs: float) -> list[Measured]:
    return [Measured(t, rounds_per_epoch=i) for i, t in enumerate(throughputs)]


def test_repeated_arms_count_their_median_run_and_keep_every_run():
    chosen = combine(runs(90.0, 120.0, 100.0), baseline=False)
    assert chosen.samples_per_s == 100.0
    assert chosen.rounds_per_epoch == 2  # the median run itself, with its own details
    assert chosen.runs == (90.0, 120.0, 100.0)


def test_the_baseline_run_first_and_last_counts_the_faster():
    assert combine(runs(80.0, 95.0), baseline=True).samples_per_s == 95.0


def test_a_repeated_baseline_counts_its_upper_median():
    # Measured once per pass and once at the end: four runs, the upper of the two middle ones counts.
    assert combine(runs(80.0, 95.0, 90.0, 70.0), baseline=True).samples_per_s == 90.0


def test_a_single_run_is_the_result_without_a_range():
    chosen = combine(runs(42.0), baseline=False)
    assert chosen.samples_per_s == 42.0 and chosen.runs == ()


@pytest.mark.multiproc
def test_fewer_than_one_pass_is_refused_naming_the_flag():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--repeat", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--repeat: 0 passes; give 1 or more" in done.stderr
