"""Cadence and async end to end: 2 gloo ranks, one of them slowed 3x, against sync on the same task."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import FAST_START
from tests.helpers.runs import fast_rank_share, fast_rank_speed_share, final_accuracy, run_policy

pytestmark = pytest.mark.multiproc

SLOW = ("simulate.slow_rank=1", "simulate.factor=3", FAST_START)


@pytest.fixture(scope="module")
def sync_records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_policy(tmp_path_factory.mktemp("sync"), "sync", FAST_START)


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_slowed_rank_gets_a_quarter_and_accuracy_matches_sync(
    tmp_path: Path, policy: str, sync_records: list[dict]
) -> None:
    records = run_policy(tmp_path, policy, *SLOW)
    assert [r["epoch"] for r in records] == list(range(15))
    # Every batch of every epoch was trained exactly once, split between the ranks.
    batches_per_epoch = records[0]["per_rank"][0]["batches"] + records[0]["per_rank"][1]["batches"]
    assert all(sum(p["batches"] for p in r["per_rank"]) == batches_per_epoch for r in records)
    # Rank 1 is slowed 3x: ElChe gives rank 0 its share of the two ranks' speeds (within 15%) as measured in
    # this run (3 of every 4 batches on an idle machine; load shifts the ratio of their step times).
    assert fast_rank_speed_share(records) > 0.6
    assert fast_rank_share(records) == pytest.approx(fast_rank_speed_share(records), rel=0.15)
    assert fast_rank_share(sync_records) == 0.5
    # Async's split of the batches depends on timing: over nine runs its accuracy spread 0.963-0.976 around
    # sync's 0.973 (359 test images; one image is 0.0028). Within 2 points of sync, and above 0.95.
    assert final_accuracy(records) >= final_accuracy(sync_records) - 0.02
    assert final_accuracy(records) >= 0.95


def test_bf16_wire_halves_the_gradient_bytes_under_sync(tmp_path: Path, sync_records: list[dict]) -> None:
    # The float32 wire's first 2 epochs: those of the sync run above (no LR schedule, CPU: the same as a
    # 2-epoch run's).
    full = sync_records[:2]
    half = run_policy(tmp_path / "bf16", "sync", "epochs=2", "bf16_wire=true", FAST_START)
    assert full[-1]["comm_bytes_total"] > 0
    assert half[-1]["comm_bytes_total"] * 2 == full[-1]["comm_bytes_total"]
    assert abs(final_accuracy(half) - final_accuracy(full)) <= 0.03


LINEAR_DECAY = (
    "+task.scheduler._target_=torch.optim.lr_scheduler.LinearLR",
    "+task.scheduler._partial_=true",
    "+task.scheduler.start_factor=1.0",
    "+task.scheduler.end_factor=0.0",
    "+task.scheduler.total_iters=100000",
    "lr_scale_ratio=0",
)


def schedule_position(record: dict, base_lr: float = 0.001) -> float:
    """LinearLR from 1 to 0 over 100000 steps: the lr tells how far the scheduler has been stepped."""
    return (1 - record["lr"] / base_lr) * 100000


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_lr_schedule_clock(tmp_path: Path, policy: str) -> None:
    # cadence: windows held at 10 steps, so rounds (which advance the shared clock) come often enough in
    # 2 epochs for the bounds below; ElChe growing them on a slow control plane is tested elsewhere.
    pinned = ("max_anchor=10",) if policy == "cadence" else ()
    records = run_policy(tmp_path, policy, *LINEAR_DECAY, *pinned, "epochs=2", FAST_START)
    position = schedule_position(records[-1])
    if policy == "sync":  # one scheduler step per optimizer step, as with DDP
        assert position == pytest.approx(records[-1]["step"], abs=0.5)
    else:  # the original's clock: every rank's steps up to the last average, plus rank 0's since
        trained = sum(r["samples"] for r in records) // 32
        own = sum(p["batches"] for r in records for p in r["per_rank"] if p["rank"] == 0)
        # Past rank 0's own steps by the other rank's up to the last average: all of them but at most its
        # last window. ElChe sizes the windows by the ranks' speeds, which load shifts (a busy machine's
        # rank 0 trained 25 of 89 steps, its peer 64 in windows of up to ~35), so the bound is a quarter of
        # the other rank's steps, not a share of the busiest rank's count.
        assert own + (trained - own) / 4 < position <= trained
