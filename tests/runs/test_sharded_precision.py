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

from flodl.metrics.scalars import drain_scalars
from flodl.tasks.classification import cross_entropy_loss
from flodl.tasks.digits import digits_dataset
from flodl.worker.stepper import SCALER_SKIPPED
from tests.helpers.chaos_job import read_samples
from tests.helpers.digits_stepper import digits_stepper, train_steps
from tests.helpers.float8 import CPU_FLOAT8
from tests.helpers.procs import FAST_START, REPO, train
from tests.helpers.runs import epochs_of
from tests.helpers.spawned import join_group, leave, run_ranks
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


# fp16's scaler multiplies the loss by 65536 at first: this gradient, cast to float16 on the way back, is inf
# until the scale is at most 65504 / LOUD (10 skipped steps from 65536, down to 64).
LOUD = 1000.0


def loud_on_rank_1(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy, and on rank 1 a term whose gradient overflows float16 in the output layer's first row
    only: after the group's reduce-scatter, only rank 0's shard (rows 0-4 of 10) holds the inf."""
    loss = cross_entropy_loss(model, batch)
    if torch.distributed.get_rank() == 1:
        loss = loss + LOUD * model.net[-1].weight[0].to(torch.float16).sum()
    return loss


def _fp16_group_member(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    join_group(rank, port, 2, out_dir)
    stepper = digits_stepper(
        "precision=fp16",
        f"task.loss._target_={__name__}.loud_on_rank_1",
        shard_over=init_device_mesh("cpu", (2,)),
    )
    drain_scalars()
    train_steps(stepper, 16)
    skipped, _ = drain_scalars()[SCALER_SKIPPED]
    finite = all(p.full_tensor().isfinite().all().item() for p in stepper.parts.model.parameters())
    leave({"scaler": stepper.scaler.state_dict(), "skipped": skipped, "finite": finite}, rank, out_dir)


def test_fp16s_scaler_skips_a_step_on_every_member_of_a_group_when_one_shard_overflows(
    tmp_path: Path,
) -> None:
    # 2 ranks as one group; rank 1's gradient overflows into rank 0's shard alone. Every member must skip the
    # step and lower its scale (the inf found on any shard is the group's), or the members' scales part and
    # the next reduce-scatter sums gradients scaled apart (and rank 1 steps on a gradient rank 0 discarded).
    run_ranks(_fp16_group_member, 2, tmp_path)
    said = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    assert said[0]["scaler"] == said[1]["scaler"]
    assert said[0]["skipped"] == said[1]["skipped"] == 10  # down to a scale of 64 (LOUD x 64 < 65504)
    assert said[0]["scaler"]["scale"] == 65536.0 / 2**10
    assert said[0]["finite"] and said[1]["finite"]


class _Float8Blocks(torch.nn.Module):
    """Two blocks (FSDP2 units of their own) of a layer norm, a linear, a GELU and a linear: float8 casts
    their linears' inputs with the maxima seen the step before, as in a transformer's MLP."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        blocks = (
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in "ab"
        )
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _float8_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad()
    with torch.autocast("cpu", torch.bfloat16):
        model(inputs).float().square().mean().backward()
    optimizer.step()


def _fp8_group_member(rank: int, port: int, out_dir: str) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from flodl.sharding.fsdp import shard_model
    from flodl.worker.float8 import SEEN, convert_to_float8

    join_group(rank, port, 2, out_dir)
    torch.manual_seed(0)
    model = _Float8Blocks()
    convert_to_float8(model)
    replicas = [copy.deepcopy(model) for _ in range(2)]  # the reference: 2 replicas, their gradients averaged
    inputs = [torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shard_model(model, optimizer, init_device_mesh("cpu", (2,)))
    for step in range(3):
        _float8_steps(model, optimizer, inputs[rank][step])
        grads = []
        for r, replica in enumerate(replicas):
            replica.zero_grad()
            with torch.autocast("cpu", torch.bfloat16):
                replica(inputs[r][step]).float().square().mean().backward()
            grads.append([p.grad for p in replica.parameters()])
        with torch.no_grad():
            for replica in replicas:
                for p, *each in zip(replica.parameters(), *grads, strict=True):
                    p -= 0.5 * sum(each) / 2
    seen = {name: float(b) for name, b in model.named_buffers() if name.rsplit(".", 1)[-1] in dict(SEEN)}
    leave(
        {
            "model": {name: p.full_tensor() for name, p in model.named_parameters()},
            "seen": seen,
            "replica": dict(replicas[rank].named_parameters()),
            "replica_seen": {name: float(b) for name, b in replicas[rank].named_buffers() if name in seen},
        },
        rank,
        out_dir,
    )


@CPU_FLOAT8
def test_fp8_groups_step_as_replicas_whose_gradients_are_averaged(tmp_path: Path) -> None:
    # precision=fp8 in a group of 2: each rank's float8 linears multiply FSDP2's gathered weight (scaled by
    # its own maximum) with the rank's micro-batch (scaled by the maxima the rank saw the step before, its
    # own), as a full replica's do on that micro-batch; the group reduce-scatters the gradients. 3 steps end
    # where 2 replicas stepping their averaged gradients do (float32 sums in another order), and each rank's
    # maxima are its replica's.
    run_ranks(_fp8_group_member, 2, tmp_path)
    for rank in range(2):
        said = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert max(relative(said["model"], said["replica"]).values()) <= 1e-5
        assert said["seen"] == pytest.approx(said["replica_seen"]) and len(said["seen"]) == 8  # 4 linears
    seen = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["seen"] for r in range(2)]
    assert seen[0] != seen[1]  # each rank's own: its micro-batch's
