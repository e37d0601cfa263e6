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
from tests.helpers.procs import FAST_START, REPO, train
from tests.helpers.runs import epochs_of
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
    # once (its gradients rounded to bf16 over 32 samples, not 8) 3e-4 to 2e-3. A run that trained other
    # samples would end as far off: the compiled run logs no sample ids (the hook's imports in every Python
    # process inductor starts make compiling 6x slower), its records count them.
    log = tmp_path / "samples"
    more, env = (("compile=true",), {}) if compiled else ((), sample_log(log))
    (record,) = assert_matches_reference(
        tmp_path, 1e-5, *GROUPS, *more, world=WORLD, sgd=True, bf16=True, **env
    )
    steps = len(digits_dataset("train")) // (WORLD * BATCH)
    assert record["samples"] == steps * WORLD * BATCH
    if not compiled:
        assert trained_once(log, 1, steps * WORLD * BATCH) == {r: steps for r in range(WORLD)}
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert {t.dtype for t in trained.values()} == {torch.float32}  # the parameters stay float32
    # The teeth: bf16 is in effect (the float32 math ends far from the run).
    assert min(relative(trained, reference_run(steps, True, WORLD)[0]).values()) > 1e-4
    assert (record["compile_s"] > 0) == compiled


@pytest.mark.parametrize(
    ("policy", "extra"), [("cadence", ("eval_every=0",)), ("async", ("eval_every=1", "max_overshoot=0"))]
)
def test_compiled_bf16_groups_under_local_sgd_end_where_eager_ones_do(
    tmp_path: Path, policy: str, extra: tuple[str, ...]
) -> None:
    # A fixed window of 5 (the plan and the rounds the same in both runs; async without overshoot, an eval
    # leaving FSDP2's root gathered before a round), bf16 in both; the compiled run differs by what inductor
    # fuses (the same ops, float32 inside a fused kernel: measured bit for bit under sync), its rounds by
    # nothing. The eager run logs its samples' ids; the compiled one, ending where it does, trained the
    # same ones.
    pinned = ("anchor=5", "min_anchor=5", "max_anchor=5", "max_batch_diff=0", "divergence_guard=none")
    sgd = ("task.optimizer._target_=torch.optim.SGD", "task.optimizer.lr=0.1", "lr_scale_ratio=0")
    common = (*GROUPS, *pinned, *sgd, *extra, f"policy={policy}", f"launch.nproc_per_node={WORLD}")
    log, runs = tmp_path / "samples", {}
    for compiled in (False, True):
        more = (
            "precision=bf16",
            f"batch_size={BATCH}",
            "epochs=1",
            f"compile={compiled}",
            f"hydra.run.dir={compiled}",
        )
        train(*common, *more, cwd=tmp_path, timeout=400, **({} if compiled else sample_log(log))).check()
        (record,) = epochs_of(tmp_path / str(compiled))
        assert (record["compile_s"] > 0) == compiled
        model = torch.load(tmp_path / str(compiled) / "model.pt", weights_only=True)
        runs[compiled] = ({p["rank"]: p["batches"] for p in record["per_rank"]}, model)
    steps = trained_once(log, 1, len(digits_dataset("train")) // BATCH // K * K * BATCH)  # whole groups
    assert steps[0] == steps[1] and steps[2] == steps[3]  # a group's members step together
    assert runs[True][0] == runs[False][0] == steps
    assert max(relative(runs[True][1], runs[False][1]).values()) <= 1e-5
