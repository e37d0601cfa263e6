"""Faults end to end on 2 gloo ranks: a killed rank under restarts, a frozen rank, a NaN loss, resume."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from flodl.launcher.signal_deaths import _BEGAN_WITHIN_S as BEGAN_WITHIN_S
from flodl.metrics.run_clock import read_run
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TORCHRUN,
    TRAIN,
    Result,
    finish,
    kill_group,
    leftovers,
    start,
    train,
    wait_for,
    wait_for_path,
)
from tests.helpers.runs import MODEL_KEYS, assert_complete_run, epochs_of

pytestmark = pytest.mark.multiproc


def _first_pid(log: Path) -> int:
    return int(re.search(r"\(pid (\d+)\)", log.read_text()).group(1))


def _kill_rank1_after(checkpoint: str, args: list[str], cwd: Path, run_dir: Path, timeout: float) -> Result:
    """Start the job, SIGKILL rank 1 once `checkpoint` is committed, and wait for the job's end (its stderr
    apart)."""
    proc = start(args, cwd, errors=subprocess.PIPE)
    try:
        wait_for_path(run_dir / "checkpoints" / checkpoint, proc, timeout=120)
        os.kill(_first_pid(run_dir / "rank1.log"), signal.SIGKILL)
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return Result(proc.returncode, out, err=err)


def _freezing_job(run_dir: Path, frozen_rank: int, *overrides: str) -> list[str]:
    """The command of a 2-rank job, long enough to outlast the test, whose rank `frozen_rank` freezes at its
    step 30."""
    return [
        PYTHON,
        TRAIN,
        "launch.nproc_per_node=2",
        FAST_START,
        "epochs=200",
        *overrides,
        f"simulate.hang_rank={frozen_rank}",
        "simulate.hang_at_step=30",
        f"hydra.run.dir={run_dir}",
    ]


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` was sent to process `pid` and waits there (a stopped process keeps it pending)."""
    status = _text(Path(f"/proc/{pid}/status"))
    shared = re.search(r"ShdPnd:\s*([0-9a-f]+)", status)
    return shared is not None and bool(int(shared.group(1), 16) >> (signum - 1) & 1)


def one_line_on_stderr(result: Result) -> str:
    """flodl's line, the only thing the job wrote to stderr; no traceback anywhere on the terminal."""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flodl: "), result.err[-6000:]
    assert "Traceback" not in result.out, result.out[-4000:]
    return lines[0]


# Rank 1 is killed once the third epoch's checkpoint is in; the restarted job trains the rest (digits on 2
# ranks passes 0.9 accuracy by the third epoch).
KILLED_RUN_EPOCHS = 10


def test_a_rank_killed_mid_epoch_is_restarted_and_the_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        *TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        TRAIN,
        f"epochs={KILLED_RUN_EPOCHS}",
        "checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
    ]
    out = _kill_rank1_after("epoch-000003", args, tmp_path, run_dir, timeout=240).check().out
    resumed = re.findall(r"resumed from \S+epoch-(\d+): training continues at epoch (\d+)", out)
    assert resumed, out[-6000:]
    checkpointed, continued = map(int, resumed[0])
    assert checkpointed >= 3 and continued == checkpointed + 1  # the dir and the line count alike
    records = assert_complete_run(run_dir, world=2, epochs=KILLED_RUN_EPOCHS)  # every epoch once, in order
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == KILLED_RUN_EPOCHS * steps[0]  # went on, not restarted
    assert records[-1]["eval/accuracy"] > 0.9
    assert not leftovers(tmp_path)


def test_with_no_restarts_left_the_error_names_the_dead_rank_and_the_last_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        PYTHON,
        TRAIN,
        "launch.nproc_per_node=2",
        FAST_START,
        "epochs=24",
        "checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
    ]
    result = _kill_rank1_after("epoch-000002", args, tmp_path, run_dir, timeout=120)
    assert result.code == 1, result.out[-4000:]
    # Rank 0 failed too (its collective lost its peer), after rank 1's death: rank 1 is blamed, with its log.
    line = one_line_on_stderr(result)
    verdict = r"flodl: rank 1 was killed by SIGKILL; the last checkpoint is \S+epoch-0000\d+; see (\S+)$"
    found = re.match(verdict, line)
    assert found and found.group(1) == str(run_dir / "rank1.log"), line


def test_a_frozen_rank_is_reported_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start(
        _freezing_job(
            run_dir,
            1,
            "heartbeat_timeout_s=3",
            "checkpoint_every=null",  # the line then says no checkpoint was taken
        ),
        cwd=tmp_path,
        output=subprocess.DEVNULL,
    )
    log = run_dir / "rank0.log"
    try:
        deadline = time.monotonic() + 120
        while "stopped responding" not in _text(log):
            assert time.monotonic() < deadline, "no hang report within 120 s"
            time.sleep(0.1)
        # Rank 0 stops itself at once (the launcher then stops the frozen rank, after its 30 s SIGTERM grace).
        with contextlib.suppress(psutil.NoSuchProcess):  # it may be gone already
            assert psutil.Process(_first_pid(log)).wait(timeout=20) != 0
    finally:
        kill_group(proc, grace=0)  # the frozen rank would sit out the launcher's SIGTERM grace
    report = log.read_text()
    assert re.search(r"rank 1 stopped responding: no heartbeat for [3-9] s", report), report[-3000:]
    assert "Last checkpoint: none" in report
    # Under sync rank 0 holds the consensus: it is saved before the process ends.
    assert "parameters at the hang (the consensus, policy=sync) saved to" in report
    state = torch.load(run_dir / "model-at-hang.pt", weights_only=True)
    assert set(state) == MODEL_KEYS and all(torch.isfinite(t).all() for t in state.values())


def test_a_frozen_rank_0_is_named_by_the_other_ranks_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    """Rank 0 holds the coordinator, so it cannot name itself: rank 1 watches its beats."""
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    with out.open("w") as sink:
        proc = start(
            _freezing_job(run_dir, 0, "heartbeat_timeout_s=3"),
            cwd=tmp_path,
            output=sink,  # type: ignore[arg-type]
        )
    try:
        # Rank 1 fails naming rank 0, and the launcher stops the frozen rank 0: its SIGTERM waits there, and
        # torch's agent SIGKILLs it after a grace of 30 s. That SIGKILL is the test's, once the agent took
        # rank 1's failure (it sends the SIGTERM after) and past the launcher's window for a rank killed by a
        # signal to be the cause (it is not: it was killed after rank 1 recorded its failure).
        wait_for(lambda: "(pid " in _text(run_dir / "rank0.log"), proc, what="rank 0 started")
        frozen = _first_pid(run_dir / "rank0.log")
        stopping = "the launcher stopped the frozen rank 0"
        wait_for(lambda: _pending(frozen, signal.SIGTERM), proc, what=stopping)
        (record,) = (run_dir / ".launch").glob("failure-*-1.json")
        past = json.loads(record.read_text())["time"] + BEGAN_WITHIN_S
        wait_for(lambda: time.time() > past, proc, what="the window for a signal death to be a cause passed")
        os.kill(frozen, signal.SIGKILL)
        assert not finish(proc, 120).timed_out, f"the launcher outlived its ranks:\n{out.read_text()[-4000:]}"
    finally:
        kill_group(proc, grace=0)
    report = (run_dir / "rank1.log").read_text()
    assert re.search(r"rank 0 stopped responding: no heartbeat for [3-9] s", report), report[-3000:]
    verdict = next(line for line in out.read_text().splitlines() if "failed first" in line)
    assert verdict.startswith("flodl: rank 1 failed first (RankHung: rank 0 stopped responding"), verdict


def test_a_sigterm_ends_a_rank_whose_main_thread_waits_in_a_collective_on_a_frozen_peer(
    tmp_path: Path,
) -> None:
    """Rank 0's main thread waits in gloo's all-reduce (its backward) on frozen rank 1, where Python runs no
    signal handler: the signal watch ends the rank, long before the heartbeat would (or the launcher's
    SIGKILL, 30 s after its SIGTERM)."""
    run_dir = tmp_path / "run"
    proc = start(
        _freezing_job(
            run_dir,
            1,
            "policy=sync",
            "heartbeat_timeout_s=120",
            "checkpoint_every=null",  # a plain stop: no checkpoint to wait for
        ),
        cwd=tmp_path,
        output=subprocess.DEVNULL,
    )
    try:
        logs = [run_dir / f"rank{r}.log" for r in (0, 1)]
        wait_for(lambda: all(log.exists() and "(pid " in log.read_text() for log in logs), proc)
        rank0, rank1 = (psutil.Process(_first_pid(log)) for log in logs)
        wait_for(lambda: rank1.status() == psutil.STATUS_STOPPED, proc, what="rank 1 froze")
        time.sleep(1)  # rank 0's step 30 (milliseconds) reaches its all-reduce, and waits there
        rank0.send_signal(signal.SIGTERM)
        rank0.wait(timeout=20)
    finally:
        kill_group(proc, grace=0)  # frozen rank 1 would sit out the launcher's SIGTERM grace
    report = logs[0].read_text()
    assert "SIGTERM came while the main thread was in native code" in report, report[-3000:]
    assert "stopped responding" not in report  # the heartbeat did not end it


def test_a_nan_injected_at_step_k_stops_the_run_naming_rank_and_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Forked ranks of two OpenMP threads too: the launcher's checks before them must leave no OpenMP thread
    # team behind (a forked rank's first parallel region would wait for it forever).
    result = train(
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=cadence",
        "epochs=6",
        "checkpoint_every=1",
        "simulate.nan_rank=1",
        "simulate.nan_at_step=60",
        "launch.start_method=fork",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=150,
        OMP_NUM_THREADS="2",
    )
    assert result.code != 0
    assert "rank 1: the training loss became non-finite (NaN/Inf) at step 60" in result.out
    # The job's last line blames the cause that came first, not the rank that happened to exit first.
    last = [line for line in result.out.splitlines() if line.strip()][-1]
    assert last.startswith("flodl: rank 1 failed first (") and "non-finite (NaN/Inf) at step 60" in last, last
    # The last good checkpoint stays, and is finite.
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    state = torch.load(latest / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values())


def test_under_sync_a_nan_is_blamed_on_its_rank_in_one_line_and_the_detail_is_in_that_rank_s_log(
    tmp_path: Path,
) -> None:
    """DDP's all-reduce spreads rank 1's NaN gradient: rank 0's loss is NaN one step later, and either rank
    may reach its chunk's check first."""
    run_dir = tmp_path / "run"
    result = train(
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=sync",
        "epochs=4",
        "simulate.nan_rank=1",
        "simulate.nan_at_step=30",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=150,
        apart=True,
    )
    assert result.code == 1, result.err[-4000:]
    line = one_line_on_stderr(result)
    assert line.startswith("flodl: rank 1 failed first (NonFiniteError: rank 1: the training loss became "), (
        line
    )
    assert "non-finite (NaN/Inf) at step 30" in line and line.endswith(f"see {run_dir / 'rank1.log'}"), line
    assert "rank 1 failed:" not in result.out  # said once, by the launcher
    for rank in (0, 1):  # each rank's own error, its traceback included, is in its log
        text = (run_dir / f"rank{rank}.log").read_text()
        assert "Traceback" in text and f"rank {rank}: the training loss became non-finite" in text


def test_a_nan_in_a_single_process_cadence_run_with_skip_stops_in_one_line(tmp_path: Path) -> None:
    """One rank: its dropped window leaves no other rank's consensus to take, so the run stops."""
    run_dir = tmp_path / "run"
    result = train(
        "policy=cadence",
        "on_nonfinite=skip",
        "epochs=2",
        "simulate.nan_rank=0",
        "simulate.nan_at_step=5",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=120,
        apart=True,
    )
    assert result.code == 1, result.err[-4000:]
    line = one_line_on_stderr(result)
    assert line.startswith(
        "flodl: rank 0 failed (NonFiniteError: rank 0: every rank's window had a non-finite"
    ), line
    assert line.endswith(f"see {run_dir / 'rank0.log'}"), line
    assert "Traceback" in (run_dir / "rank0.log").read_text()
    times, failed = read_run(run_dir)  # the compare report lists the job as failed by this line
    assert failed == line.removeprefix("flodl: ") and times["exited_at"] >= times["launched_at"], failed


def test_on_nonfinite_skip_drops_the_bad_window_and_training_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(
        "launch.nproc_per_node=2",
        FAST_START,
        "policy=cadence",
        "epochs=5",
        "on_nonfinite=skip",
        "simulate.nan_rank=1",
        "simulate.nan_at_step=40",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=150,
    ).check()
    assert "rank 1: non-finite loss at step 40; its window is dropped" in (run_dir / "rank1.log").read_text()
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values())
    records = epochs_of(run_dir)  # strict JSON: the NaN is written as null and named
    assert [r["epoch"] for r in records] == list(range(5))
    assert any("loss" in r.get("nonfinite", []) and r["loss"] is None for r in records)
    assert records[-1]["eval/accuracy"] > 0.85


def test_a_fault_injected_once_the_elastic_agent_s_restart_runs_clean_and_equals_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """simulate.kill_at_step kills rank 1 once per run: the group the agent restarts resumes from the step
    checkpoint before it (below step 30) and passes step 30 clean, ending with the uninterrupted run's
    model bit for bit (sync, CPU)."""
    common = ["launch.nproc_per_node=2", FAST_START, "policy=sync", "epochs=3", "checkpoint_every_steps=7"]
    train(*common, f"hydra.run.dir={tmp_path / 'whole'}", cwd=tmp_path, timeout=240).check()
    killed = tmp_path / "killed"
    result = train(
        *common,
        "launch.max_restarts=1",
        "simulate.kill_rank=1",
        "simulate.kill_at_step=30",
        f"hydra.run.dir={killed}",
        cwd=tmp_path,
        timeout=240,
    )
    assert result.ok, result.out[-6000:]
    assert "was killed by SIGKILL" not in result.out and "resumed from " in result.out, result.out[-6000:]
    assert_complete_run(killed, world=2, epochs=3)
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(killed / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
