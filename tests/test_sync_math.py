"""Sync is one process on the global batch on every backend: checked against plain torch (Adam and a StepLR),
step for step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl.data.partition import epoch_permutation, equal_slices
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import train

pytestmark = pytest.mark.multiproc

WORLD, BATCH, LR, SEED = 2, 8, 1e-3, 42
# A StepLR that halves the LR every STEP_SIZE optimizer steps: the LR clock must count global-batch steps.
STEP_SIZE, LR_GAMMA = 20, 0.5


def reference_run(steps_expected: int) -> tuple[dict[str, torch.Tensor], float]:
    """One process, plain torch Adam and StepLR, on the union of what the ranks see at each step."""
    data = digits_dataset("train")
    torch.manual_seed(SEED)
    model = DigitsMLP(hidden=128)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
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
    train(
        f"device={device}",
        f"backend={backend}",
        f"launch.nproc_per_node={WORLD}",
        # Forked ranks start fastest, but CUDA needs spawned ones.
        f"launch.start_method={'fork' if device == 'cpu' else 'spawn'}",
        f"batch_size={BATCH}",
        "epochs=1",
        "eval_every=0",
        f"seed={SEED}",
        "lr_scale_ratio=0",
        f"task.optimizer.lr={LR}",
        "+task.scheduler._target_=torch.optim.lr_scheduler.StepLR",
        "+task.scheduler._partial_=true",
        f"+task.scheduler.step_size={STEP_SIZE}",
        f"+task.scheduler.gamma={LR_GAMMA}",
        "hydra.run.dir=run",
        cwd=tmp_path,
    ).check()
    steps = len(digits_dataset("train")) // (WORLD * BATCH)
    assert steps >= 20
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    expected, expected_lr = reference_run(steps)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["lr"] == pytest.approx(expected_lr, rel=1e-9)
    assert expected_lr < LR * LR_GAMMA**3  # the schedule really decayed
    torch.manual_seed(SEED)
    initial = DigitsMLP(hidden=128).state_dict()
    for name, want in expected.items():
        got = trained[name]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
        # And training moved the weights far more than that tolerance.
        assert ((want - initial[name]).norm() / want.norm()).item() > 1e-2
