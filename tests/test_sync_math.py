"""Sync is one process on the global batch: checked against plain torch, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl.data.partition import epoch_permutation, equal_slices
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import train

pytestmark = pytest.mark.multiproc

WORLD, BATCH, LR, SEED = 2, 8, 0.1, 42


def reference_params(steps_expected: int) -> dict[str, torch.Tensor]:
    """One process, plain torch SGD, on the union of what the ranks see at each step."""
    data = digits_dataset("train")
    torch.manual_seed(SEED)
    model = DigitsMLP(hidden=128)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
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
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs"),
            ],
        ),
    ],
)
def test_two_ranks_match_one_process_on_the_global_batch(tmp_path: Path, device: str) -> None:
    train(
        f"device={device}",
        f"launch.nproc_per_node={WORLD}",
        # Forked ranks start fastest, but CUDA needs spawned ones.
        f"launch.start_method={'fork' if device == 'cpu' else 'spawn'}",
        f"batch_size={BATCH}",
        "epochs=1",
        "eval_every=0",
        f"seed={SEED}",
        "lr_scale_ratio=0",
        "task.optimizer._target_=torch.optim.SGD",
        f"task.optimizer.lr={LR}",
        "hydra.run.dir=run",
        cwd=tmp_path,
    ).check()
    steps = len(digits_dataset("train")) // (WORLD * BATCH)
    assert steps >= 20
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    expected = reference_params(steps)
    torch.manual_seed(SEED)
    initial = DigitsMLP(hidden=128).state_dict()
    for name, want in expected.items():
        got = trained[name]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"
        # And training moved the weights far more than that tolerance.
        assert ((want - initial[name]).norm() / want.norm()).item() > 1e-2
