"""Sharded groups under sync (HSDP, docs/sharded-groups.md): 4 gloo ranks as 2 groups of 2, each holding half
of the model, train what one process trains on the global batch, evaluate it, and write the whole model as
a run of full replicas writes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flodl.checkpoints.export import load_model
from flodl.tasks.classification import classification_sums
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import FAST_START, train
from tests.helpers.runs import epochs_of
from tests.helpers.sync_reference import BATCH, assert_matches_reference

pytestmark = pytest.mark.multiproc


def test_two_groups_of_two_match_one_process_on_the_global_batch(tmp_path: Path) -> None:
    groups = ("device=cpu", FAST_START, "shard_group=2", "checkpoint_every=null")
    (record,) = assert_matches_reference(tmp_path, 1e-5, *groups, world=4, evals=True)
    # Each rank held half of the model (DigitsMLP's layers have rows in even numbers).
    whole = sum(p.numel() for p in DigitsMLP(hidden=128).parameters())
    for rank in range(4):
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        mesh = "HSDP over 2 group(s) of 2 rank(s): [0, 1] [2, 3]"
        held = f"{whole // 2:,} of the model's {whole:,}"
        assert f"rank {rank}: shard {rank % 2} of group {rank // 2} ({mesh}): {held}" in log
    # model.pt, gathered once at the end, is what flodl-export reads: the task's model, whole.
    model = load_model(tmp_path / "run")
    # Each rank evaluated its share through the sharded model; the shares sum to the whole model's eval.
    data = digits_dataset("test")
    with torch.no_grad():
        sums = classification_sums(model, data.get_batch(torch.arange(len(data))))
    for name, total in sums.items():
        assert record[f"eval/{name}"] == pytest.approx(float(total) / len(data), rel=1e-4)


def test_micro_batches_in_sharded_groups_are_one_step_on_their_union(tmp_path: Path) -> None:
    # grad_accum=4: every micro-batch's backward reduce-scatters its gradients into the shards (FSDP2 has no
    # DDP no_sync here); their sum is the step on the global batch all the same.
    accum = ("device=cpu", FAST_START, "shard_group=2", f"batch_size={BATCH // 4}", "grad_accum=4")
    (record,) = assert_matches_reference(tmp_path, 1e-5, *accum, world=4, sgd=True)
    assert record["samples"] == record["step"] * 4 * BATCH


def test_a_sharded_checkpoint_resumes_on_other_groups_where_the_run_left_off(tmp_path: Path) -> None:
    # 2 groups of 2 checkpoint after each epoch, each rank writing its shard of SGD's momentum (nothing
    # gathered but the model); the run stopped after its first epoch goes on as 1 group of 4 (each rank reads
    # a quarter: resharded), then after its second as 4 full replicas (each reads the whole), and ends where
    # the uninterrupted run does (SGD: within float rounding).
    common = (FAST_START, "device=cpu", "batch_size=32", "eval_every=0", "checkpoint_every=1")
    sgd = ("task.optimizer._target_=torch.optim.SGD", "task.optimizer.lr=0.1", "+task.optimizer.momentum=0.9")
    four = ("launch.nproc_per_node=4", *common, *sgd)
    train(*four, "shard_group=2", "epochs=3", "hydra.run.dir=whole", cwd=tmp_path).check()
    for epochs, groups in ((1, 2), (2, 4), (3, 1)):
        train(*four, f"shard_group={groups}", f"epochs={epochs}", "hydra.run.dir=split", cwd=tmp_path).check()
        if epochs == 1:
            saved = tmp_path / "split" / "checkpoints" / "epoch-000001" / "sharded"
            assert sorted(p.name for p in saved.iterdir()) == [
                ".metadata",
                *(f"__{r}_0.distcp" for r in range(4)),
            ]
    assert "resumed from" in (tmp_path / "split" / "rank3.log").read_text()
    whole, split = epochs_of(tmp_path / "whole"), epochs_of(tmp_path / "split")
    assert [(r["step"], r["lr"]) for r in split] == [(r["step"], r["lr"]) for r in whole]
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "model.pt", weights_only=True)
    for name, want in a.items():
        assert ((b[name] - want).norm() / want.norm()).item() <= 1e-6, name
