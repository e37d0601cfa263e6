"""flodl.compare's grouping, on jobs built in memory (the real sweep is in test_reports.py)."""

from __future__ import annotations

from pathlib import Path

from flodl.metrics.sweep import Job, group_jobs, mean_std, varying_keys


def job(name: str, overrides: dict[str, str], config: dict) -> Job:
    return Job(Path(name), overrides, config, records=[], times={})


def test_only_keys_that_differ_vary_and_an_unset_key_takes_the_config_value() -> None:
    config = {"policy": "sync", "gamma": 1.0, "seed": 42, "epochs": 3}
    jobs = [
        job("0", {"policy": "cadence", "seed": "0", "epochs": "3"}, config),
        job("1", {"policy": "cadence", "seed": "1", "epochs": "3", "gamma": "0.5"}, config),
        job("2", {"policy": "async", "seed": "0", "epochs": "3", "gamma": "1.0"}, config),
        job("3", {"policy": "async", "seed": "1", "epochs": "3", "gamma": "1.0"}, config),
    ]
    # epochs is the same everywhere; job 0 leaves gamma at its config value, 1.0, as jobs 2 and 3 set it.
    assert varying_keys(jobs) == ["policy", "seed", "gamma"]
    groups = group_jobs(jobs)
    assert [g.label for g in groups] == [
        "policy=cadence gamma=1.0",
        "policy=cadence gamma=0.5",
        "policy=async gamma=1.0",
    ]
    assert [[j.dir.name for j in g.jobs] for g in groups] == [["0"], ["1"], ["2", "3"]]


def test_a_sweep_over_seeds_only_is_one_group() -> None:
    jobs = [job(str(s), {"seed": str(s)}, {"seed": 42}) for s in range(3)]
    (group,) = group_jobs(jobs)
    assert group.label == "all jobs" and len(group.jobs) == 3


def test_spread_is_the_sample_standard_deviation() -> None:
    assert mean_std([1.0, 3.0]) == (2.0, 2**0.5)
    assert mean_std([5.0]) == (5.0, 0.0)
