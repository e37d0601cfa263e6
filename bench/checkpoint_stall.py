"""What a checkpoint at every round costs training: parts written at the boundary against parts written in the
background from a copy in host memory (`checkpoint_background`) by a thread or by a process of each rank's own
(`checkpoint_writer`), against no checkpoints at all.

    python bench/checkpoint_stall.py --cpu                 # digits, 2 CPU ranks
    python bench/checkpoint_stall.py --task gpt_nano       # one GPU
    python bench/checkpoint_stall.py --arms none,process   # only these arms

Cadence with pinned windows (every arm averages the same steps in the same rounds), a checkpoint due at every
round boundary (`checkpoint_every_s` of a microsecond: in the background, the next one is taken once the last
is committed, so the disk sets the pace). Each arm's steady throughput (the epochs after the first); arms
interleaved, `--repeat` passes, the median run counts. The stall per round is the time a round took beyond
the arm without checkpoints: rounds are the same in every arm, so it is the throughput ratio minus one, as a
share of a round; per checkpoint, that time over the checkpoints the run committed (counted in rank 0's log).

Across runs that comparison drifts with the machine: on one H200 the arm without checkpoints spread by up to
±12% between passes and machines, more than the effect, once with the checkpoint arms faster than none. So the
background arms also measure within each run: a window with a part written beside it (it starts at a
checkpoint's boundary) against a window without, median busy time per batch from the run's timeline,
the epochs after the first. That ratio minus one is what a checkpoint taken costs, as a share of a window
(a part is written within one); it leaves out the boundary's own copy (a few milliseconds, between windows).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchlib import environment_lines, results_path, run_flodl, steady_throughput, write_report

from flodl.metrics.timeline import read_timeline

ARMS = {
    "none": ("checkpoints off", ()),
    "boundary": ("a checkpoint every round, written at the boundary", ("checkpoint_background=false",)),
    "thread": (
        "a checkpoint every round, written in the background by a thread",
        ("checkpoint_background=true", "checkpoint_writer=thread"),
    ),
    "process": (
        "a checkpoint every round, written in the background by a process",
        ("checkpoint_background=true", "checkpoint_writer=process"),
    ),
}
# Arms whose parts are written beside the next window (at the boundary, between windows: none is).
BACKGROUND = ("thread", "process")
EVERY_ROUND = ("checkpoint_every_s=0.000001", "checkpoint_keep=2")


@dataclass(frozen=True)
class Run:
    samples_per_s: float
    rounds: int
    samples: int
    # Checkpoints committed in the measured epochs.
    checkpoints: int
    # Within the run (no drift between runs or machines): a window's time with a part being written beside it
    # over a window's time without, minus one (None: no window of each kind).
    within: float | None = None


def run_arm(arm: str, args: argparse.Namespace, work: Path, name: str) -> Run | None:
    anchor = args.anchor
    overrides = [
        f"task={args.task}",
        "policy=cadence",
        f"launch.nproc_per_node={args.ranks}",
        f"epochs={1 + args.epochs}",
        f"anchor={anchor}",
        f"min_anchor={anchor}",
        f"max_anchor={anchor}",
        "max_batch_diff=0",
        "eval_every=0",
        *(EVERY_ROUND if arm != "none" else ()),
        *ARMS[arm][1],
        *args.overrides,
    ]
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
        stall_within(work / name, log, records[0]["per_rank"][0], anchor) if arm in BACKGROUND else None,
    )


def stall_within(run_dir: Path, log: str, first: dict, anchor: int) -> float | None:
    """Each rank's windows in the measured epochs, split by whether a checkpoint's part is written beside
    them (the window starts at its boundary: rank 0's log names each point committed, `S samples into
    epoch N`); the median busy time per batch of the first kind over the second, minus one."""
    points = {
        (int(epoch) - 1, int(into))
        for epoch, into in re.findall(r" INFO checkpoint epoch (\d+), (\d+) samples into it", log)
    }
    spans = read_timeline(run_dir)["spans"]
    ranks = {span["rank"] for span in spans}
    round_samples = anchor * first["samples"] // first["batches"] * len(ranks)
    writing: list[float] = []
    quiet: list[float] = []
    for rank in ranks:
        for epoch in {span["epoch"] for span in spans} - {0}:
            own = [s for s in spans if s["rank"] == rank and s["epoch"] == epoch]
            own.sort(key=lambda s: s["start"])
            for index, span in enumerate(own):
                per_batch = (span["end"] - span["start"]) / span["batches"]
                (writing if (epoch, index * round_samples) in points else quiet).append(per_batch)
    if not writing or not quiet:
        return None
    return statistics.median(writing) / statistics.median(quiet) - 1


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
        "| per checkpoint | within runs: a window with a part written beside it (each pass) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in runs:
        words = ARMS[arm][0]
        if not runs[arm]:
            lines.append(f"| {words} | failed | | | | | | |")
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
        within = [r.within for r in runs[arm] if r.within is not None]
        within_words = (
            f"{statistics.median(within):+.1%} ({', '.join(f'{w:+.1%}' for w in within)})" if within else "—"
        )
        lines.append(
            f"| {words} | {run.samples_per_s:,.0f} ({each}) | {run.rounds} | {run.checkpoints} | "
            f"{round_ms:.2f} | {stall} | {per_checkpoint} | {within_words} |"
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
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("overrides", nargs="*", help="more overrides for every arm")
    args = parser.parse_args()
    args.ranks = args.ranks or (2 if args.cpu else 1)
    args.arms = args.arms.split(",")
    unknown = set(args.arms) - set(ARMS)
    if unknown or "none" not in args.arms:
        missing = ", ".join(sorted(unknown)) or "none"
        parser.error(f"--arms: {missing} (the arms are {', '.join(ARMS)}; none is always needed)")
    runs: dict[str, list[Run]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory(prefix="flodl-stall-") as tmp:
        for rep in range(args.repeat):
            for arm in args.arms:
                print(f"checkpoint_stall: pass {rep + 1}/{args.repeat}, {arm} ...", flush=True)
                run = run_arm(arm, args, Path(tmp), f"{arm}-{rep}")
                if run is not None:
                    runs[arm].append(run)
    write_report(results_path(args.results, f"checkpoint-stall-{args.task}", args.cpu), report(args, runs))


if __name__ == "__main__":
    main()
