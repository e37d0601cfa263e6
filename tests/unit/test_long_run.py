"""bench/long_run.py's windows and verdict: a run slowing with its length shows, one bad window does not."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from long_run import summary, window_rows  # noqa: E402


def test_each_window_holds_the_epochs_inside_it_and_the_cpu_spent_in_it() -> None:
    records = [
        {"window_start": 0.5, "window_end": 1.5, "samples": 100},
        {"window_start": 1.5, "window_end": 2.5, "samples": 100},
        {"window_start": 9.5, "window_end": 10.5, "samples": 50},  # across a window's end: in neither
        {"window_start": 12.0, "window_end": 14.0, "samples": 100},
    ]
    samples = [(0.0, 1.0, 3.0, 2**20), (10.0, 3.0, 18.0, 2**21), (20.0, 4.0, 28.0, 2**21)]
    rows = window_rows(records, samples)
    assert [r["epochs"] for r in rows] == [2, 1]
    assert [r["samples_per_s"] for r in rows] == [100.0, 50.0]
    assert [r["host_cpu"] for r in rows] == [0.2, 0.1] and [r["ranks_cpu"] for r in rows] == [1.5, 1.0]
    assert [r["host_rss_mb"] for r in rows] == [2.0, 2.0]


def row(rate: float, cpu: float, rss: float) -> dict:
    return {"samples_per_s": rate, "host_cpu": cpu, "host_rss_mb": rss}


def test_the_verdict_compares_the_last_quarter_with_the_first_by_their_medians() -> None:
    slowing = [row(100 - 4 * i, 0.2 + 0.01 * i, 500 + 2 * i) for i in range(8)]  # quarters: 2 windows
    assert summary(slowing).startswith(
        "- last quarter / first quarter (medians of their windows): samples/s **0.755**, host CPU 1.293; "
        "host RSS +14 MB"
    )
    calm = [row(100, 0.2, 500)] * 12  # quarters: 3 windows
    calm[-1] = row(60, 0.2, 500)  # one window the machine's other work slowed
    assert "samples/s **1.000**, host CPU 1.000; host RSS +0 MB" in summary(calm)


def test_a_window_without_epochs_reads_no_speed() -> None:
    rows = window_rows([], [(0.0, 0.0, 0.0, 0), (5.0, 1.0, 5.0, 0)])
    assert rows[0]["samples_per_s"] == 0.0 and rows[0]["epochs"] == 0
