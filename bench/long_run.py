"""Does a run slow down over its minutes? One calm job for `--seconds`: its speed and its host's cost.

The job (digits, 3 self-launched gloo ranks, cadence, a checkpoint every epoch by default: the most rounds,
epochs and checkpoints a second this machine can make) runs undisturbed until it is stopped with SIGTERM.
Every `--every-s` seconds the bench reads the CPU time and memory of the run's host process (the launcher
that holds the coordinator, the console, metrics.jsonl and the timeline) and of its ranks. The report gives,
per window, the samples/s of the epochs recorded in it (metrics.jsonl), the host's share of a core and its
resident memory, and the last window's speed over the first's: a structure that grows with the run shows as
a speed falling with time and a host cost rising with it.

    python bench/long_run.py --seconds 480                       # 3 ranks on CPU
    python bench/long_run.py --seconds 480 -- policy=sync        # another job
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
import statistics
import time
from pathlib import Path

import psutil
from benchlib import REPO, environment_lines, results_path, write_report

from tests.helpers.procs import PYTHON, TRAIN, child_env, finish, kill_group, start

JOB = [
    "task=digits",
    "device=cpu",
    "policy=cadence",
    "launch.nproc_per_node=3",
    "launch.start_method=fork",
    "fault_tolerance=survive",
    "eval_every=0",
    "epochs=1000000",
    "checkpoint_every=1",
]


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def sample(host: psutil.Process) -> tuple[float, float, float, int]:
    """Now, the host's CPU seconds, its ranks' (the children alive now), and the host's resident bytes."""
    ranks = 0.0
    for child in host.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            ranks += cpu_seconds(child)
    return time.time(), cpu_seconds(host), ranks, host.memory_info().rss


def window_rows(records: list[dict], samples: list[tuple[float, float, float, int]]) -> list[dict]:
    """Per window between two samples: the samples/s of the epochs inside it, the host's and the ranks' share
    of a core, the host's memory at its end."""
    rows = []
    for (t0, host0, ranks0, _), (t1, host1, ranks1, rss) in itertools.pairwise(samples):
        inside = [r for r in records if r["window_start"] >= t0 and r["window_end"] <= t1]
        span = max((r["window_end"] for r in inside), default=t1) - min(
            (r["window_start"] for r in inside), default=t0
        )
        rate = sum(r["samples"] for r in inside) / span if inside and span > 0 else 0.0
        rows.append(
            {
                "end_s": t1 - samples[0][0],
                "epochs": len(inside),
                "samples_per_s": rate,
                "host_cpu": (host1 - host0) / (t1 - t0),
                "ranks_cpu": (ranks1 - ranks0) / (t1 - t0),
                "host_rss_mb": rss / 2**20,
            }
        )
    return rows


def summary(rows: list[dict]) -> str:
    """The last quarter of the windows against the first, each by its median (one window swings by ~10% on a
    shared machine): samples/s and the host's CPU as ratios, its memory as a difference."""
    quarter = len(rows) // 4

    def ratio(key: str) -> float:
        first = statistics.median(r[key] for r in rows[:quarter])
        return statistics.median(r[key] for r in rows[-quarter:]) / first

    grown = rows[-1]["host_rss_mb"] - rows[0]["host_rss_mb"]
    return (
        f"- last quarter / first quarter (medians of their windows): samples/s "
        f"**{ratio('samples_per_s'):.3f}**, host CPU {ratio('host_cpu'):.3f}; host RSS {grown:+.0f} MB "
        "from the first window to the last"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=480.0, help="how long the job runs")
    parser.add_argument("--every-s", type=float, default=30.0, help="the window of each row")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flodl-bench-long-run"))
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after the default job's (after --)")
    args = parser.parse_args()
    job = [*JOB, *args.overrides]
    run = args.work / f"run-{int(time.time())}"
    args.work.mkdir(parents=True, exist_ok=True)
    proc = start([PYTHON, TRAIN, *job, f"hydra.run.dir={run}"], cwd=args.work, env=child_env())
    samples = []
    try:
        host = psutil.Process(proc.pid)
        while not (run / "metrics.jsonl").exists():  # the first epoch recorded: training has started
            if proc.poll() is not None:
                raise SystemExit(finish(proc, 10).out[-4000:])
            time.sleep(0.5)
        end = time.time() + args.seconds
        while time.time() < end and proc.poll() is None:
            samples.append(sample(host))
            time.sleep(min(args.every_s, max(end - time.time(), 0.0)))
        samples.append(sample(host))
        proc.send_signal(signal.SIGTERM)
        result = finish(proc, 120)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = window_rows(records, samples)
    lines = [
        "",
        f"## A calm run of {args.seconds:.0f} s: speed and host cost by {args.every_s:.0f} s window",
        *environment_lines(cpu=True),
        f"- job: `{' '.join(job)}`; exit {result.code} (SIGTERM at the end), {len(records):,} epochs",
        "",
        "| window end (s) | epochs | samples/s | host CPU (cores) | ranks CPU (cores) | host RSS (MB) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['end_s']:.0f} | {r['epochs']:,} | {r['samples_per_s']:,.0f} | {r['host_cpu']:.3f} | "
            f"{r['ranks_cpu']:.2f} | {r['host_rss_mb']:.0f} |"
            for r in rows
        ),
    ]
    if len(rows) >= 4:
        lines += ["", summary(rows)]
    write_report(results_path(args.results_dir, "long-run", cpu=True), "\n".join(lines))


if __name__ == "__main__":
    main()
