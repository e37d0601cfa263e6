"""Per-job start-up of a sweep under each launch mode: `python bench/sweep_startup.py [--jobs 4]`.

Each mode runs the same tiny sweep (digits, 1 epoch on the 359-sample split, no eval); a job's start-up is
(the sweep's wall time - the jobs' training time) / jobs: interpreter, Hydra, process group, spawn, and
writing the run dir. The report is appended to bench/results/<date>-sweep-startup-<host>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchlib import environment_lines, results_path, run_child, write_report

from tests.helpers.procs import TORCHRUN, TRAIN

TINY = ["epochs=1", "eval_every=0", "task.train_data.split=test", "logger.log_every=0"]
MODES = {
    "in-process, 1 rank per job (Hydra's basic launcher)": ([], []),
    "torchrun walking the sweep, 2 ranks": (["--standalone", "--nproc_per_node=2"], []),
    "self-launch per job, 2 ranks, spawn": (None, ["launch.nproc_per_node=2"]),
    "self-launch per job, 2 ranks, fork": (None, ["launch.nproc_per_node=2", "launch.start_method=fork"]),
    "slots launcher, 2 ranks per job, 1 job at a time": (
        None,
        ["hydra/launcher=slots", "hydra.launcher.max_parallel=1", "launch.nproc_per_node=2"],
    ),
}


def measure(torchrun: list[str] | None, extra: list[str], jobs: int, cwd: Path) -> tuple[float, float]:
    """(wall s of the whole sweep, per-job start-up s)."""
    sweep = ["-m", f"seed={','.join(map(str, range(jobs)))}", *TINY, *extra, f"hydra.sweep.dir={cwd}/sweep"]
    args = [*TORCHRUN, *torchrun, TRAIN, *sweep] if torchrun else [sys.executable, TRAIN, *sweep]
    began = time.perf_counter()
    run_child(args, cwd, timeout=900).check()
    wall = time.perf_counter() - began
    files = sorted((cwd / "sweep").rglob("metrics.jsonl"))
    assert len(files) == jobs, files
    training = sum(json.loads(line)["epoch_s"] for f in files for line in f.read_text().splitlines())
    return wall, (wall - training) / jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    args = parser.parse_args()
    lines = [
        "## Sweep start-up per job",
        "",
        *environment_lines(cpu=True),
        f"- {args.jobs} jobs per sweep",
        "",
    ]
    lines += ["| launch mode | sweep wall s | start-up s per job |", "|---|---|---|"]
    for mode, (torchrun, extra) in MODES.items():
        with tempfile.TemporaryDirectory() as tmp:
            wall, per_job = measure(torchrun, extra, args.jobs, Path(tmp))
        lines.append(f"| {mode} | {wall:.1f} | {per_job:.1f} |")
        print(lines[-1], flush=True)
    write_report(results_path(Path(__file__).parent / "results", "sweep-startup", cpu=True), "\n".join(lines))


if __name__ == "__main__":
    main()
