"""Sync is one process on the global batch on every backend: checked against plain torch (Adam and a StepLR),
step for step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl.data.partition import epoch_permutation, equal_slices
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import FAST_START, train
from tests.helpers.runs import epochs_of

pytestmark = pytest.mark.multiproc

WORLD, BATCH, LR, SEED = 2, 8, 1e-3, 42
# SGD's step is linear in the gradient: micro-batches summed in another order stay within rounding.
SGD_LR = 0.1
# A StepLR that halves the LR every STEP_SIZE optimizer steps: the LR clock must count global-batch steps.
STEP_SIZE, LR_GAMMA = 20, 0.5


def reference_run(steps_expected: int, sgd: bool) -> tuple[dict[str, torch.Tensor], float]:
    """One process, plain torch Adam (or SGD) and StepLR, on the union of what the ranks see at each step."""
    data = digits_dataset("train")
    torch.manual_seed(SEED)
    model = DigitsMLP(hidden=128)
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=SGD_LR) if sgd else torch.optim.Adam(params, lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=LR_GAMMA)
    perm = epoch_permutation(len(data), SEED, 0)
    slices = equal_slices(len(data), WORLD, BATCH)
    steps = slices[0].size // BATCH
    assert steps == steps_expected
    for b in range(steps):
        picks = torch.cat([perm[s.offset + b * BATCH : s.offset + (b + 1) * BATCH] for s in slices])
        inputs, labels = data.get_batch(picks)
        loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, scheduler.get_last_lr()[0]


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


def assert_matches_reference(
    tmp_path: Path, tolerance: float, *overrides: str, sgd: bool = False
) -> list[dict]:
    """A 2-rank epoch under `overrides` ends where plain torch on the global batches of BATCH does (model
    and LR); its metrics records."""
    optimizer = ("task.optimizer._target_=torch.optim.SGD",) if sgd else ()
    train(
        f"launch.nproc_per_node={WORLD}",
        f"batch_size={BATCH}",
        "epochs=1",
        "eval_every=0",
        f"seed={SEED}",
        "lr_scale_ratio=0",
        f"task.optimizer.lr={SGD_LR if sgd else LR}",
        "+task.scheduler._target_=torch.optim.lr_scheduler.StepLR",
        "+task.scheduler._partial_=true",
        f"+task.scheduler.step_size={STEP_SIZE}",
        f"+task.scheduler.gamma={LR_GAMMA}",
        "hydra.run.dir=run",
        *optimizer,
        *overrides,
        cwd=tmp_path,
        timeout=400,
    ).check()
    steps = len(digits_dataset("train")) // (WORLD * BATCH)
    assert steps >= 20
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    expected, expected_lr = reference_run(steps, sgd)
    records = epochs_of(tmp_path / "run")
    assert records[-1]["lr"] == pytest.approx(expected_lr, rel=1e-9)
    assert expected_lr < (SGD_LR if sgd else LR) * LR_GAMMA**3  # the schedule really decayed
    torch.manual_seed(SEED)
    initial = DigitsMLP(hidden=128).state_dict()
    for name, want in expected.items():
        got = trained[name]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= tolerance, f"{name}: relative difference {rel:.2e}"
        # And training moved the weights far more than that tolerance.
        assert ((want - initial[name]).norm() / want.norm()).item() > 1e-2
    return records
