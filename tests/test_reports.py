"""Timeline and compare report, rendered from a real 3-job multirun (sync, cadence, async on 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from flodl.compare import REPORT_MD, REPORT_PNG, load_job
from flodl.metrics.plots import plot_compare, plot_timeline
from tests.helpers.procs import PYTHON, leftovers, run, train

pytestmark = pytest.mark.multiproc
POLICIES = ("sync", "cadence", "async")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    train(
        "-m",
        "policy=sync,cadence,async",
        "launch.nproc_per_node=2",
        "launch.start_method=fork",
        "epochs=3",
        "hydra.sweep.dir=sweep",
        cwd=root,
        timeout=300,
    ).check()
    assert not leftovers(root)
    return root / "sweep"


def job_of(sweep: Path, policy: str) -> Path:
    return sweep / str(POLICIES.index(policy))


def test_timeline_has_a_lane_per_rank_and_the_averaging_rounds(sweep: Path, tmp_path: Path) -> None:
    cadence = json.loads((job_of(sweep, "cadence") / "timeline.json").read_text())
    assert cadence["world_size"] == 2
    assert {span["rank"] for span in cadence["spans"]} == {0, 1}
    assert len(cadence["rounds"]) >= 3 and all(r["end"] >= r["start"] for r in cadence["rounds"])
    assert all(set(r["divergence"]) == {"0", "1"} for r in cadence["rounds"])
    assert [e["epoch"] for e in cadence["epochs"]] == [0, 1, 2]
    # Sync averages gradients inside DDP: its timeline has chunks and epochs but no rounds.
    assert json.loads((job_of(sweep, "sync") / "timeline.json").read_text())["rounds"] == []
    figure = plot_timeline(cadence, tmp_path / "t.png")
    (ax,) = figure.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.patches) >= len(cadence["rounds"])  # one shaded band per round
    image = matplotlib.image.imread(job_of(sweep, "cadence") / "timeline.png")
    assert image.shape[0] > 100 and image.shape[1] > 500


def test_compare_report_lists_every_job_and_plots_a_line_each(sweep: Path) -> None:
    out = run([PYTHON, "-m", "flodl.compare", str(sweep)], cwd=sweep).check().out
    table = (sweep / REPORT_MD).read_text()
    assert out == table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[1] for row in rows] == list(POLICIES)
    assert "eval/accuracy" in table.splitlines()[2]
    # Averaging rounds: DDP's steps for sync, coordinator rounds for the local-SGD policies.
    rounds = {row.split(" | ")[1]: int(row.split(" | ")[7]) for row in rows}
    assert rounds["sync"] == 3 * 22 and 0 < rounds["cadence"] < rounds["sync"]
    jobs = [load_job(job_of(sweep, p)) for p in POLICIES]
    figure = plot_compare(jobs, "eval/accuracy", sweep / "again.png")
    assert [len(ax.get_lines()) for ax in figure.axes] == [3, 3, 3]
    assert [ax.get_xlabel() for ax in figure.axes] == ["wall time (s)", "step", "bytes on the wire"]
    assert matplotlib.image.imread(sweep / REPORT_PNG).ndim == 3
