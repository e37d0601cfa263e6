"""Compare the jobs of a multirun: `python -m flodl.metrics.compare <multirun dir>`.

Jobs are grouped by the keys that vary across the sweep (read from each job's `.hydra/overrides.yaml` and
config); `seed` is folded: each group shows the mean ± sample standard deviation over its seeds. Writes into
that dir `compare.md` (a row per group, a row per job, then the jobs not compared: each failed one with the
line its launcher said of it, each that recorded no epoch; then the jobs the sweep skipped as invalid) and
`compare.png` (the eval metric against wall time and against samples, throughput, bytes on the wire, and
where each group's wall time went).
Wall time is the job's own, from launch to exit (`run.json`), with its start-up shown apart; the sweep's own
start-up before its first job (`sweep.json`) is said once, in no job's row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flodl.config.sweep import read_skipped
from flodl.metrics.plots import plot_compare
from flodl.metrics.run_clock import sweep_startup_s
from flodl.metrics.sweep import (
    OVERRIDES,
    SEED_KEY,
    Group,
    Job,
    group_jobs,
    job_dirs,
    load_job,
    mean_std,
    varying_keys,
)

REPORT_MD = "compare.md"
REPORT_PNG = "compare.png"


def eval_metric(jobs: list[Job]) -> str:
    """The first eval metric the jobs report (the task's own, e.g. eval/accuracy), else the train loss."""
    for job in jobs:
        for record in job.records:
            names = sorted(k for k in record if k.startswith("eval/"))
            if names:
                return names[0]
    return "loss"


def job_row(job: Job, metric: str) -> dict[str, float | None]:
    """The numbers a job contributes to its group's row."""
    evaluated = [r[metric] for r in job.records if metric in r]
    return {
        "final loss": job.records[-1]["loss"],
        metric: evaluated[-1] if evaluated else None,
        "wall s": job.wall_s,
        "start-up s": job.startup_s,
        "samples/s": sum(r["samples"] for r in job.records) / job.training_s if job.training_s else None,
        "rounds": sum(r["rounds"] for r in job.records),
        "MB on wire": job.records[-1]["comm_bytes_total"] / 1e6,
    }


def _cell(values: list[float | None], digits: int) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "—"
    mean, std = mean_std(present)
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if len(present) > 1 else f"{mean:.{digits}f}"


DIGITS = {"final loss": 4, "wall s": 1, "start-up s": 1, "samples/s": 0, "rounds": 0, "MB on wire": 2}


def report(sweep_dir: Path) -> str:
    found = job_dirs(sweep_dir)
    if not found:
        raise SystemExit(f"flodl.metrics.compare: no job dir (with its {OVERRIDES}) under {sweep_dir}")
    everyone = [load_job(d) for d in found]
    # A job that failed, or recorded no epoch, is listed apart: a part of a run is no run to compare.
    jobs = [job for job in everyone if job.records and job.failed is None]
    groups = group_jobs(jobs)
    metric = eval_metric(jobs)
    varying = varying_keys(jobs)
    lines = [
        f"# {sweep_dir}",
        "",
        f"{len(jobs)} jobs in {len(groups)} group(s) by the keys that vary: "
        f"{', '.join(k for k in varying if k != SEED_KEY) or 'none'}"
        f"{' (seed folded in)' if SEED_KEY in varying else ''}. Values are mean ± sample std over a group's "
        f"seeds. `{metric}` is the last eval; wall s is launch to exit (start-up apart: launch to the first "
        "epoch's start); samples/s is over training time.",
        *_sweep_startup_line(sweep_dir),
    ]
    if jobs:
        lines += _tables(sweep_dir, groups, metric)
    lines += _not_compared(sweep_dir, [job for job in everyone if job.failed is not None or not job.records])
    skipped = read_skipped(sweep_dir)
    if skipped:  # the sweep's invalid jobs (hydra.sweeper.skip_invalid=true): named, never silently missing
        named = "; ".join(f"`{' '.join(j.overrides)}` ({'; '.join(j.problems)})" for j in skipped)
        lines += ["", f"Skipped as invalid ({len(skipped)}): {named}"]
    text = "\n".join(lines) + "\n"
    (sweep_dir / REPORT_MD).write_text(text)
    if jobs:
        plot_compare(groups, metric, sweep_dir / REPORT_PNG)
    return text


def _tables(sweep_dir: Path, groups: list[Group], metric: str) -> list[str]:
    """A row per group, then a row per job."""
    columns = list(job_row(groups[0].jobs[0], metric))
    lines = ["", f"| group | seeds | {' | '.join(columns)} |", "|---|---|" + "---|" * len(columns)]
    for group in groups:
        rows = [job_row(job, metric) for job in group.jobs]
        cells = [_cell([r[c] for r in rows], DIGITS.get(c, 4)) for c in columns]
        lines.append(f"| {group.label} | {len(group.jobs)} | {' | '.join(cells)} |")
    lines += [
        "",
        "## Jobs",
        "",
        f"| job | group | seed | {' | '.join(columns)} |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for group in groups:
        for job in group.jobs:
            row = job_row(job, metric)
            cells = [_cell([row[c]], DIGITS.get(c, 4)) for c in columns]
            name = job.dir.relative_to(sweep_dir)
            lines.append(f"| {name} | {group.label} | {job.value_of(SEED_KEY)} | {' | '.join(cells)} |")
    return lines


def _not_compared(sweep_dir: Path, jobs: list[Job]) -> list[str]:
    """The jobs that failed (and why: the line their launcher said), and those that recorded no epoch."""
    if not jobs:
        return []
    lines = ["", f"## Not compared ({len(jobs)})", ""]
    for job in jobs:
        overrides = " ".join(f"{k}={v}" for k, v in job.overrides.items())
        what = (
            f"failed: {job.failed}"
            if job.failed is not None
            else "recorded no epoch and no failure (it still runs, or was killed; see its logs)"
        )
        lines.append(f"- `{job.dir.relative_to(sweep_dir)}` (`{overrides}`) {what}")
    return lines


def _sweep_startup_line(sweep_dir: Path) -> list[str]:
    seconds = sweep_startup_s(sweep_dir)
    if seconds is None:
        return []
    return [
        "",
        f"The sweep's own start-up (interpreter, Hydra, the grid check) took {seconds:.1f} s before its "
        "first job was launched; it is in no job's wall time.",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m flodl.metrics.compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir (or any dir holding run dirs)")
    args = parser.parse_args(argv)
    sys.stdout.write(report(args.sweep_dir))


if __name__ == "__main__":
    main()
