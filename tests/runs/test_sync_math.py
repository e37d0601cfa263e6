"""Sync is one process on the global batch on every backend: checked against plain torch (Adam and a StepLR),
step for step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flodl.tasks.digits import digits_dataset
from tests.helpers.procs import FAST_START
from tests.helpers.sync_reference import BATCH, WORLD, assert_matches_reference

pytestmark = pytest.mark.multiproc


def gpu_case(backend: str) -> object:
    return pytest.param(
        "cuda",
        backend,
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs"),
        ],
    )


# The cpu backend averages the gradients on the host (DDP over gloo): the same math as the device backend.
@pytest.mark.parametrize(("device", "backend"), [("cpu", "cpu"), gpu_case("nccl"), gpu_case("cpu")])
def test_two_ranks_match_one_process_on_the_global_batch(tmp_path: Path, device: str, backend: str) -> None:
    assert_matches_reference(tmp_path, 1e-5, f"device={device}", f"backend={backend}", FAST_START)


def test_grad_accum_of_micro_batches_is_one_step_on_their_union(tmp_path: Path) -> None:
    # 4 micro-batches of BATCH/4 per step, the first 3 backward passes without DDP's all-reduce: the same
    # steps as batches of BATCH, and the LR clock (checked against StepLR) counts optimizer steps.
    accum = ("device=cpu", FAST_START, f"batch_size={BATCH // 4}", "grad_accum=4")
    (record,) = assert_matches_reference(tmp_path, 1e-5, *accum, sgd=True)
    steps = len(digits_dataset("train")) // (WORLD * BATCH)
    assert record["step"] == steps
    assert record["samples"] == steps * WORLD * BATCH  # every micro-batch's samples


def test_compiled_ddp_with_accumulation_matches_one_process(tmp_path: Path) -> None:
    # torch.compile around DDP: its graphs split at the gradient buckets and no_sync still skips the
    # all-reduce of the first micro-batch. Compiled kernels round differently: 1e-4.
    compiled = ("device=cpu", FAST_START, f"batch_size={BATCH // 2}", "grad_accum=2")
    (record,) = assert_matches_reference(tmp_path, 1e-4, *compiled, "compile=true", sgd=True)
    # The first step's compilation is reported apart and kept out of the throughput.
    assert record["compile_s"] > 0
    assert record["samples_per_s"] == pytest.approx(
        record["samples"] / (record["epoch_s"] - record["compile_s"])
    )
