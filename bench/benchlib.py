"""Shared by the benchmark scripts: the machine's description, flodl runs as subprocesses, throughput."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the process runner is the tests' (tests/helpers/procs.py)

from flodl.metrics.aggregate import WorkSpan, common_window_rate  # noqa: E402
from tests.helpers.procs import TRAIN, Result, child_env, finish, start  # noqa: E402

# NCCL's network transport over loopback (~3.5 GB/s on 2x H200): stands for training across hosts.
SLOW_LINK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
# The GPT of every smoke run (charlm and the GPT tasks): the same code paths in seconds on a CPU.
TINY_GPT = ("task.model.layers=1", "task.model.dim=32", "task.model.heads=2", "task.model.context=32")


def hardware(cpu: bool = False) -> str:
    if torch.cuda.is_available() and not cpu:
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def environment_lines(cpu: bool = False) -> list[str]:
    """Markdown bullet lines: date, hardware, torch / CUDA / NCCL versions."""
    versions = f"torch {torch.__version__}"
    if torch.cuda.is_available() and not cpu:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        versions += f", CUDA {torch.version.cuda}, NCCL {nccl}"
    return [f"- date: {dt.datetime.now():%Y-%m-%d %H:%M}", f"- hardware: {hardware(cpu)}", f"- {versions}"]


# A uniform guess over bytes: the char-LM's eval loss before training (small init), where its curves start.
UNIFORM_BYTE_LOSS = math.log(256)


def first_reach(
    points: list[tuple[float, float]], target: float, start: tuple[float, float] = (0.0, UNIFORM_BYTE_LOSS)
) -> float | None:
    """The first x at which the loss of (x, loss) `points` reaches `target`, linear between points (and from
    `start` before the first); None if it never does."""
    previous = start
    for x, loss in points:
        if loss <= target:
            x0, l0 = previous
            return x if l0 <= loss else x0 + (x - x0) * (l0 - target) / (l0 - loss)
        previous = (x, loss)
    return None


def results_path(results_dir: Path, name: str, cpu: bool = False, machine: str | None = None) -> Path:
    """`machine`: the hardware the results came from, when not this one (a report on runs made elsewhere)."""
    tag = (machine or hardware(cpu)).replace(" ", "-").replace("/", "-").replace("(", "").replace(")", "")
    return results_dir / f"{dt.date.today()}-{name}-{tag}.md"


def write_report(path: Path, text: str) -> None:
    """Print the report and append it to `path` (one file per day collects that day's runs)."""
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(text + "\n")


def run_child(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> Result:
    """Run `args` in its own process group; on timeout the whole group (launcher and ranks) is killed."""
    # The caller's OpenMP setting stands here (the tests pin one thread).
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = finish(start(args, cwd, child_env(**{**threads, **(env or {})})), timeout)
    if result.timed_out:
        result.out += f"\n[timed out after {timeout:.0f}s]"
    return result


def run_flodl(
    overrides: list[str], run_dir: Path, timeout: float, env: dict[str, str] | None = None
) -> list[dict] | None:
    """One flodl run through its CLI; its metrics.jsonl records, or None (the output tail is printed)."""
    args = [sys.executable, TRAIN, *overrides, "logger.log_every=0", f"hydra.run.dir={run_dir}"]
    outcome = run_child(args, run_dir.parent, timeout, env)
    metrics = run_dir / "metrics.jsonl"
    if not outcome.ok or not metrics.exists():
        print(f"FAILED: {' '.join(args)}\n{outcome.out[-4000:]}", file=sys.stderr)
        return None
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def steady_throughput(records: list[dict], skip: int, overlapping: bool = False) -> float:
    """Samples/s over the epochs after the first `skip` (start-up, CUDA warm-up, ElChe calibration).

    With an epoch barrier (sync, cadence) the window runs from the latest completion among the skipped
    epochs to the latest completion of all (the running sum of epoch_s is each epoch's completion since
    the start). `overlapping` (async, no barrier): a rank trains the measured epochs' batches before the
    skipped ones complete, so that window would count work done before it opened; the window is instead the
    measured epochs' own work on the ranks' clocks (see flodl.metrics.aggregate.common_window_rate).
    """
    skip = min(skip, len(records) - 1)
    if overlapping:
        spans = [
            WorkSpan(p["rank"], r["window_start"], r["window_end"], p["samples"], p["busy_s"])
            for r in records[skip:]
            for p in r["per_rank"]
        ]
        return common_window_rate(spans)
    done = list(itertools.accumulate(r["epoch_s"] for r in records))
    start = max(done[:skip], default=0.0)
    return sum(r["samples"] for r in records[skip:]) / (max(done) - start)
