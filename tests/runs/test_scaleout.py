"""Sweeps under torchrun, a 2-node job on one machine, and the pre-flight plan."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flodl.metrics import run_clock
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TORCHRUN,
    TRAIN,
    Result,
    child_env,
    finish,
    free_port,
    leftovers,
    start,
    torchrun,
    train,
)
from tests.helpers.runs import assert_complete_run, epochs_of, rank0_line

pytestmark = pytest.mark.multiproc


def test_torchrun_ranks_walk_a_multirun_sweep_together(tmp_path: Path) -> None:
    out = torchrun(2, "-m", "seed=0,1", "epochs=1", cwd=tmp_path, timeout=240).check().out
    # Hydra's launcher lines once (rank 0's), not once per rank.
    launcher = ("Launching 2 jobs locally", "#0 : seed=0", "#1 : seed=1")
    assert [out.count(line) for line in launcher] == [1, 1, 1], out
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps  # both ranks agreed on one sweep dir
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"]
    for job in jobs:
        assert_complete_run(job, world=2, epochs=1)
    assert not leftovers(tmp_path)


def _two_nodes(tmp_path: Path, *overrides: str, run_dirs: tuple[str, str] | None = None) -> list[Result]:
    """Two torchrun agents of one job on this machine, as on two hosts (`run_dirs`: each host's own
    `hydra.run.dir`, as hosts with local disks would have); both waited for (or killed) before a check."""
    endpoint = f"localhost:{free_port()}"
    nodes = [
        start(
            [
                *TORCHRUN,
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                "--rdzv-id=two-nodes",
                TRAIN,
                *overrides,
                *([f"hydra.run.dir={run_dirs[rank]}"] if run_dirs else []),
            ],
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    return [finish(node, timeout=180) for node in nodes]


def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    for result in _two_nodes(tmp_path, "epochs=2"):
        result.check()
    (run_dir,) = [p.parent for p in tmp_path.rglob("metrics.jsonl")]
    records = assert_complete_run(run_dir, world=2, epochs=2)
    assert records[-1]["per_rank"][1]["batches"] > 0
    # Logs name the host once a job spans several hosts.
    assert f"[{socket.gethostname()}:r1]" in (run_dir / "rank1.log").read_text()
    # Checkpoints were on (the default), in the one dir both hosts see.
    assert (run_dir / "checkpoints" / "epoch-000002" / "rank1.pt").is_file()
    assert not leftovers(tmp_path)


def test_hosts_that_do_not_share_the_run_dir_are_refused_before_training(tmp_path: Path) -> None:
    """Each host writes its own run dir (local disks): rank 1's checkpoint parts would never reach the dir
    rank 0 commits in. Every rank refuses before it trains, in one line naming the key that fixes it."""
    results = _two_nodes(tmp_path, "epochs=2", run_dirs=("host0", "host1"))
    assert [r.timed_out or r.code == 0 for r in results] == [False, False], results[0].out[-4000:]
    line = f"rank 1 does not see the checkpoint dir {tmp_path / 'host0' / 'checkpoints'} of the run's host"
    # Each rank recorded the refusal as its failure (the launcher's one line names it) ...
    for host in (tmp_path / "host0", tmp_path / "host1"):
        (recorded,) = [json.loads(p.read_text()) for p in host.glob(".launch/failure-*.json")]
        assert recorded["error"] == "ConfigError" and line in recorded["message"], recorded
        assert "save_path=" in recorded["message"] and "checkpoint_every=null" in recorded["message"]
    # ... and said it in one line of its own (the agent whose rendezvous store went first may be cut off by
    # torchrun before its rank prints), no traceback of a rank's.
    said = [text for r in results for text in r.out.splitlines() if line in text]
    assert said, results[1].out[-4000:]
    ranks_said = [text for r in results for text in r.out.splitlines() if text.startswith("[rank")]
    assert not any("Traceback" in text for text in ranks_said), ranks_said  # torchrun's own report aside
    for host in (tmp_path / "host0", tmp_path / "host1"):  # nothing trained, nothing checkpointed
        assert not (host / "metrics.jsonl").exists() or not epochs_of(host)
        assert not list(host.glob("checkpoints/epoch-*"))
    assert not leftovers(tmp_path)


def test_hosts_with_run_dirs_of_their_own_checkpoint_in_a_shared_save_path(tmp_path: Path) -> None:
    """save_path on storage every host sees: the parts meet there, each host keeps its own run dir."""
    shared = tmp_path / "shared"
    for result in _two_nodes(tmp_path, "epochs=1", f"save_path={shared}", run_dirs=("host0", "host1")):
        result.check()
    (record,) = epochs_of(tmp_path / "host0")
    assert [r["batches"] > 0 for r in record["per_rank"]] == [True, True]
    assert (shared / "checkpoints" / "epoch-000001" / "rank1.pt").is_file()
    assert not list(shared.glob("checkpoints/.host-*"))  # the start's mark taken back at the run's end
    assert not leftovers(tmp_path)


def test_survive_ranks_that_do_not_see_flodl_coordinators_dir_are_refused(tmp_path: Path) -> None:
    """Under survive the host apart commits: each rank looks for its mark (the ranks here on their own
    disks), and flodl-coordinator fails the run with the ranks' line instead of waiting for them."""
    job = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    overrides = ["fault_tolerance=survive", "policy=cadence", "epochs=2"]
    coordinator = start(
        [str(Path(PYTHON).parent / "flodl-coordinator"), *overrides, "hydra.run.dir=host"],
        tmp_path,
        child_env(**job),
    )
    ranks = [
        start([PYTHON, TRAIN, *overrides, f"hydra.run.dir=rank{r}"], tmp_path, child_env(RANK=str(r), **job))
        for r in (0, 1)
    ]
    hosted, *trained = [finish(p, timeout=180) for p in (coordinator, *ranks)]
    line = f"ranks 0, 1 do not see the checkpoint dir {tmp_path / 'host' / 'checkpoints'} of the run's host"
    assert hosted.code == 2 and f"flodl: invalid flodl config: {line}" in hosted.out, hosted.out[-3000:]
    assert [r.code for r in trained] == [2, 2], trained[0].out[-3000:]
    assert line in trained[0].out  # rank 0 says it too
    assert not list(tmp_path.rglob("metrics.jsonl")) or not epochs_of(tmp_path / "host")
    assert not list((tmp_path / "host").glob("checkpoints/*"))  # its mark taken back
    assert not leftovers(tmp_path)


def test_hosts_apart_train_without_a_shared_dir_when_nothing_is_checkpointed(tmp_path: Path) -> None:
    """Checkpoints off: nothing of a rank goes to disk but rank 0's records, so each host's own dir does."""
    nodes = _two_nodes(tmp_path, "epochs=1", "checkpoint_every=null", run_dirs=("host0", "host1"))
    for result in nodes:
        result.check()
    (record,) = epochs_of(tmp_path / "host0")  # rank 0's records; each rank's log in its own host's dir
    assert [r["batches"] > 0 for r in record["per_rank"]] == [True, True]
    assert (tmp_path / "host0" / "model.pt").is_file() and (tmp_path / "host1" / "rank1.log").is_file()
    assert not leftovers(tmp_path)


def test_plan_prints_the_figures_and_starts_nothing(tmp_path: Path) -> None:
    result = train("plan=true", "policy=cadence", "launch.nproc_per_node=2", "bf16_wire=true", cwd=tmp_path)
    result.check()
    assert "flodl plan (nothing was started)" in result.out
    assert "2 in all, 2 on this host" in result.out
    assert (
        "26,122 parameters, 102.0 KiB" in result.out
    )  # the digits MLP: 64*128+128 + 128*128+128 + 128*10+10
    assert "102.0 KiB per rank per averaging round, 51.0 KiB with bf16_wire (on)" in result.out
    assert "cadence on backend=nccl, batch 32/rank (global 64)" in result.out
    assert not list(tmp_path.rglob("rank*.log")) and not list(tmp_path.rglob(".launch"))
    assert not any(epochs_of(p.parent) for p in tmp_path.rglob("metrics.jsonl"))


def test_a_process_start_is_on_the_clock_its_exit_is_recorded_on(tmp_path: Path) -> None:
    """A job's launch and another's exit are compared (a slot was free): both on time.time()'s clock, not
    psutil's create_time, which rounds the boot time to the second and can fall up to a second early."""
    before = time.time()
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; from flodl.metrics import run_clock; "
            "print(run_clock._process_start(), time.time())",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, run_clock.LAUNCHED_AT_ENV: ""},
    )
    started, now = map(float, child.stdout.split())
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - tick <= started <= now


def test_slots_launcher_runs_jobs_side_by_side_on_their_own_ports(tmp_path: Path) -> None:
    train(
        "-m",
        "hydra/launcher=slots",
        "hydra.launcher.max_parallel=2",
        "seed=0,1,2",
        "epochs=2",
        "launch.nproc_per_node=2",
        FAST_START,
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
        timeout=300,
    ).check()
    jobs = [tmp_path / "sweep" / str(i) for i in range(3)]
    for job in jobs:
        assert_complete_run(job, world=2, epochs=2)
    recorded = [rank0_line(job) for job in jobs]
    assert len({port for _, port, _ in recorded}) == 3
    # Jobs 0 and 1 were launched side by side (the slots launcher does not wait for one to end: on a loaded
    # machine one may still end before the other's rank 0 starts, so the launch is what counts)...
    clock = [json.loads((job / "run.json").read_text()) for job in jobs]
    assert clock[1]["launched_at"] < clock[0]["exited_at"] and clock[0]["launched_at"] < clock[1]["exited_at"]
    # ...and job 2 waited for a free slot.
    assert clock[2]["launched_at"] >= min(clock[0]["exited_at"], clock[1]["exited_at"])
    # Each job learns its sweep's group through logger.group (recorded with its config), not in its name.
    config = yaml.safe_load((jobs[1] / ".hydra" / "config.yaml").read_text())
    assert config["logger"]["group"] == f"{tmp_path.name}/sweep"
    name = yaml.safe_load((jobs[1] / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["override_dirname"]
    assert name == f"epochs=2,launch.nproc_per_node=2,{FAST_START},seed=1"
    assert not leftovers(tmp_path)


def test_gpu_slots_picks_the_lowest_free_indices() -> None:
    from hydra_plugins.flodl_slots import gpu_slots

    assert gpu_slots([3, 1, 2], 2) == [1, 2]
    assert gpu_slots([0], 2) is None
    assert gpu_slots([], 0) == []
