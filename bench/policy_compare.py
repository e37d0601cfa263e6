"""Side by side, in one run: every policy on the same task and ranks, with an optional slowed rank.

    python bench/policy_compare.py --nproc 2 --slow-factor 3 -- epochs=10 task.model.hidden=1024

Prints a table (throughput, ratio to sync, fast-rank batch share, final eval accuracy) and writes it to
bench/results/<date>-policies-<hardware>.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from benchlib import steady_throughput

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("sync", "cadence", "async")


def run(policy: str, nproc: int, slow_factor: float, overrides: list[str], out: Path) -> list[dict]:
    run_dir = out / policy
    args = [sys.executable, str(REPO / "train.py"), f"policy={policy}", f"launch.nproc_per_node={nproc}"]
    if slow_factor > 1:
        args += [f"simulate.slow_rank={nproc - 1}", f"simulate.factor={slow_factor}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*args, f"hydra.run.dir={run_dir}", *overrides], check=True, env=env, cwd=out)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(policy: str, records: list[dict]) -> dict[str, float]:
    steady = records[2:] or records
    batches = [sum(r["per_rank"][k]["batches"] for r in steady) for k in range(len(steady[0]["per_rank"]))]
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    return {
        "samples_per_s": steady_throughput(records, 2, overlapping=policy == "async"),
        "fast_share": batches[0] / sum(batches),
        "accuracy": accuracy[-1] if accuracy else float("nan"),
    }


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--slow-factor", type=float, default=1.0)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            p: summarize(p, run(p, args.nproc, args.slow_factor, args.overrides, Path(tmp))) for p in POLICIES
        }
    base = results["sync"]["samples_per_s"]
    lines = [
        f"# Policies side by side — {dt.date.today()}",
        "",
        f"- hardware: {hardware()}; torch {torch.__version__}",
        f"- ranks: {args.nproc}; slowed rank: {args.nproc - 1 if args.slow_factor > 1 else 'none'} "
        f"(factor {args.slow_factor}); overrides: `{' '.join(args.overrides) or '(none)'}`",
        "- throughput over epochs 3+ (after calibration), samples/s across all ranks",
        "",
        "| policy | samples/s | vs sync | rank 0 batch share | final eval accuracy |",
        "|---|---|---|---|---|",
    ]
    for policy, r in results.items():
        lines.append(
            f"| {policy} | {r['samples_per_s']:.0f} | {r['samples_per_s'] / base:.2f} | "
            f"{r['fast_share']:.3f} | {r['accuracy']:.4f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    tag = hardware().replace(" ", "-").replace("/", "-")
    out = REPO / "bench" / "results" / f"{dt.date.today()}-policies-{tag}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(report + "\n")


if __name__ == "__main__":
    main()
