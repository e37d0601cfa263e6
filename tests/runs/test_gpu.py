"""The same runs on GPUs: one GPU, and two ranks over NCCL (skipped without CUDA devices)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers.procs import leftovers, torchrun, train
from tests.helpers.runs import (
    assert_complete_run,
    epochs_of,
    fast_rank_share,
    final_accuracy,
    only_run_dir,
    rank0_line,
    run_policy,
)

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]
needs_one = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")


@needs_one
def test_one_gpu_run(tmp_path: Path) -> None:
    train(cwd=tmp_path).check()
    run_dir = only_run_dir(tmp_path / "outputs")
    records = assert_complete_run(run_dir, world=1, epochs=15)
    assert records[-1]["eval/accuracy"] >= 0.95
    assert_rank_on_gpu(run_dir / "rank0.log", rank=0, world=1)


def assert_rank_on_gpu(log: Path, rank: int, world: int = 2) -> None:
    """The rank's start line names its GPU and NCCL: `rank 1/2 (pid N) on cuda:1 (nccl), ...`."""
    assert re.search(rf"rank {rank}/{world} \(pid \d+\) on cuda:{rank} \(nccl\)", log.read_text()), log


@needs_two
@pytest.mark.parametrize("how", ["torchrun", "self-launch"])
def test_two_ranks_over_nccl(tmp_path: Path, how: str) -> None:
    if how == "torchrun":
        torchrun(2, "epochs=3", cwd=tmp_path).check()
    else:
        train("launch.nproc_per_node=2", "epochs=3", cwd=tmp_path).check()
    run_dir = only_run_dir(tmp_path / "outputs")
    records = assert_complete_run(run_dir, world=2, epochs=3)
    assert records[-1]["eval/accuracy"] >= 0.9
    for rank in (0, 1):
        assert_rank_on_gpu(run_dir / f"rank{rank}.log", rank)
    assert not leftovers(tmp_path)


@needs_one
def test_a_model_that_returns_its_loss_trains_under_cuda_graphs(tmp_path: Path) -> None:
    """GPT computes its loss inside the compiled forward (the chunked cross-entropy): under CUDA graphs that
    loss is the graph's output, which the next replay overwrites; the step must keep a copy of it."""
    overrides = (
        "task=gpt2_124m",
        "task.model.layers=1",
        "task.model.dim=64",
        "task.model.heads=2",
        "task.model.context=64",
        "task.model.vocab=512",
        "task.model.loss_chunk=256",
        "task.train_data.vocab_size=500",
        "task.train_data.max_bytes=400000",
        "task.train_data.tokenizer_bytes=400000",
        "task.eval_data.max_bytes=100000",
        f"task.train_data.cache_dir={tmp_path / 'bpe'}",
        "batch_size=8",
        "epochs=2",
        "compile=true",
        "compile_mode=reduce-overhead",
    )
    train(*overrides, cwd=tmp_path, timeout=600).check()
    records = epochs_of(only_run_dir(tmp_path / "outputs"))
    assert [r["epoch"] for r in records] == [0, 1] and records[-1]["loss"] < records[0]["loss"]


@needs_one
def test_more_nccl_ranks_than_gpus_is_refused(tmp_path: Path) -> None:
    result = train(f"launch.nproc_per_node={GPUS + 1}", cwd=tmp_path)
    assert result.code == 2
    assert f"this host runs {GPUS + 1} ranks on {GPUS} visible GPU(s)" in result.out


@needs_two
@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_local_sgd_over_nccl_balances_a_slowed_rank(tmp_path: Path, policy: str) -> None:
    records = run_policy(
        tmp_path, policy, "simulate.slow_rank=1", "simulate.factor=3", "launch.start_method=spawn"
    )
    assert fast_rank_share(records) == pytest.approx(0.75, rel=0.15)
    assert final_accuracy(records) >= 0.95
    assert_rank_on_gpu(tmp_path / policy / "rank1.log", 1)


@needs_two
@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("async", ("backend=cpu", "bf16_wire=true")),  # pinned snapshots, copy stream, gloo thread
        ("cadence", ("bf16_wire=true", "outer=diloco")),  # bf16 deltas gathered over NCCL
        ("sync", ("bf16_wire=true",)),  # DDP with the bf16 gradient hook over NCCL
    ],
)
def test_averaging_backends_on_gpus(tmp_path: Path, policy: str, extra: tuple[str, ...]) -> None:
    records = run_policy(tmp_path, policy, *extra, "launch.start_method=spawn", "epochs=8")
    assert final_accuracy(records) >= 0.9
    assert records[-1]["comm_bytes_total"] > 0


@needs_two
def test_slots_launcher_gives_concurrent_jobs_disjoint_gpus(tmp_path: Path) -> None:
    sweep = ("-m", "hydra/launcher=slots", "seed=0,1", "epochs=3", "launch.nproc_per_node=1")
    train(*sweep, "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=300).check()
    recorded = [rank0_line(tmp_path / "sweep" / str(i)) for i in range(2)]
    assert sorted(visible for _, _, visible in recorded) == ["0", "1"]


@needs_two
@pytest.mark.parametrize(("policy", "end"), [("sync", "the last epoch"), ("cadence", "final round")])
def test_survivors_over_nccl_abort_go_on_and_heal_a_restart(tmp_path: Path, policy: str, end: str) -> None:
    """fault_tolerance=survive on NCCL: rank 1 SIGKILLed mid-window; rank 0's pending collective is released
    by the communicator's abort (no watchdog crash), it trains on alone, and the restart is admitted back."""
    result = train(
        "launch.nproc_per_node=2",
        "launch.start_method=spawn",
        "fault_tolerance=survive",
        f"policy={policy}",
        "heartbeat_timeout_s=2",
        "epochs=200",
        "eval_every=20",
        "simulate.kill_rank=1",
        "simulate.kill_at_step=30",
        "launch.max_restarts=1",
        "hydra.run.dir=run",
        cwd=tmp_path,
        timeout=400,
    )
    result.check()
    assert "Watchdog caught collective operation timeout" not in result.out
    assert "rank 1 cut out" in result.out and "rank 1 admitted" in result.out
    states = dict(re.findall(rf"rank (\d+): state after {end}[^:]*: ([0-9a-f]+)", result.out))
    assert set(states) == {"0", "1"} and len(set(states.values())) == 1, states
    assert_complete_run(tmp_path / "run", world=2, epochs=200)


# Two ranks (run_policy's) sharing GPU 0 over gloo (backend=cpu): what a one-GPU machine can compare.
SHARED_GPU = (
    "launch.nproc_per_node=2",
    "launch.start_method=spawn",
    "backend=cpu",
    "device=cuda",
    "epochs=3",
)
# Cadence's windows pinned (equal, fixed counts) so that two runs average the same steps.
PINNED = ("anchor=8", "min_anchor=8", "max_anchor=8", "max_batch_diff=0")


def _final_state(tmp_path: Path, name: str, *overrides: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    records = run_policy(tmp_path / name, overrides[0], *SHARED_GPU, "compile=true", *overrides[1:])
    return torch.load(tmp_path / name / overrides[0] / "model.pt", weights_only=True), records


@needs_one
@pytest.mark.parametrize(
    ("policy", "extra"),
    [("cadence", PINNED), ("cadence", (*PINNED, "grad_accum=2", "batch_size=16")), ("sync", ())],
    ids=["cadence", "cadence-grad-accum", "sync"],
)
def test_cuda_graphs_train_what_the_same_kernels_train_without_them(
    tmp_path: Path, policy: str, extra: tuple[str, ...]
) -> None:
    """compile_mode=reduce-overhead (CUDA graphs replayed) against compile_mode=default (the same generated
    kernels, launched one by one), same seed: every round's consensus, sync's DDP and grad_accum write into
    the captured parameters, so both end with the same model (a rebound parameter would leave the graphs
    training a stale copy; graph_storage.py stops such a run). Eager (other kernels) ends close."""
    graphs, records = _final_state(tmp_path, "graphs", policy, "compile_mode=reduce-overhead", *extra)
    kernels, _ = _final_state(tmp_path, "kernels", policy, "compile_mode=default", *extra)
    for name, tensor in graphs.items():
        assert torch.allclose(tensor, kernels[name], rtol=1e-5, atol=1e-6), name
    assert final_accuracy(records) >= 0.8


@needs_one
def test_async_with_cuda_graphs_learns_as_eager_does(tmp_path: Path) -> None:
    """Async's rounds land whenever a rank's steps allow (timing decides what is averaged): under CUDA graphs
    it must learn as the eager run does, its in-place rounds checked by graph_storage.py."""
    graphs = run_policy(
        tmp_path / "graphs", "async", *SHARED_GPU, "compile=true", "compile_mode=reduce-overhead"
    )
    eager = run_policy(tmp_path / "eager", "async", *SHARED_GPU)
    assert final_accuracy(graphs) >= final_accuracy(eager) - 0.03
