"""Timeline, compare report and callbacks, from a real 6-job multirun: sync, cadence and async on 2 ranks,
seeds 0 and 1, each job with a recording callback, BestModel and an EarlyStopping that ends it early."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib.image
import pytest
import torch

from flodl.metrics.compare import REPORT_MD, REPORT_PNG
from flodl.metrics.plots import plot_compare, plot_timeline
from flodl.metrics.run_clock import RUN_FILE, SWEEP_FILE
from flodl.metrics.sweep import group_jobs, load_job
from flodl.metrics.timeline import read_timeline
from flodl.tasks.classification import classification_sums
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.callback_log import HOOKS_FILE
from tests.helpers.procs import FAST_START, PYTHON, leftovers, run, train

pytestmark = pytest.mark.multiproc
POLICIES = ("sync", "cadence", "async")
SEEDS = (0, 1)
# Async windows cross epochs: its stop may land a few epochs after the ask, still before the last.
EPOCHS = 6
# EarlyStopping cannot see a gain of a whole point of accuracy after epoch 0: epoch 1 asks to stop.
CALLBACKS = (
    "callbacks=[{_target_:tests.helpers.callback_log.Recorder},"
    "{_target_:flodl.callbacks.BestModel,monitor:eval/accuracy,mode:max},"
    "{_target_:flodl.callbacks.EarlyStopping,monitor:eval/accuracy,mode:max,patience:1,min_delta:1.0}]"
)
CHECKPOINTED = (1, 3, 5)  # checkpoint_every=2: the stop drops those after its epoch


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    train(
        "-m",
        "policy=sync,cadence,async",
        "seed=0,1",
        "launch.nproc_per_node=2",
        FAST_START,
        f"epochs={EPOCHS}",
        "checkpoint_every=2",
        CALLBACKS,
        "hydra.sweep.dir=sweep",
        cwd=root,
        timeout=900,
    ).check()
    assert not leftovers(root)
    return root / "sweep"


def job_of(sweep: Path, policy: str, seed: int = 0) -> Path:
    return sweep / str(POLICIES.index(policy) * len(SEEDS) + seed)


def all_jobs(sweep: Path) -> list[Path]:
    return [job_of(sweep, p, s) for p in POLICIES for s in SEEDS]


def records_of(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


def accuracy_of(state_file: Path) -> float:
    model = DigitsMLP()
    model.load_state_dict(torch.load(state_file, weights_only=True))
    data = digits_dataset("test")
    with torch.no_grad():
        sums = classification_sums(model.eval(), data.get_batch(torch.arange(len(data))))
    return float(sums["accuracy"]) / len(data)


def test_timeline_has_a_lane_per_rank_and_the_averaging_rounds(sweep: Path, tmp_path: Path) -> None:
    cadence = read_timeline(job_of(sweep, "cadence"))
    assert cadence["world_size"] == 2
    assert {span["rank"] for span in cadence["spans"]} == {0, 1}
    assert len(cadence["rounds"]) >= 3 and all(r["end"] >= r["start"] for r in cadence["rounds"])
    assert all(set(r["divergence"]) == {"0", "1"} for r in cadence["rounds"])
    trained = [r["epoch"] for r in records_of(job_of(sweep, "cadence"))]
    assert [e["epoch"] for e in cadence["epochs"]] == trained
    # Sync averages gradients inside DDP: its timeline has chunks and epochs but no rounds.
    assert read_timeline(job_of(sweep, "sync"))["rounds"] == []
    figure = plot_timeline(cadence, tmp_path / "t.png")
    (ax,) = figure.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    *lanes, rounds, _ = ax.collections
    assert len(lanes) == 2 and len(rounds.get_paths()) == len(cadence["rounds"])  # a shaded band a round
    image = matplotlib.image.imread(job_of(sweep, "cadence") / "timeline.png")
    assert image.shape[0] > 100 and image.shape[1] > 500


def test_compare_report_groups_by_policy_and_folds_the_seeds(sweep: Path) -> None:
    out = run([PYTHON, "-m", "flodl.metrics.compare", str(sweep)], cwd=sweep).check().out
    table = (sweep / REPORT_MD).read_text()
    assert out == table
    assert "by the keys that vary: policy (seed folded in)" in table
    header = next(line for line in table.splitlines() if line.startswith("| group |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in table.split("## Jobs")[0].splitlines() if line.startswith("| policy=")]
    cells = [dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True)) for row in rows]
    # One row per policy, the constant overrides (ranks, epochs, callbacks...) nowhere in the label.
    assert [c["group"] for c in cells] == [f"policy={p}" for p in POLICIES]
    assert all(c["seeds"] == "2" for c in cells)
    for policy, row in zip(POLICIES, cells, strict=True):
        finals = [
            [r for r in records_of(job_of(sweep, policy, s)) if "eval/accuracy" in r][-1] for s in SEEDS
        ]
        accuracy = [f["eval/accuracy"] for f in finals]
        assert row["eval/accuracy"] == f"{statistics.fmean(accuracy):.4f} ± {statistics.stdev(accuracy):.4f}"
        rounds = [sum(r["rounds"] for r in records_of(job_of(sweep, policy, s))) for s in SEEDS]
        assert row["rounds"] == f"{statistics.fmean(rounds):.0f} ± {statistics.stdev(rounds):.0f}"
        walls = []
        for seed in SEEDS:
            job = job_of(sweep, policy, seed)
            times = json.loads((job / RUN_FILE).read_text())
            wall = times["exited_at"] - times["launched_at"]
            # The job's real wall time holds its start-up and every epoch.
            assert times["launched_at"] < times["training_started_at"] < times["training_ended_at"]
            assert wall >= sum(r["epoch_s"] for r in records_of(job)) + (
                times["training_started_at"] - times["launched_at"]
            )
            walls.append(wall)
        assert row["wall s"] == f"{statistics.fmean(walls):.1f} ± {statistics.stdev(walls):.1f}"
    # One process walked the jobs: each is launched once the one before exited, and job 0 once the sweep had
    # checked its grid; the sweep's own start-up before it is said apart, in no job's wall time.
    started = json.loads((sweep / SWEEP_FILE).read_text())
    assert started["launched_at"] < started["jobs_started_at"]
    times = [json.loads((job / RUN_FILE).read_text()) for job in all_jobs(sweep)]
    launched = [started["jobs_started_at"]] + [t["exited_at"] for t in times[:-1]]
    assert [t["launched_at"] for t in times] == launched
    assert "The sweep's own start-up (interpreter, Hydra, the grid check) took" in table
    groups = group_jobs([load_job(j) for j in all_jobs(sweep)])
    figure = plot_compare(groups, "eval/accuracy", sweep / "again.png")
    by_wall, by_samples, speed, wire, split, legend_ax = figure.axes
    # Each eval where its model was taken: async's consensus of a round after its epoch's end.
    async_line = by_samples.get_lines()[POLICIES.index("async")]
    evaluated = [records_of(job_of(sweep, "async", s)) for s in SEEDS]
    shared = min(len(r) for r in evaluated)
    expected = [statistics.fmean(r[e]["eval_samples"] for r in evaluated) for e in range(shared)]
    assert list(async_line.get_xdata())[:shared] == pytest.approx(expected)
    for policy in POLICIES:
        for record in records_of(job_of(sweep, policy)):
            # Taken after the epoch's last step, holding every step of it (sync: at the epoch's end).
            assert record["eval_taken_at"] >= record["window_end"]
            assert record["eval_at_step"] >= record["step"]
            assert policy != "sync" or record["eval_at_step"] == record["step"]
    # A line per group (seeds folded), its band around it.
    assert [len(ax.get_lines()) for ax in (by_wall, by_samples, speed, wire)] == [3, 3, 3, 3]
    assert [len(ax.collections) for ax in (by_wall, by_samples, speed, wire)] == [3, 3, 3, 3]
    legend = legend_ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [f"policy={p}" for p in POLICIES]
    assert "n = 2" in legend.get_title().get_text()
    assert [t.get_text() for t in split.get_yticklabels()] == [f"policy={p}" for p in POLICIES]
    assert matplotlib.image.imread(sweep / REPORT_PNG).ndim == 3


def test_callback_hooks_run_in_order_with_each_epochs_metrics(sweep: Path) -> None:
    for job in all_jobs(sweep):
        records = records_of(job)
        calls = [json.loads(line) for line in (job / HOOKS_FILE).read_text().splitlines()]
        named = [" ".join([c["hook"], *([str(c["epoch"])] if "epoch" in c else [])]) for c in calls]
        expected = ["on_run_start"]
        for record in records:
            expected += [f"on_epoch_end {record['epoch']}", f"on_eval {record['epoch']}"]
        expected.append("on_run_end")
        # A checkpoint's hook comes once it is committed: after its epoch's, in epoch order, and (its parts
        # written in the background) maybe after a later epoch's.
        checkpointed = [n for n in named if n.startswith("on_checkpoint")]
        recorded = {r["epoch"] for r in records}
        assert checkpointed == [f"on_checkpoint {e}" for e in sorted(CHECKPOINTED) if e in recorded]
        after = [named.index(n.replace("on_checkpoint", "on_eval")) for n in checkpointed]
        assert all(after[i] < named.index(n) < len(named) - 1 for i, n in enumerate(checkpointed))
        assert [n for n in named if not n.startswith("on_checkpoint")] == expected
        assert calls[0]["world_size"] == 2 and calls[0]["epochs"] == EPOCHS
        ends = [c for c in calls if c["hook"] == "on_epoch_end"]
        assert [c["metrics"] for c in ends] == records
        evals = [c["metrics"] for c in calls if c["hook"] == "on_eval"]
        assert evals == [{k: v for k, v in r.items() if k.startswith("eval/")} for r in records]
        for checkpoint in (c for c in calls if c["hook"] == "on_checkpoint"):
            # The hook's epoch is metrics.jsonl's (0-based); the dir is named as lines count (from 1).
            named = f"epoch-{checkpoint['epoch'] + 1:06d}"
            assert checkpoint["committed"] and checkpoint["path"].endswith(named)
        assert calls[-1]["last_metrics"] == records[-1] and calls[-1]["model_saved"]


def test_early_stopping_ends_every_rank_at_the_same_epoch(sweep: Path) -> None:
    for job in all_jobs(sweep):
        records = records_of(job)
        last = records[-1]["epoch"]
        # Asked after epoch 1; the stop lands at an epoch boundary no rank was handed work past.
        assert 1 <= last < EPOCHS - 1, job
        assert [r["epoch"] for r in records] == list(range(last + 1))
        assert all(share["batches"] > 0 for share in records[-1]["per_rank"])
        for rank in (0, 1):
            assert (
                f"rank {rank} stops after epoch {last + 1}: EarlyStopping: eval/accuracy"
                in (job / f"rank{rank}.log").read_text()
            )
        end = json.loads((job / HOOKS_FILE).read_text().splitlines()[-1])
        assert end["last_epoch"] == last and end["stopped"].startswith("EarlyStopping:")
        # model.pt is the consensus the last epoch's eval ran on.
        assert accuracy_of(job / "model.pt") == pytest.approx(records[-1]["eval/accuracy"], abs=1e-12)


def test_best_model_holds_the_best_evals_parameters(sweep: Path) -> None:
    for job in all_jobs(sweep):
        best = max(r["eval/accuracy"] for r in records_of(job))
        assert accuracy_of(job / "best.pt") == pytest.approx(best, abs=1e-12)
        assert not (job / "evaluated").exists()  # the evaluated models not kept are gone


def test_a_failing_callback_stops_every_rank_naming_it(tmp_path: Path) -> None:
    result = train(
        "launch.nproc_per_node=2",
        FAST_START,
        "epochs=4",
        "callbacks=[{_target_:tests.helpers.callback_log.Failing,epoch:1}]",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert result.code == 1, result.out
    named = "callback tests.helpers.callback_log.Failing.on_eval raised ValueError: refusing epoch 1"
    assert named in result.out
    # Rank 1 stops at the coordinator's word; rank 0 too, or at its own coordinator's failure.
    assert "rank 1 stops after epoch" in (tmp_path / "run" / "rank1.log").read_text()
    # Rank 1, its part done when rank 0 failed, left on the launcher's SIGTERM (not its SIGKILL 30 s later).
    launcher = (tmp_path / "run" / ".launch" / "launcher.log").read_text()
    assert "forcefully exiting via SIGKILL" not in launcher, launcher
    assert all(named in (tmp_path / "run" / f"rank{r}.log").read_text() for r in (0, 1))
    assert not (tmp_path / "run" / "model.pt").exists()
    assert not leftovers(tmp_path)
