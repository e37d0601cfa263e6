"""What a finished flodl run left behind: its run dir, its epoch records, the checks every run must pass."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.procs import leftovers, train

# The digits MLP's parameters, as model.pt names them.
MODEL_KEYS = {f"net.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}


def only_run_dir(root: Path) -> Path:
    dirs = [p.parent for p in root.rglob("metrics.jsonl")]
    assert len(dirs) == 1, f"expected one run dir under {root}, found {dirs}"
    return dirs[0]


def _not_json(name: str) -> None:
    raise ValueError(f"metrics.jsonl holds {name}, which is not JSON")


def epochs_of(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl, each line strict JSON (NaN and Infinity refused)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=_not_json) for line in lines]


def assert_complete_run(run_dir: Path, world: int, epochs: int) -> list[dict]:
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    records = epochs_of(run_dir)
    assert [r["epoch"] for r in records] == list(range(epochs))
    assert all(len(r["per_rank"]) == world for r in records)
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert set(state) == MODEL_KEYS
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state.values())
    for rank in range(world):
        assert f"r{rank}] " in (run_dir / f"rank{rank}.log").read_text()  # [rN] or [host:rN]
    assert not (run_dir / f"rank{world}.log").exists()
    return records


def run_policy(tmp_path: Path, policy: str, *extra: str) -> list[dict]:
    """One 2-rank self-launched run of `policy` in tmp_path/policy; its epoch records."""
    run_dir = tmp_path / policy
    tmp_path.mkdir(parents=True, exist_ok=True)
    train(
        f"policy={policy}",
        "launch.nproc_per_node=2",
        f"hydra.run.dir={run_dir}",
        *extra,
        cwd=tmp_path,
        timeout=240,
    ).check()
    assert not leftovers(tmp_path)
    return epochs_of(run_dir)


def fast_rank_share(records: list[dict]) -> float:
    """Rank 0's share of the batches, after the first two epochs of calibration."""
    fast = sum(r["per_rank"][0]["batches"] for r in records[2:])
    slow = sum(r["per_rank"][1]["batches"] for r in records[2:])
    return fast / (fast + slow)


def fast_rank_speed_share(records: list[dict]) -> float:
    """Rank 0's share of the two ranks' own speeds (samples over their busy time), after the first two
    epochs: the share of the batches a balancer that knows their speeds gives it."""
    fast = sum(r["per_rank"][0]["samples_per_s"] for r in records[2:])
    slow = sum(r["per_rank"][1]["samples_per_s"] for r in records[2:])
    return fast / (fast + slow)


def final_accuracy(records: list[dict]) -> float:
    """Mean test accuracy of the last three evaluated epochs (one epoch is noisy on 359 images)."""
    evaluated = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return sum(evaluated[-3:]) / len(evaluated[-3:])


def rank0_line(job: Path) -> tuple[str, str, str]:
    """(start time, master port, CUDA_VISIBLE_DEVICES) as the job's rank 0 recorded them."""
    first = (job / "rank0.log").read_text().splitlines()[0]
    port = first.split("master port ")[1].split(",")[0]
    visible = first.split("CUDA_VISIBLE_DEVICES=")[1].split(",")[0]
    return first[:23], port, visible


def round_steps(run: Path) -> list[dict[int, int]]:
    """Each round's steps per rank, as the run's timeline recorded them."""
    entries = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    rounds = [{int(r): n for r, n in e["steps"].items()} for e in entries if e["kind"] == "round"]
    assert rounds
    return rounds
