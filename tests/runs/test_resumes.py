"""Resumed runs: a resumed sync run equals the uninterrupted one, a resumed local-SGD run on 2 gloo ranks goes
on with its step clock, learning-rate schedule and ElChe, and a finished run resumed trains nothing (another
policy refused before any rank)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.procs import FAST_START, train
from tests.helpers.runs import epochs_of

pytestmark = pytest.mark.multiproc

STEP_LR = "task.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:40,gamma:0.7}"


def test_a_resumed_sync_run_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Model, losses, step count and learning rate: resume continues exactly (CPU, deterministic)."""
    common = ["checkpoint_every=2", STEP_LR]
    train("epochs=6", *common, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path).check()
    train("epochs=4", *common, f"hydra.run.dir={tmp_path / 'split'}", cwd=tmp_path).check()
    train("epochs=6", *common, f"hydra.run.dir={tmp_path / 'split'}", cwd=tmp_path).check()
    whole, split = epochs_of(tmp_path / "whole"), epochs_of(tmp_path / "split")
    assert [(r["epoch"], r["step"], r["lr"], r["loss"]) for r in split] == [
        (r["epoch"], r["step"], r["lr"], r["loss"]) for r in whole
    ]
    assert whole[-1]["lr"] < whole[0]["lr"]  # the schedule did move
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _local_sgd_run(run_dir: Path, policy: str, epochs: int, *more: str) -> list[str]:
    """A 2-rank `policy` run in `run_dir` with a checkpoint every 2 epochs and a step schedule of the lr."""
    every = ["checkpoint_every=2", STEP_LR, f"hydra.run.dir={run_dir}"]
    return ["launch.nproc_per_node=2", FAST_START, f"policy={policy}", f"epochs={epochs}", *every, *more]


@dataclass(frozen=True)
class ResumedRun:
    """A local-SGD run of 4 epochs, then the same run dir resumed for 2 more: what each run left."""

    run_dir: Path
    anchor: int  # ElChe's anchor in the checkpoint after epoch 4
    before: list[dict]  # the records after 4 epochs, and after 6
    after: list[dict]
    out: str  # the resumed run's output


RESUMED = ("logger.log_every=0",)


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ResumedRun]:
    """Each policy's resumed run, made once for the tests that read it."""
    made: dict[str, ResumedRun] = {}

    def resumed(policy: str) -> ResumedRun:
        if policy not in made:
            root = tmp_path_factory.mktemp(policy)
            run_dir = root / "run"
            train(*_local_sgd_run(run_dir, policy, 4), cwd=root, timeout=150).check()
            saved = torch.load(run_dir / "checkpoints" / "epoch-000004" / "coordinator.pt", weights_only=True)
            before = epochs_of(run_dir)
            out = train(*_local_sgd_run(run_dir, policy, 6, *RESUMED), cwd=root, timeout=150).check().out
            anchor = saved["driver"]["elche"]["anchor"]
            made[policy] = ResumedRun(run_dir, anchor, before, epochs_of(run_dir), out)
        return made[policy]

    return resumed


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_resumed_local_sgd_run_continues_its_step_clock_schedule_and_elche(
    resumed_runs: Callable[[str], ResumedRun], policy: str
) -> None:
    run = resumed_runs(policy)
    before, after = run.before, run.after
    assert [r["epoch"] for r in after] == list(range(6))
    assert after[:4] == before
    # ElChe continued from its saved anchor rather than from the configured one.
    assert f"ElChe resumed at anchor {run.anchor}" in run.out
    assert after[4]["step"] > before[3]["step"]
    # The schedule's clock (Σ steps of every rank) went on: the lr did not jump back up.
    assert after[4]["lr"] <= before[3]["lr"] < before[0]["lr"]


def test_resuming_a_finished_run_trains_nothing_and_another_policy_is_refused_before_any_rank(
    resumed_runs: Callable[[str], ResumedRun],
) -> None:
    """The resumed cadence run above, finished: its command again, then with another policy."""
    run_dir = resumed_runs("cadence").run_dir
    records = epochs_of(run_dir)
    again = train(*_local_sgd_run(run_dir, "cadence", 6, *RESUMED), cwd=run_dir.parent, timeout=150).check()
    assert "covers all 6 epochs: nothing left to train" in again.out
    assert epochs_of(run_dir) == records
    assert not list((run_dir / "checkpoints").glob(".host-*"))  # the start's mark for its ranks taken back
    (run_dir / "rank1.log").unlink()
    refused = train(*_local_sgd_run(run_dir, "sync", 6, *RESUMED), cwd=run_dir.parent, timeout=150)
    assert refused.code == 2
    assert 'policy: "cadence" there, "sync" here' in refused.out  # the run identity names the key
    assert not (run_dir / "rank1.log").exists()  # no rank was started
