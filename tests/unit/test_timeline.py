"""The run's timeline: written as it happens, read back as one record, drawn within bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.metrics.plots import plot_timeline
from flodl.metrics.timeline import TIMELINE_JSONL, Timeline, read_timeline


def two_ranks_trained(run_dir: Path, rounds: int, busy_ms: float) -> Timeline:
    """A 2-rank timeline started in `run_dir`: round n trains epoch n - 1 on both ranks (3 steps each) and
    evaluates it."""
    timeline = Timeline(2)
    timeline.start(run_dir)
    for number in range(1, rounds + 1):
        timeline.round_started(number, (number - 1,))
        for rank in range(2):
            timeline.chunk(rank, number - 1, busy_ms=busy_ms, batches=3)
            timeline.round_acked(number, rank, divergence=0.1 * rank, steps=3)
        timeline.epoch_done(number - 1)
    return timeline


def test_events_reach_the_file_as_the_run_goes_and_only_the_last_rounds_wait_for_their_acks(
    tmp_path: Path,
) -> None:
    timeline = two_ranks_trained(tmp_path, rounds=5, busy_ms=5.0)
    # Before the run ends (a run killed here keeps it): every span and epoch, and the rounds before the two
    # still held for late acks or a redo.
    record = read_timeline(tmp_path)
    assert [(s["rank"], s["epoch"]) for s in record["spans"]] == [(r, e) for e in range(5) for r in range(2)]
    assert [e["epoch"] for e in record["epochs"]] == list(range(5))
    assert [r["round"] for r in record["rounds"]] == [1, 2, 3]
    assert record["rounds"][0]["steps"] == {"0": 3, "1": 3} and record["rounds"][2]["evaluates"] == [2]
    timeline.round_redone(5)
    timeline.close(tmp_path, plot=False)
    rounds = read_timeline(tmp_path)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
    assert rounds[-1]["redone"] and rounds[-1]["steps"] == {} and "redone" not in rounds[-2]


def test_a_resumed_run_appends_its_own_and_a_line_cut_short_by_a_kill_is_not_read(tmp_path: Path) -> None:
    first = Timeline(2)
    first.start(tmp_path)
    first.chunk(0, 0, busy_ms=1.0, batches=1)
    first.membership_changed({"event": "rank_cut", "rank": 1})
    first.close(tmp_path, plot=False)
    with (tmp_path / TIMELINE_JSONL).open("a") as file:
        file.write('{"kind": "span", "rank": 0, "epo')  # the process died mid-line
    resumed = Timeline(3)
    resumed.start(tmp_path)
    resumed.chunk(2, 4, busy_ms=1.0, batches=1)
    resumed.close(tmp_path, plot=False)
    record = read_timeline(tmp_path)
    assert record["world_size"] == 3 and [s["rank"] for s in record["spans"]] == [2]
    assert record["membership"] == []
    assert len((tmp_path / TIMELINE_JSONL).read_text().splitlines()) == 6  # the first run's lines stay


def test_a_long_run_is_read_by_its_last_events_and_drawn_from_there_one_collection_a_lane(
    tmp_path: Path,
) -> None:
    timeline = two_ranks_trained(tmp_path, rounds=300, busy_ms=0.0)
    timeline.anchor_changed(0, 1, "grow")
    timeline.close(tmp_path, plot=False)
    whole = read_timeline(tmp_path)
    record = read_timeline(tmp_path, last=100)
    assert record["totals"] == {"spans": 600, "rounds": 300, "epochs": 300}
    for key in ("spans", "rounds", "epochs"):
        assert record[key] == whole[key][-100:]
    assert record["anchors"] == whole["anchors"] and "totals" not in whole
    figure = plot_timeline(record, tmp_path / "t.png")
    (ax,) = figure.axes
    *lanes, rounds, epochs = ax.collections
    assert [len(lane.get_paths()) for lane in lanes] == [50, 50]
    drawn_from = record["spans"][0]["start"]
    # Those of the drawn spans' time: about the last 50 of the 100 read.
    assert len(rounds.get_paths()) == sum(r["end"] >= drawn_from for r in record["rounds"]) < 100
    assert len(epochs.get_segments()) == sum(e["time"] >= drawn_from for e in record["epochs"]) < 100
    assert ax.get_title().startswith("timeline — 300 averaging rounds")
    assert f"from {drawn_from:.0f} s (its last 100 chunks)" in ax.get_title()
    assert (tmp_path / "t.png").stat().st_size > 0


def test_a_line_that_is_no_event_inside_a_run_is_an_error_naming_the_file_and_line(tmp_path: Path) -> None:
    timeline = Timeline(1)
    timeline.start(tmp_path)
    timeline.close(tmp_path, plot=False)
    with (tmp_path / TIMELINE_JSONL).open("a") as file:
        file.write('not json\n{"kind": "epoch", "epoch": 0, "time": 1.0}\n')
    with pytest.raises(ValueError, match=rf"{TIMELINE_JSONL}, line 2: not an event of flodl's timeline"):
        read_timeline(tmp_path)
