"""A job that changes size on one GPU (skipped without one): NCCL refuses two ranks on one device, so the
ranks that share it talk over gloo (`backend=cpu`, CUDA tensors), and the NCCL path is the one-rank side of a
resize. A checkpoint of two ranks sharing the GPU resumes on one rank over NCCL with every sample once across
the resize (sync, cadence), and with keep_global_batch within float tolerance of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.procs import train
from tests.helpers.resize_counts import PINNED, resumable, resumed_trains_each_sample_once_an_epoch
from tests.helpers.resize_counts import POINTS as BYO_POINTS
from tests.helpers.runs import epochs_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHARED_GPU = ("launch.nproc_per_node=2", "backend=cpu")

POINTS = (*BYO_POINTS, "epochs=3")


@pytest.mark.parametrize(
    ("policy", "every"),
    [("sync", ("checkpoint_every_steps=5",)), ("cadence", (*PINNED, "checkpoint_every_steps=4"))],
)
def test_two_ranks_sharing_a_gpu_resume_on_one_rank_over_nccl_every_sample_once(
    tmp_path: Path, policy: str, every: tuple[str, ...]
) -> None:
    common = [*POINTS, f"policy={policy}", *every, f"task.train_data.log={tmp_path / 'reads'}"]
    train(*common, *SHARED_GPU, f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path, timeout=300).check()
    (tmp_path / "reads").rename(tmp_path / "reads-two")
    checkpoint = resumable(tmp_path / "two", 2)
    again = (f"resume={checkpoint}", f"hydra.run.dir={tmp_path / 'one'}")
    out = train(*common, "launch.nproc_per_node=1", *again, cwd=tmp_path, timeout=300).check().out
    assert "resumed 2 ranks' checkpoint on 1" in out, out[-3000:]
    assert "on cuda:0 (nccl)" in (tmp_path / "one" / "rank0.log").read_text()
    resumed_trains_each_sample_once_an_epoch(checkpoint, tmp_path / "reads", 3)
    assert [(r["epoch"], r["world"]) for r in epochs_of(tmp_path / "one")] == [(1, 1), (2, 1)]


def test_keep_global_batch_resumes_the_shared_gpus_checkpoint_on_one_nccl_rank_within_float_tolerance(
    tmp_path: Path,
) -> None:
    common = [*POINTS, "task.train_data.noise=0", "checkpoint_every_steps=5", "keep_global_batch=true"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(*common, *SHARED_GPU, f"hydra.run.dir={whole}", cwd=tmp_path, timeout=300).check()
    again = (f"resume={resumable(whole, 2)}", f"hydra.run.dir={resumed}")
    out = train(*common, "launch.nproc_per_node=1", *again, cwd=tmp_path, timeout=300).check().out
    assert "grad_accum 2 (configured 1) keeps the checkpoint's global batch" in out, out[-3000:]
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(resumed / "model.pt", weights_only=True)
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)
    assert [r["lr"] for r in epochs_of(resumed)] == [r["lr"] for r in epochs_of(whole)[1:]]
