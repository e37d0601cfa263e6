"""fault_tolerance=survive under real kills: how long the survivors take to go on, and what they keep.

Two runs of one self-launched 2-rank job (`--policy`, cadence by default), rank 1 SIGKILLed from outside:
1. kills: rank 1's current process is killed every `--every-s` seconds, `--kills` times, each time
   restarted by the supervisor and admitted back. Per event, from the run's timeline: detection (kill ->
   cut, bounded by heartbeat_timeout_s), release of the survivors' collective, forming the new group, the
   first good round after the cut; per admission: the restart's start-up, its wait for a round boundary,
   forming and the first round with it.
2. throughput: rank 1 killed once, not restarted, after `--before` epochs: epoch samples/s with one rank
   left against (survivors / world) x samples/s of the epochs before.

    python bench/survive.py                                  # task=resnet on the GPUs
    python bench/survive.py --cpu --kills 3 -- task=digits   # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import time
from pathlib import Path

import psutil
from benchlib import REPO, environment_lines, results_path, write_report

from tests.helpers.procs import PYTHON, TRAIN, child_env, finish, kill_group, start


def rank_process(run: Path, rank: int) -> psutil.Process | None:
    """The live process of `rank`: the last start its log names (a restart appends to the same log)."""
    log = run / f"rank{rank}.log"
    starts = re.findall(rf"rank {rank}/\d+ \(pid (\d+)\)", log.read_text()) if log.exists() else []
    if not starts:
        return None
    try:
        process = psutil.Process(int(starts[-1]))
        return process if process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def epochs_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def launch(work: Path, name: str, overrides: list[str], timeout: float, kills: int, every_s: float,
           kill_after_epochs: int | None) -> tuple[Path, list[float]]:  # fmt: skip
    """Run the job, killing rank 1 from outside; the run dir and the kills' wall times (the job's output is
    kept beside the run dir)."""
    run = work / name
    args = [PYTHON, TRAIN, *overrides, f"hydra.run.dir={run}"]
    proc = start(args, cwd=work, env=child_env())
    killed: list[float] = []
    deadline = time.time() + timeout
    try:
        next_kill = time.time() + every_s
        while proc.poll() is None and time.time() < deadline and len(killed) < kills:
            time.sleep(0.2)
            due = (
                epochs_done(run) >= kill_after_epochs
                if kill_after_epochs is not None
                else time.time() >= next_kill
            )
            target = rank_process(run, 1) if due else None
            if target is not None:
                target.send_signal(signal.SIGKILL)
                killed.append(time.time())
                next_kill = time.time() + every_s
        if kill_after_epochs is None:  # let the last restart be admitted, then stop the run where it is
            time.sleep(every_s)
            proc.send_signal(signal.SIGTERM)
        result = finish(proc, max(deadline - time.time(), 30))
        (work / f"{name}.out").write_text(result.out)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    return run, killed


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def kill_report(run: Path, killed: list[float]) -> list[str]:
    events = json.loads((run / "timeline.json").read_text())["membership"]
    cuts = [e for e in events if e["event"] == "rank_cut"]
    admits = [e for e in events if e["event"] == "rank_admitted"]
    # Each cut follows one kill: the kill closest before it.
    detect = [
        c["at"] - max(k for k in killed if k <= c["at"]) for c in cuts if any(k <= c["at"] for k in killed)
    ]
    lines = [
        f"- kills: {len(killed)}, cuts: {len(cuts)}, admissions: {len(admits)}",
        "",
        "| step (s, median) | cut (survivors go on) | admission (restart back in) |",
        "|---|---|---|",
        f"| kill -> detected | {median(detect)} | - |",
        f"| restart's start-up | - | {median([a['startup_s'] for a in admits])} |",
        f"| waited for a round boundary | - | {median([a['waited_s'] for a in admits])} |",
        f"| collective released (max over members) | {median([c['release_ms'] / 1000 for c in cuts])} | - |",
        f"| group formed (max over members) | {median([c['form_ms'] / 1000 for c in cuts])} | "
        f"{median([a['form_ms'] / 1000 for a in admits])} |",
        f"| detection/admission -> group re-formed | {median([c['formed_s'] for c in cuts])} | "
        f"{median([a['formed_s'] for a in admits])} |",
        f"| detection/admission -> first good round | {median([c['first_round_s'] for c in cuts])} | "
        f"{median([a['first_round_s'] for a in admits])} |",
        "",
        "why each cut: " + "; ".join(sorted({c["why"].split(" for ")[0] for c in cuts})),
    ]
    return lines


def throughput_report(run: Path, cpu: bool) -> list[str]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    full = [r["samples_per_s"] for r in records if r["world"] == 2]
    alone = [r["samples_per_s"] for r in records if r["world"] == 1]
    lines = [f"- epochs with 2 ranks: {len(full)}, with 1: {len(alone)} (the cut's own epoch is mixed)"]
    if full and alone:
        before, after = statistics.median(full[1:] or full), statistics.median(alone)
        lines.append(
            f"- samples/s: 2 ranks {before:,.0f}, 1 rank {after:,.0f}; retained "
            f"{after / (before / 2):.2f} of (survivors / world) x before"
            + (" (CPU: the ranks share two cores with whatever else runs there, so this swings from run to "
               "run and is no measure of what a GPU keeps)" if cpu else "")
        )  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--every-s", type=float, default=8.0, help="seconds between kills")
    parser.add_argument("--heartbeat-s", type=float, default=2.0, help="heartbeat_timeout_s")
    parser.add_argument("--before", type=int, default=3, help="epochs before the throughput run's kill")
    parser.add_argument("--policy", default="cadence", choices=["sync", "cadence", "async"])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flodl-bench-survive"))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (after --)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    start_method = "fork" if args.cpu else "spawn"
    common = [
        "launch.nproc_per_node=2", f"launch.start_method={start_method}", "fault_tolerance=survive",
        f"heartbeat_timeout_s={args.heartbeat_s}", f"policy={args.policy}", "eval_every=0",
        *(["device=cpu"] if args.cpu else ["task=resnet"]), *args.overrides,
    ]  # fmt: skip
    stamp = int(time.time())
    run, killed = launch(
        args.work, f"kills-{stamp}", [*common, "epochs=1000", f"launch.max_restarts={args.kills}"],
        timeout=args.kills * args.every_s + 240, kills=args.kills, every_s=args.every_s,
        kill_after_epochs=None,
    )  # fmt: skip
    lines = [
        "",
        f"## survive ({args.policy}): {args.kills} kills of rank 1, every {args.every_s:g} s",
        *environment_lines(args.cpu),
    ]
    lines += [f"- overrides: `{' '.join(common)}`", *kill_report(run, killed)]
    run2, _ = launch(
        args.work, f"throughput-{stamp}", [*common, f"epochs={args.before + 3}", "launch.max_restarts=0"],
        timeout=600, kills=1, every_s=0, kill_after_epochs=args.before,
    )  # fmt: skip
    lines += [
        "",
        "### throughput retained (rank 1 killed once, not restarted)",
        *throughput_report(run2, args.cpu),
    ]
    write_report(results_path(args.results_dir, "survive", args.cpu), "\n".join(lines))


if __name__ == "__main__":
    main()
