"""Sync checked against plain torch: one process training the global batches of the ranks' micro-batches
(Adam or SGD, and a StepLR), and a CLI run of `world` ranks compared with it (tests/runs/test_sync_math.py,
test_sharded_sync.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flodl.data.partition import epoch_permutation, equal_slices
from flodl.tasks.digits import DigitsMLP, digits_dataset
from tests.helpers.procs import train
from tests.helpers.runs import epochs_of

WORLD, BATCH, LR, SEED = 2, 8, 1e-3, 42
# SGD's step is linear in the gradient: micro-batches summed in another order stay within rounding.
SGD_LR = 0.1
# A StepLR that halves the LR every STEP_SIZE optimizer steps: the LR clock must count global-batch steps.
STEP_SIZE, LR_GAMMA = 20, 0.5


def reference_run(
    steps_expected: int, sgd: bool, world: int = WORLD, bf16: bool = False
) -> tuple[dict[str, torch.Tensor], float]:
    """One process, plain torch Adam (or SGD) and StepLR, on the union of what `world` ranks see at each
    step (`bf16`: each rank's forward and backward under bf16 autocast, the parameters and the step
    float32)."""
    data = digits_dataset("train")
    torch.manual_seed(SEED)
    model = DigitsMLP(hidden=128)
    params = model.parameters()
    optimizer = torch.optim.SGD(params, lr=SGD_LR) if sgd else torch.optim.Adam(params, lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE, gamma=LR_GAMMA)
    perm = epoch_permutation(len(data), SEED, 0)
    slices = equal_slices(len(data), world, BATCH)
    steps = slices[0].size // BATCH
    assert steps == steps_expected
    for b in range(steps):
        picks = [perm[s.offset + b * BATCH : s.offset + (b + 1) * BATCH] for s in slices]
        optimizer.zero_grad()
        # Under bf16 each rank's micro-batch apart, as its rank computes it (autocast rounds a matmul's
        # output, a micro-batch's weight gradient among them, to bf16), their mean taken in float32.
        for micro in picks if bf16 else [torch.cat(picks)]:
            inputs, labels = data.get_batch(micro)
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(inputs), labels)
            (loss * (len(micro) / (world * BATCH))).backward()
        optimizer.step()
        scheduler.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, float(scheduler.get_last_lr()[0])


def assert_matches_reference(
    tmp_path: Path,
    tolerance: float,
    *overrides: str,
    sgd: bool = False,
    world: int = WORLD,
    evals: bool = False,
    bf16: bool = False,
    **env: str,
) -> list[dict]:
    """A `world`-rank epoch under `overrides` ends where plain torch on the global batches of BATCH does
    (model and LR; model.pt holds the model's every tensor, as the task's model names them); its metrics
    records (`evals`: it evaluates after the epoch; `bf16`: the run and the reference under bf16 autocast;
    `env`: the ranks' environment, added)."""
    optimizer = ("task.optimizer._target_=torch.optim.SGD",) if sgd else ()
    train(
        f"launch.nproc_per_node={world}",
        f"batch_size={BATCH}",
        "epochs=1",
        f"eval_every={int(evals)}",
        f"seed={SEED}",
        "lr_scale_ratio=0",
        f"task.optimizer.lr={SGD_LR if sgd else LR}",
        "+task.scheduler._target_=torch.optim.lr_scheduler.StepLR",
        "+task.scheduler._partial_=true",
        f"+task.scheduler.step_size={STEP_SIZE}",
        f"+task.scheduler.gamma={LR_GAMMA}",
        "hydra.run.dir=run",
        *optimizer,
        f"precision={'bf16' if bf16 else 'fp32'}",
        *overrides,
        cwd=tmp_path,
        timeout=400,
        **env,
    ).check()
    steps = len(digits_dataset("train")) // (world * BATCH)
    assert steps >= 20
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    expected, expected_lr = reference_run(steps, sgd, world, bf16)
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in expected.items()}
    records = epochs_of(tmp_path / "run")
    assert records[-1]["lr"] == pytest.approx(expected_lr, rel=1e-9)
    decays = steps // STEP_SIZE  # the schedule really decayed, at every STEP_SIZE global steps
    assert decays >= 2 and expected_lr == pytest.approx((SGD_LR if sgd else LR) * LR_GAMMA**decays)
    torch.manual_seed(SEED)
    initial = DigitsMLP(hidden=128).state_dict()
    for name, want in expected.items():
        got = trained[name]
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= tolerance, f"{name}: relative difference {rel:.2e}"
        # And training moved the weights far more than that tolerance.
        assert ((want - initial[name]).norm() / want.norm()).item() > 1e-2
    return records
