"""The step's options: precision (autocast, fp16's GradScaler), grad_accum and compile, under every policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from flodl.averaging.flat import flatten_parameters
from flodl.tasks.classification import cross_entropy_loss
from tests.helpers.procs import FAST_START, leftovers, train
from tests.helpers.runs import epochs_of


def loud_cross_entropy(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy x 1000: its gradients overflow fp16 at GradScaler's initial scale (65536)."""
    return cross_entropy_loss(model, batch) * 1000.0


@pytest.mark.multiproc
def test_a_compiled_model_trains_its_flat_parameter_views_and_sees_updates_in_place() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    (group,) = flatten_parameters(model)
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(5, 8)
    for _ in range(2):
        optimizer.zero_grad()
        compiled(inputs).square().mean().backward()
        optimizer.step()
    # The parameters still live in the flat buffer the averagers reduce in place...
    start, end = group.buffer.data_ptr(), group.buffer.data_ptr() + group.buffer.nbytes
    assert all(start <= p.data_ptr() < end for p in model.parameters())
    # ...and what a round writes there is what the next compiled step computes with.
    with torch.no_grad():
        before = compiled(inputs)
        group.buffer.mul_(0.5).add_(0.01)
        after = compiled(inputs)
        assert not torch.allclose(after, before, rtol=1e-3)
        torch.testing.assert_close(after, model(inputs), rtol=1e-5, atol=1e-6)  # eager, same parameters


@pytest.mark.multiproc
def test_bf16_autocast_trains_digits_to_the_accuracy_goal(tmp_path: Path) -> None:
    train("precision=bf16", "device=cpu", "hydra.run.dir=run", cwd=tmp_path).check()
    records = epochs_of(tmp_path / "run")
    accuracy = [r["eval/accuracy"] for r in records[-3:]]
    assert sum(accuracy) / 3 >= 0.95  # the goal the README promises for `make train` (fp32)
    # Parameters stay float32: the saved model is the same plain float32 state dict.
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert {t.dtype for t in saved.values()} == {torch.float32}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("cadence", ("grad_accum=2", "batch_size=16", "compile_mode=reduce-overhead")),
        ("async", ("precision=bf16",)),
    ],
)
def test_compile_under_local_sgd(tmp_path: Path, policy: str, extra: tuple[str, ...]) -> None:
    # Sync's compiled DDP is checked against plain torch in test_sync_math.py. Cadence runs under a mode that
    # captures CUDA graphs on a GPU: its rounds must leave every tensor where it was (graph_storage.py).
    run_dir = tmp_path / "run"
    train(
        f"policy={policy}",
        "launch.nproc_per_node=2",
        FAST_START,
        "compile=true",
        "epochs=2",
        f"hydra.run.dir={run_dir}",
        *extra,
        cwd=tmp_path,
        timeout=500,
    ).check()
    assert not leftovers(tmp_path)
    first, second = epochs_of(run_dir)
    # Both ranks compiled in the first epoch; it is reported apart and kept out of the throughput.
    assert first["compile_s"] > 0 and second["compile_s"] == 0
    if policy == "cadence":  # an epoch barrier: samples over the epoch's time less the compilation
        expected = first["samples"] / (first["epoch_s"] - first["compile_s"])
        assert first["samples_per_s"] == pytest.approx(expected)
    else:  # async's rate is over the epoch's work window, which opens once a rank has compiled
        assert first["window_end"] - first["window_start"] < first["compile_s"]
    # Windows and ElChe count optimizer steps of 32 samples (grad_accum x batch_size).
    steps_per_epoch = 1437 // 32
    assert [sum(p["batches"] for p in r["per_rank"]) for r in (first, second)] == [steps_per_epoch] * 2
    assert second["samples"] == steps_per_epoch * 32
    assert second["eval_samples"] == second["eval_step"] * 32  # what the evaluated consensus trained on
    # Rounds updated the flat buffers in place, under the compiled model: the consensus learned.
    assert second["eval/accuracy"] >= 0.8


@pytest.mark.multiproc
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 needs CUDA")
def test_a_resumed_fp16_run_continues_with_the_same_scaler_state(tmp_path: Path) -> None:
    common = ["device=cuda", "precision=fp16", "checkpoint_every=2"]
    train("epochs=4", *common, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path).check()
    train("epochs=2", *common, f"hydra.run.dir={tmp_path / 'split'}", cwd=tmp_path).check()
    train("epochs=4", *common, f"hydra.run.dir={tmp_path / 'split'}", cwd=tmp_path).check()

    def scaler_at_epoch_3(run: str) -> dict:
        part = tmp_path / run / "checkpoints" / "epoch-000004" / "rank0.pt"  # after the 4th, as lines count
        return torch.load(part, weights_only=True)["stepper"]["scaler"]

    whole, split = scaler_at_epoch_3("whole"), scaler_at_epoch_3("split")
    # A fresh scaler in the second half would have counted only that half's steps since its last skip.
    assert split == whole
    assert whole["_growth_tracker"] > epochs_of(tmp_path / "whole")[1]["step"]
