"""What a checkpoint at every round costs training: parts written at the boundary against parts written in the
background from a copy in host memory (`checkpoint_background`), against no checkpoints at all.

    python bench/checkpoint_stall.py --cpu                 # digits, 2 CPU ranks
    python bench/checkpoint_stall.py --task gpt_nano       # one GPU

Cadence with pinned windows (every arm averages the same steps in the same rounds), a checkpoint due at every
round boundary (`checkpoint_every_s` of a microsecond: in the background, the next one is taken once the last
is committed, so the disk sets the pace). Each arm's steady throughput (the epochs after the first); arms
interleaved, `--repeat` passes, the median run counts. The stall per round is the time a round took beyond
the arm without checkpoints: rounds are the same in every arm, so it is the throughput ratio minus one, as a
share of a round; per checkpoint, that time over the checkpoints the run committed (counted in rank 0's log).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchlib import environment_lines, results_path, run_flodl, steady_throughput, write_report

ARMS = {
    "none": ("checkpoints off", ()),
    "boundary": ("a checkpoint every round, written at the boundary", ("checkpoint_background=false",)),
    "background": ("a checkpoint every round, written in the background", ("checkpoint_background=true",)),
}
EVERY_ROUND = ("checkpoint_every_s=0.000001", "checkpoint_keep=2")


@dataclass(frozen=True)
class Run:
    samples_per_s: float
    rounds: int
    samples: int
    # Checkpoints committed in the measured epochs.
    checkpoints: int


def run_arm(arm: str, args: argparse.Namespace, work: Path, name: str) -> Run | None:
    anchor = args.anchor
    overrides = [
        f"task={args.task}",
        "policy=cadence",
        f"launch.nproc_per_node={args.ranks}",
        f"epochs={1 + args.epochs}",
        f"anchor={anchor}", f"min_anchor={anchor}", f"max_anchor={anchor}", "max_batch_diff=0",
        "eval_every=0",
        *(EVERY_ROUND if arm != "none" else ()),
        *ARMS[arm][1],
        *args.overrides,
    ]  # fmt: skip
    if args.cpu:
        overrides += ["device=cpu", "launch.start_method=fork"]
    records = run_flodl(overrides, work / name, args.timeout)
    if records is None:
        return None
    measured = records[1:]
    log = (work / name / "rank0.log").read_text()
    committed = sum(int(e) > 1 for e in re.findall(r" INFO checkpoint (?:after )?epoch (\d+)", log))
    return Run(
        steady_throughput(records, skip=1),
        sum(r["rounds"] for r in measured),
        sum(r["samples"] for r in measured),
        committed,
    )


def median(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.samples_per_s)[len(runs) // 2]


def report(args: argparse.Namespace, runs: dict[str, list[Run]]) -> str:
    base = median(runs["none"]) if runs["none"] else None
    lines = [
        f"## checkpoint stall: {args.task}, {args.ranks} rank(s), cadence anchor {args.anchor}, "
        f"{args.epochs} measured epochs",
        "",
        *environment_lines(args.cpu),
        f"- command: `python bench/checkpoint_stall.py {' '.join(sys.argv[1:])}`",
        f"- {args.repeat} interleaved pass(es); the median run of each arm",
        "",
        "| arm | samples/s (each pass) | rounds | checkpoints | ms per round | stall per round "
        "| per checkpoint |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, (words, _) in ARMS.items():
        if not runs[arm]:
            lines.append(f"| {words} | failed | | | | | |")
            continue
        run = median(runs[arm])
        each = ", ".join(f"{r.samples_per_s:,.0f}" for r in runs[arm])
        round_ms = 1000 * run.samples / run.samples_per_s / max(run.rounds, 1)
        stall = per_checkpoint = "—"
        if base is not None and arm != "none":
            base_ms = 1000 * base.samples / base.samples_per_s / max(base.rounds, 1)
            stall = f"{round_ms - base_ms:+.2f} ms ({(round_ms - base_ms) / base_ms:+.1%} of a round)"
            lost_ms = (round_ms - base_ms) * run.rounds / max(run.checkpoints, 1)
            per_checkpoint = f"{lost_ms:+.2f} ms ({lost_ms / base_ms:+.1%} of a round)"
        lines.append(
            f"| {words} | {run.samples_per_s:,.0f} ({each}) | {run.rounds} | {run.checkpoints} | "
            f"{round_ms:.2f} | {stall} | {per_checkpoint} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="digits")
    parser.add_argument("--cpu", action="store_true", help="device=cpu (and the CPU's name in the results)")
    parser.add_argument("--ranks", type=int, default=None, help="default: 2 on CPU, 1 on a GPU")
    parser.add_argument("--anchor", type=int, default=20, help="batches per window (pinned)")
    parser.add_argument("--epochs", type=int, default=4, help="measured epochs, after one more")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("overrides", nargs="*", help="more overrides for every arm")
    args = parser.parse_args()
    args.ranks = args.ranks or (2 if args.cpu else 1)
    runs: dict[str, list[Run]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="flodl-stall-") as tmp:
        for rep in range(args.repeat):
            for arm in ARMS:
                print(f"checkpoint_stall: pass {rep + 1}/{args.repeat}, {arm} ...", flush=True)
                run = run_arm(arm, args, Path(tmp), f"{arm}-{rep}")
                if run is not None:
                    runs[arm].append(run)
    write_report(results_path(args.results, f"checkpoint-stall-{args.task}", args.cpu), report(args, runs))


if __name__ == "__main__":
    main()
