"""precision=bf16 and compile=true across sharded groups (docs/sharded-groups.md): 4 gloo ranks as 2 groups
of 2. bf16 is autocast around the sharded model, as around a full replica (FSDP2 gathers the float32
parameters, autocast casts them for each matmul, the gradients reduce in float32); compile=true compiles the
sharded model (FSDP2's hooks stay eager around the compiled code)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from flodl.tasks.digits import digits_dataset
from tests.helpers.chaos_job import read_samples
from tests.helpers.procs import FAST_START, REPO
from tests.helpers.sync_reference import BATCH, assert_matches_reference, reference_run

pytestmark = pytest.mark.multiproc

WORLD, K = 4, 2
GROUPS = ("device=cpu", FAST_START, f"shard_group={K}", "checkpoint_every=null")


def sample_log(log_dir: Path) -> dict[str, str]:
    """The environment of a run whose ranks log every step's sample ids (tests/helpers/sample_log)."""
    hook = os.pathsep.join([str(REPO / "tests" / "helpers" / "sample_log"), str(REPO)])
    return {"PYTHONPATH": hook, "FLODL_TEST_SAMPLE_LOG": str(log_dir)}


def trained_once(log_dir: Path, epochs: int, per_epoch: int) -> dict[int, int]:
    """Each epoch trained `per_epoch` samples, none twice; each rank's steps of the run."""
    samples = read_samples(log_dir)
    for epoch in range(epochs):
        counted = Counter(i for s in samples if s.epoch == epoch for i in s.ids)
        assert sum(counted.values()) == per_epoch and max(counted.values()) == 1, epoch
    return Counter(s.rank for s in samples)


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: ((a[name] - want).norm() / want.norm()).item() for name, want in b.items()}


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_groups_step_the_bf16_math_of_one_process(tmp_path: Path, compiled: bool) -> None:
    # The reference: one process, each rank's micro-batch under bf16 autocast apart (autocast rounds its
    # weight gradients to bf16, as on its rank), their float32 mean stepped by SGD. The run does the same
    # operations; what may differ is the float32 order of the gradients' reduction (gloo's reduce-scatter
    # and all-reduce against one process's accumulation, a few ulps a step: ~1e-7 relative, SGD adding
    # them up over the epoch's 44 steps), so 1e-5, test_sharded_sync's bound (measured: 0, bit for bit,
    # eager and compiled). The float32 math ends 6e-4 to 2.6e-3 off, the bf16 math on the global batch at
    # once (its gradients rounded to bf16 over 32 samples, not 8) 3e-4 to 2e-3.
    compile_on = ("compile=true",) if compiled else ()
    log = tmp_path / "samples"
    (record,) = assert_matches_reference(
        tmp_path, 1e-5, *GROUPS, *compile_on, world=WORLD, sgd=True, bf16=True, **sample_log(log)
    )
    steps = len(digits_dataset("train")) // (WORLD * BATCH)
    assert trained_once(log, 1, steps * WORLD * BATCH) == {r: steps for r in range(WORLD)}
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert {t.dtype for t in trained.values()} == {torch.float32}  # the parameters stay float32
    # The teeth: bf16 is in effect (the float32 math ends far from the run).
    assert min(relative(trained, reference_run(steps, True, WORLD)[0]).values()) > 1e-4
    assert (record["compile_s"] > 0) == compiled
