"""Compare the jobs of a multirun: `python -m flodl.compare <multirun dir>`.

Writes into that dir `compare.md` (one row per job: policy and overrides, final loss, eval metric, wall
time, samples/s, averaging rounds, bytes on the wire) and `compare.png` (the eval metric against wall
time, step and bytes, one line per job).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from flodl.metrics.plots import plot_compare

REPORT_MD = "compare.md"
REPORT_PNG = "compare.png"


def load_job(job_dir: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines() if line]
    wall = 0.0
    for record in records:
        wall += record["epoch_s"]
        record["wall_s"] = wall
    overrides = yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or []
    config = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())
    return {
        "dir": job_dir,
        "label": ",".join(overrides) or job_dir.name,
        "policy": config.get("policy", "?"),
        "overrides": overrides,
        "records": records,
        "rounds": sum(r["rounds"] for r in records),
    }


def eval_metric(jobs: list[dict[str, Any]]) -> str:
    """The first eval metric the jobs report (the task's own, e.g. eval/accuracy), else the train loss."""
    for job in jobs:
        for record in job["records"]:
            names = sorted(k for k in record if k.startswith("eval/"))
            if names:
                return names[0]
    return "loss"


def report(sweep_dir: Path) -> str:
    job_dirs = sorted((p.parent for p in sweep_dir.rglob("metrics.jsonl")), key=lambda p: str(p))
    if not job_dirs:
        raise SystemExit(f"flodl.compare: no job with a metrics.jsonl under {sweep_dir}")
    jobs = [load_job(d) for d in job_dirs]
    metric = eval_metric(jobs)
    lines = [
        f"# {sweep_dir}",
        "",
        f"| job | policy | overrides | final loss | {metric} | wall s | samples/s | rounds | bytes on wire |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        records = job["records"]
        last = records[-1]
        evaluated = [r[metric] for r in records if metric in r]
        wall = last["wall_s"]
        samples = sum(r["samples"] for r in records)
        lines.append(
            f"| {job['dir'].relative_to(sweep_dir)} | {job['policy']} | `{' '.join(job['overrides'])}` | "
            f"{last['loss']:.4f} | {evaluated[-1] if evaluated else float('nan'):.4f} | {wall:.2f} | "
            f"{samples / wall if wall else 0:.0f} | {job['rounds']} | {last['comm_bytes_total']:,} |"
        )
    text = "\n".join(lines) + "\n"
    (sweep_dir / REPORT_MD).write_text(text)
    plot_compare(jobs, metric, sweep_dir / REPORT_PNG)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flodl.compare", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir (or any dir holding run dirs)")
    args = parser.parse_args(argv)
    sys.stdout.write(report(args.sweep_dir))


if __name__ == "__main__":
    main()
