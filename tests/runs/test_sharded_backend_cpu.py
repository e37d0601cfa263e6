"""Sharded groups with backend=cpu (docs/sharded-groups.md, "Sharing GPUs"): the job's process groups are
gloo, so several ranks can share one GPU round-robin, and a round per shard index runs over gloo on
backend=cpu's host averager's thread. With nothing to train while it is in flight (no overshoot, no
overlap) a rank waits for it, and the two backends are the same math: 4 gloo ranks as 2 groups of 2 end
where backend=nccl's inline run does (gloo without a GPU), bit for bit. The same runs on one shared GPU:
tests/runs/test_gpu_sharded.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flodl.tasks.digits import DigitsMLP
from tests.helpers.procs import FAST_START, train
from tests.helpers.runs import epochs_of
from tests.helpers.sync_reference import assert_matches_reference

pytestmark = pytest.mark.multiproc

WORLD, K, BATCH = 4, 2, 8
# A fixed window of 5 without the guard: the plan and the rounds are a function of the config alone.
PINNED = ("anchor=5", "min_anchor=5", "max_anchor=5", "max_batch_diff=0", "divergence_guard=none")
SGD = ("task.optimizer._target_=torch.optim.SGD", "task.optimizer.lr=0.1", "lr_scale_ratio=0")
POLICIES = {"cadence": ("eval_every=0",), "async": ("eval_every=1", "max_overshoot=0", "easgd_alpha=0.5")}


def test_sync_groups_on_the_cpu_backend_match_one_process_on_the_global_batch(tmp_path: Path) -> None:
    # HSDP over the job's process group, gloo on either backend here (on a GPU backend=cpu keeps it gloo:
    # FSDP2's gathers and reduce-scatters of CUDA tensors over gloo, tests/runs/test_gpu_sharded.py).
    groups = ("device=cpu", FAST_START, "backend=cpu", f"shard_group={K}", "checkpoint_every=null")
    assert_matches_reference(tmp_path, 1e-5, *groups, world=WORLD)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_local_sgd_groups_on_the_cpu_backend_end_where_the_device_backends_do(
    tmp_path: Path, policy: str
) -> None:
    # Refused before (exit 2: "a round runs on the device: set backend=nccl"). Under async with no overshoot
    # a rank has nothing to train while its round is on the thread: it blends where the inline round does.
    common = (
        f"launch.nproc_per_node={WORLD}",
        FAST_START,
        "device=cpu",
        f"policy={policy}",
        f"shard_group={K}",
        f"batch_size={BATCH}",
        "epochs=1",
        "checkpoint_every=null",
        *PINNED,
        *SGD,
        *POLICIES[policy],
    )
    runs = {}
    for backend in ("cpu", "nccl"):
        train(*common, f"backend={backend}", f"hydra.run.dir={backend}", cwd=tmp_path, timeout=300).check()
        (record,) = epochs_of(tmp_path / backend)
        batches = {p["rank"]: p["batches"] for p in record["per_rank"]}
        runs[backend] = (batches, torch.load(tmp_path / backend / "model.pt", weights_only=True))
    whole = sum(p.numel() for p in DigitsMLP(hidden=128).parameters())
    for rank in range(WORLD):  # each rank held its shard and averaged it with its shard index's sharers
        line = "(FSDP2 in the group, rounds per shard index over 2 group(s) of 2 rank(s): [0, 1] [2, 3]): "
        assert line + f"{whole // K:,} of the model's" in (tmp_path / "cpu" / f"rank{rank}.log").read_text()
    batches, model = runs["cpu"]
    assert sum(batches.values()) == 1438 // BATCH // K * K  # every batch of the epoch's whole groups once
    assert batches[0] == batches[1] and batches[2] == batches[3]  # a group's members alike
    assert batches == runs["nccl"][0]
    for name, want in runs["nccl"][1].items():
        assert torch.equal(model[name], want), name
