"""Sharded groups' rounds on the host averager's thread with their shards on a GPU (docs/sharded-groups.md,
"Rounds on the host's thread"; skipped without a CUDA device): 4 ranks on one GPU as 2 groups of 2 with
backend=cpu, each round per shard index a pinned host snapshot of the rank's CUDA shard, reduced over gloo on
a thread while the rank trains on, the consensus copied back to the device. The same runs on CPU processes:
tests/runs/test_sharded_cadence.py and tests/runs/test_sharded_async.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.procs import FAST_START, held_rounds_env, train
from tests.helpers.runs import epochs_of, round_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device"),
]

WORLD, K, BATCH = 4, 2, 8
PER_EPOCH = 1438 // BATCH // K * K  # the digits' batches an epoch, whole groups of them
SHARED = (
    f"launch.nproc_per_node={WORLD}",
    FAST_START,
    "backend=cpu",
    f"shard_group={K}",
    f"batch_size={BATCH}",
    "checkpoint_every=null",
    "hydra.run.dir=run",
)


def steps_alike(run: Path) -> list[int]:
    """Every batch once an epoch, a group's members alike over the run; each rank's steps trained while its
    rounds were in flight."""
    totals, during = [0] * WORLD, [0] * WORLD
    for record in epochs_of(run):
        assert sum(p["batches"] for p in record["per_rank"]) == PER_EPOCH
        for p in record["per_rank"]:
            totals[p["rank"]] += p["batches"]
            during[p["rank"]] += p["steps_during_averaging"]
    assert totals[0] == totals[1] and totals[2] == totals[3], totals
    assert during[0] == during[1] and during[2] == during[3], during  # a group's members adopt at one step
    return during


def test_overlapped_rounds_of_cuda_shards_end_where_the_cpu_run_does(tmp_path: Path) -> None:
    pinned = ("anchor=5", "min_anchor=5", "max_anchor=5", "max_batch_diff=0", "divergence_guard=none")
    sgd = ("task.optimizer._target_=torch.optim.SGD", "task.optimizer.lr=0.1", "lr_scale_ratio=0")
    common = (*SHARED, "policy=cadence", "overlap_rounds=true", "epochs=2", "eval_every=1", *pinned, *sgd)
    models = {}
    for device in ("cuda", "cpu"):
        (tmp_path / device).mkdir()
        train(*common, f"device={device}", cwd=tmp_path / device, timeout=400).check()
        assert all(n > 0 for n in steps_alike(tmp_path / device / "run"))
        models[device] = torch.load(tmp_path / device / "run" / "model.pt", weights_only=True)
    for name, want in models["cpu"].items():  # CUDA's float32 sums in other orders than the CPU's
        assert ((models["cuda"][name].cpu() - want).norm() / want.norm()).item() <= 1e-4, name


def test_async_cuda_shards_train_on_while_their_rounds_are_in_flight(tmp_path: Path) -> None:
    train(
        *SHARED,
        "device=cuda",
        "policy=async",
        "simulate.slow_rank=1",
        "simulate.factor=2",
        "epochs=3",
        "eval_every=1",
        cwd=tmp_path,
        timeout=400,
        **held_rounds_env(0.2),
    ).check()
    assert sum(steps_alike(tmp_path / "run")) > 0
    for steps in round_steps(tmp_path / "run"):
        assert steps[0] == steps[1] and steps[2] == steps[3], steps
