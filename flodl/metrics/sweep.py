"""A sweep's jobs as the compare report reads them: records, overrides, times, and groups by varying keys."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flodl.metrics.run_clock import read_run

# Folded into a group's mean ± spread instead of splitting it.
SEED_KEY = "seed"
# What Hydra writes in every job's dir: the job's own overrides.
OVERRIDES = Path(".hydra") / "overrides.yaml"


@dataclass
class Job:
    dir: Path
    # override key -> value as written (a leading + or ~ dropped from the key)
    overrides: dict[str, str]
    config: dict[str, Any]
    records: list[dict[str, Any]]
    # run.json: launched_at, training_started_at, training_ended_at, exited_at (absent for older runs).
    times: dict[str, float]
    # The line its launcher said of its failure (run.json), None when it did not fail or said nothing.
    failed: str | None = None

    def value_of(self, key: str) -> str:
        """The job's value for `key`: its override, else its composed config's value."""
        if key in self.overrides:
            return self.overrides[key]
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return "(unset)"
            node = node[part]
        return str(node)

    @property
    def training_s(self) -> float:
        return sum(r["epoch_s"] for r in self.records)

    @property
    def wall_s(self) -> float | None:
        return self._between("launched_at", "exited_at")

    @property
    def startup_s(self) -> float | None:
        return self._between("launched_at", "training_started_at")

    @property
    def wind_down_s(self) -> float | None:
        return self._between("training_ended_at", "exited_at")

    def _between(self, start: str, end: str) -> float | None:
        if start in self.times and end in self.times:
            return self.times[end] - self.times[start]
        return None

    def seconds_at(self, metric: str) -> list[float]:
        """Seconds since launch at which each record's `metric` was measured: an eval when its model was
        taken (async: after its epoch's end), anything else when its epoch was reported (start-up, then the
        epochs' times)."""
        at = self.startup_s or 0.0
        launched = self.times.get("launched_at")
        out = []
        for record in self.records:
            at += record["epoch_s"]
            taken = record.get("eval_taken_at") if metric.startswith("eval/") else None
            out.append(taken - launched if taken is not None and launched is not None else at)
        return out

    def samples_at(self, metric: str) -> list[int]:
        """Samples trained when each record's `metric` was measured (an eval: those its model holds)."""
        total, out = 0, []
        for record in self.records:
            total += record["samples"]
            measured = record.get("eval_samples") if metric.startswith("eval/") else None
            out.append(total if measured is None else measured)
        return out


@dataclass
class Group:
    # The varying keys (seed excluded) and this group's values for them.
    keys: dict[str, str]
    jobs: list[Job]

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.keys.items()) or "all jobs"


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every job dir under `sweep_dir` (Hydra's `.hydra/` in it), whether it trained, failed or still runs."""
    return sorted((p.parent.parent for p in sweep_dir.rglob(OVERRIDES.as_posix())), key=str)


def load_job(job_dir: Path) -> Job:
    """A job as its dir holds it; a job that failed before its first epoch has no records (its metrics.jsonl
    empty, or none)."""
    metrics = job_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records = [json.loads(line) for line in lines if line]
    listed = yaml.safe_load((job_dir / OVERRIDES).read_text()) or []
    overrides = {}
    for item in listed:
        key, _, value = item.partition("=")
        overrides[key.lstrip("+~")] = value
    config = yaml.safe_load((job_dir / ".hydra" / "config.yaml").read_text())
    times, failed = read_run(job_dir)
    return Job(job_dir, overrides, config, records, times, failed)


def varying_keys(jobs: list[Job]) -> list[str]:
    """The override keys whose value differs between jobs, in the order they are first written."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    return [k for k in keys if len({job.value_of(k) for job in jobs}) > 1]


def group_jobs(jobs: list[Job]) -> list[Group]:
    """One group per combination of the varying keys other than the seed, in sweep order."""
    keys = [k for k in varying_keys(jobs) if k != SEED_KEY]
    groups: dict[tuple[str, ...], Group] = {}
    for job in jobs:
        values = tuple(job.value_of(k) for k in keys)
        groups.setdefault(values, Group(dict(zip(keys, values, strict=True)), [])).jobs.append(job)
    return list(groups.values())


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0
