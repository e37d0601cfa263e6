"""Real-data convergence: wall time for each policy to reach sync's final eval loss, in one run.

    python bench/charlm_convergence.py                 # 2 GPUs, task=charlm (GPT-nano on the stdlib's *.py)
    python bench/charlm_convergence.py --quick
    python bench/charlm_convergence.py --link slow     # NCCL's network transport (~ between hosts)
    python bench/charlm_convergence.py --cpu-smoke     # tiny model and corpus on CPU (gloo)

sync trains --epochs epochs; cadence and async get --extra times as many, so they can reach sync's final
eval loss even if they need more samples. Each run's eval loss after every epoch is placed at the run's
cumulative wall time (the sum of epoch_s in metrics.jsonl, from the run's start: start-up, training and
eval included, the same for every policy); the time to reach sync's final loss is interpolated linearly
between the two epochs that straddle it (before the first eval: from ln 256, the loss of a uniform guess,
at time 0). Prints a table and the ratio best(cadence, async) / sync against the goal (<= 0.75), and
appends them to bench/results/<date>-charlm-<hardware>.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

from benchlib import (
    REPO,
    SLOW_LINK_ENV,
    TINY_GPT,
    environment_lines,
    first_reach,
    results_path,
    run_flodl,
    steady_throughput,
    write_report,
)

POLICIES = ("sync", "cadence", "async")
GOAL = 0.75
SMOKE_OVERRIDES = [
    *TINY_GPT,
    "batch_size=8",
    "task.train_data.max_bytes=40000",
    "task.eval_data.max_bytes=8000",
    "device=cpu",
    "launch.start_method=fork",
]


def curve(records: list[dict]) -> list[tuple[float, float]]:
    """(cumulative wall seconds, eval loss) after each evaluated epoch."""
    points, elapsed, latest = [], 0.0, 0.0
    for record in records:
        elapsed += record["epoch_s"]  # the epoch's completion since the run's start
        # Under async an epoch may complete before the one ahead of it; its eval is not known any earlier.
        latest = max(latest, elapsed)
        if "eval/loss" in record:
            points.append((latest, record["eval/loss"]))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--epochs", type=int, default=None, help="sync's epochs (default 6, quick 3, smoke 2)"
    )
    parser.add_argument("--extra", type=float, default=1.5, help="cadence / async epochs = extra x sync's")
    parser.add_argument(
        "--max-mb", type=float, default=None, help="training text cap in MB (default 8, quick 4)"
    )
    parser.add_argument("--policies", default=",".join(POLICIES), help="sync and any of cadence, async")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--link", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model and corpus on CPU (gloo)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default 600, smoke 120)"
    )
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    policies = args.policies.split(",")
    if policies[0] != "sync" or not set(policies[1:]) <= {"cadence", "async"} or len(policies) < 2:
        parser.error("--policies: sync first, then cadence and/or async")

    sync_epochs = args.epochs or (2 if args.cpu_smoke else 3 if args.quick else 6)
    overrides = ["task=charlm", f"launch.nproc_per_node={args.nproc}", "eval_every=1"]
    if args.cpu_smoke:
        overrides += SMOKE_OVERRIDES
    else:
        megabytes = args.max_mb or (4.0 if args.quick else 8.0)
        overrides.append(f"task.train_data.max_bytes={int(megabytes * 1e6)}")
    overrides += args.overrides
    timeout = args.timeout or (120 if args.cpu_smoke else 600)
    env = dict(SLOW_LINK_ENV) if args.link == "slow" else None

    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="flodl-charlm-") as tmp:
        for policy in policies:
            epochs = sync_epochs if policy == "sync" else math.ceil(sync_epochs * args.extra)
            print(f"charlm: {policy}, {epochs} epochs ...", flush=True)
            records = run_flodl(
                [*overrides, f"policy={policy}", f"epochs={epochs}"], Path(tmp) / policy, timeout, env
            )
            if records is not None:
                runs[policy] = records
    if "sync" not in runs:
        raise SystemExit("charlm: the sync run failed, so there is no target loss (see above)")

    target = curve(runs["sync"])[-1][1]
    lines = [
        "# Char-LM convergence: GPT-nano on the Python standard library",
        "",
        *environment_lines(args.cpu_smoke),
        f"- command: `{' '.join(['python', *sys.argv])}`",
        f"- ranks: {args.nproc}; sync {sync_epochs} epochs, cadence / async up to "
        f"{math.ceil(sync_epochs * args.extra)}; overrides: `{' '.join(overrides)}`",
        f"- link: {args.link}" + (f" ({' '.join(f'{k}={v}' for k, v in env.items())})" if env else ""),
        f"- target: sync's final eval loss {target:.4f} nats/byte",
        "",
        "| policy | epochs | samples/s (epochs 2+) | final eval loss | eval loss per epoch "
        "| wall s to target | vs sync |",
        "|---|---|---|---|---|---|---|",
    ]
    reached: dict[str, float | None] = {}
    for policy, records in runs.items():
        points = curve(records)
        reached[policy] = first_reach(points, target)
        when = reached[policy]
        vs = "—" if when is None or reached.get("sync") is None else f"{when / reached['sync']:.3f}"
        losses = " ".join(f"{loss:.3f}" for _, loss in points)
        rate = steady_throughput(records, 1, overlapping=policy == "async")
        lines.append(
            f"| {policy} | {len(records)} | {rate:,.0f} | {points[-1][1]:.4f} "
            f"| {losses} | {'not reached' if when is None else f'{when:.1f}'} | {vs} |"
        )
    local = [reached[p] for p in ("cadence", "async") if reached.get(p) is not None]
    missing = [p for p in policies if p not in runs]
    ratio = min(local) / reached["sync"] if local and reached["sync"] else None
    verdict = "not measured" if ratio is None else "met" if ratio <= GOAL else "**MISSED**"
    lines += [
        "",
        "| measure | value | goal (issue 9) | verdict |",
        "|---|---|---|---|",
        f"| wall time to sync's final eval loss: best of cadence/async / sync | "
        f"{'—' if ratio is None else f'{ratio:.3f}'} | ≤ {GOAL} | {verdict} |",
    ]
    if missing:
        lines.append(f"\nFailed runs: {', '.join(missing)} (see the output above).")
    name = "charlm" if args.link == "nvlink" else "charlm-slow"
    write_report(results_path(args.results_dir, name, args.cpu_smoke), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
