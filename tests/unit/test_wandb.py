"""W&B sink, end to end: offline runs read back from disk with wandb's own reader (`wandb leet inspect`)."""

from __future__ import annotations

from pathlib import Path

from flodl.metrics.run_info import job_name, sweep_keys


def test_a_jobs_name_holds_only_what_its_sweep_varies(tmp_path: Path) -> None:
    saved = tmp_path / "multirun.yaml"  # as Hydra's sweeper saves it in the sweep dir
    saved.write_text(
        "hydra:\n"
        "  overrides:\n"
        "    task: ['policy=sync,async', epochs=2, logger=wandb, 'launch.timeout_s=60,90']\n"
        "  sweeper:\n"
        "    params: {seed: '0,1', +task.model.width: 'range(2)'}\n"
    )
    varying = sweep_keys(saved)
    assert varying == {"policy", "launch.timeout_s", "seed", "task.model.width"}
    job = ["policy=async", "epochs=2", "logger=wandb", "launch.timeout_s=90", "seed=1", "+task.model.width=1"]
    assert job_name(job, varying) == "policy=async,seed=1,task.model.width=1"
    assert sweep_keys(tmp_path / "missing.yaml") == set()
