"""Ranks started by a scheduler (Slurm's srun, submitit) instead of torchrun."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.procs import leftovers, train
from tests.helpers.runs import assert_complete_run


@pytest.mark.multiproc
def test_submitit_runs_each_sweep_job_as_two_tasks_that_form_one_job(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    train(
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.timeout_min=4",
        f"hydra.sweep.dir={sweep}",
        "device=cpu",
        "policy=cadence",
        "epochs=2",
        "seed=0,1",
        cwd=tmp_path,
        timeout=240,
    ).check()
    ports = set()
    for job in ("0", "1"):
        assert_complete_run(sweep / job, world=2, epochs=2)
        ports.add(re.search(r"master port (\d+)", (sweep / job / "rank0.log").read_text()).group(1))
    assert len(ports) == 2  # the jobs ran side by side, each on its own store
    assert not leftovers(tmp_path)
