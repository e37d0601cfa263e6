"""Step throughput of sharded groups under cadence and async, with each round per shard index inline on the
training thread (backend=nccl: gloo without a GPU) against on the host averager's thread (backend=cpu), and
cadence's overlap_rounds=true, side by side (docs/sharded-groups.md, "Rounds on the host's thread").

`world` gloo ranks on the CPU as groups of `k`, the digits MLP widened (`--hidden`) so that a round carries
a shard worth sending, windows pinned at `--window` batches (no guard), so every arm runs the same rounds.
The arms run in turn, `--repeats` times (interleaved: the machine's load falls on every arm alike); the
steady throughput (the epochs after the first, flodl's own per-epoch clock) and each rank's time held up
by rounds are the medians over the repeats. Writes bench/results/.

    python bench/sharded_rounds.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchlib import environment_lines, results_path, run_flodl, steady_throughput, write_report

from tests.helpers.procs import FAST_START

ARMS = {
    "cadence, inline": ("policy=cadence", "backend=nccl"),
    "cadence, on the thread": ("policy=cadence", "backend=cpu"),
    "cadence, on the thread, overlap_rounds": ("policy=cadence", "backend=cpu", "overlap_rounds=true"),
    "async, inline": ("policy=async", "backend=nccl"),
    "async, on the thread": ("policy=async", "backend=cpu"),
}


def overrides(args: argparse.Namespace) -> list[str]:
    window = args.window
    return [
        f"launch.nproc_per_node={args.world}",
        FAST_START,
        "device=cpu",
        f"shard_group={args.k}",
        f"task.model.hidden={args.hidden}",
        f"batch_size={args.batch}",
        f"epochs={args.epochs}",
        "eval_every=0",
        "checkpoint_every=null",
        f"anchor={window}",
        f"min_anchor={window}",
        f"max_anchor={window}",
        "max_batch_diff=0",
        "divergence_guard=none",
    ]


def measure(records: list[dict], asynchronous: bool) -> tuple[float, float, float]:
    """Steady samples/s; per rank and round, the ms a round held up training and the steps trained while one
    was in flight (the ranks' mean)."""
    rate = steady_throughput(records, skip=1, overlapping=asynchronous)
    rounds = sum(r["rounds"] for r in records) or 1
    ranks = len(records[0]["per_rank"])
    blocked = sum(p["averaging_blocked_ms"] for r in records for p in r["per_rank"]) / ranks / rounds
    during = sum(p["steps_during_averaging"] for r in records for p in r["per_rank"]) / ranks / rounds
    return rate, blocked, during


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    seen: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, arm in ARMS.items():
                run_dir = Path(tmp) / f"{len(seen[name])}-{repeat}-{name.replace(' ', '').replace(',', '-')}"
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                records = run_flodl([*overrides(args), *arm], run_dir, timeout=600)
                if records is not None:
                    seen[name].append(measure(records, "policy=async" in arm))
    params = 64 * args.hidden + args.hidden + args.hidden * 10 + 10
    lines = [
        f"## Sharded groups' rounds inline or on the host's thread: {args.world} ranks, groups of {args.k}",
        "",
        *environment_lines(cpu=True),
        f"- digits MLP, hidden {args.hidden} ({params:,} parameters, {params * 4 / args.k / 1e6:.2f} MB a "
        "shard), "
        f"batch {args.batch} a rank, windows of {args.window}, {args.epochs} epochs (the first skipped), "
        f"medians of {args.repeats} interleaved repeats",
        "",
        "| arm | samples/s | per run | round held up training (ms) | steps trained during a round |",
        "|---|---|---|---|---|",
    ]
    for name, runs in seen.items():
        if not runs:
            lines.append(f"| {name} | failed | | | |")
            continue
        rate, blocked, during = (statistics.median(run[i] for run in runs) for i in range(3))
        each = ", ".join(f"{run[0]:.0f}" for run in runs)
        lines.append(f"| {name} | {rate:.0f} | {each} | {blocked:.1f} | {during:.1f} |")
    write_report(results_path(args.results_dir, "sharded-rounds", cpu=True), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
