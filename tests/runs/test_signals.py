"""Ctrl-C and preemption end to end on 2 gloo ranks: SIGINT to the elastic launcher, SIGTERM to one rank under
torchrun; each run saves a checkpoint at the next boundary (a stop that saves: checkpoints are on) and stops
within seconds, keeps its records, cleans its stage files, and the command it prints finishes it with every
epoch exactly once. SIGUSR1 (Slurm's usual warning) to the elastic launcher saves at the step the sync ranks
agree on. Past stop_grace_s the ranks stop at once, naming the checkpoint they had."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from flodl.checkpoints.disk import Checkpoint, Point, verify
from flodl.job.resume import continues_at
from flodl.metrics.timeline import read_timeline
from tests.helpers.procs import (
    FAST_START,
    PYTHON,
    TRAIN,
    Result,
    child_env,
    finish,
    kill_group,
    leftovers,
    run,
    start,
    wait_for,
    wait_for_path,
)
from tests.helpers.runs import assert_complete_run, epochs_of
from tests.helpers.stops import (
    PACED,
    STOPPED,
    check_stop_kept_every_step,
    hooks_env,
    log_says,
    paced,
    sigterm_once_held,
    stopped_by_sigterm,
)

pytestmark = pytest.mark.multiproc

EPOCHS = 8


def overrides(tmp_path: Path) -> list[str]:
    """A small run whose data spills to the disk stage (pack files in tmp_path/stage)."""
    data = tmp_path / "data"
    return [
        "task=npy_blobs",
        "policy=cadence",
        f"epochs={EPOCHS}",
        "checkpoint_every=1",
        "device=cpu",
        "ram_max_usage=0.0000001",
        "disk_stage_gb=8",
        f"disk_stage_dir={tmp_path / 'stage'}",
        f"+task.train_data.folder={data}",
        "+task.train_data.samples=3000",
        f"+task.eval_data.folder={data}",
        "+task.eval_data.samples=600",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]


# npy_blobs' 3000 samples in steps of 64 on 2 ranks: 23 or 24 steps a rank an epoch; this one is in the third
# (the hold begins at the first step from here once the second checkpoint is committed).
HELD_AT_STEP = 55


def stop_mid_run(
    args: list[str], tmp_path: Path, signum: int, target: Callable[[subprocess.Popen], int]
) -> Result:
    """Start the job, its ranks held in the third epoch (tests/helpers/held_steps); once its second checkpoint
    is committed, send `signum` to `target(job)`, and let the ranks go once the coordinator took the stop: the
    run surely has work left. The job must end within 10 s of that. Its stderr is kept apart."""
    (tmp_path / "stage").mkdir()
    # Held only once the second checkpoint is committed: its commit waits for the ranks' receipts, which a
    # rank held before it (a loaded machine's part writer still busy at the step) would never send.
    second = tmp_path / "run" / "checkpoints" / "epoch-000002"
    env = hooks_env(tmp_path, HELD_AT_STEP, FLODL_TEST_HOLD_AFTER=str(second))
    proc = start(args, tmp_path, env=env, errors=subprocess.PIPE)
    try:
        wait_for_path(second, proc)
        wait_for_path(tmp_path / "held", proc)
        assert list((tmp_path / "stage").iterdir()), "the ranks staged nothing to disk"
        os.kill(target(proc), signum)
        took = log_says(
            tmp_path / "run" / "rank0.log", r"got SIG\w+: the ranks save a checkpoint at the next"
        )
        wait_for(took, proc, what="the coordinator took the stop")
        (tmp_path / "release").touch()
        sent = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - sent < 10, f"stopped after {time.monotonic() - sent:.1f} s:\n{out[-4000:]}"
    finally:
        kill_group(proc)
    return Result(proc.returncode, out, err=err)


def check_stopped_and_resume(result: Result, tmp_path: Path, signame: str, saved: bool = True) -> None:
    """What every stopped run must leave behind, then the printed command finishes it. `saved`: the stop
    saved a checkpoint of its own, newer than the second (there when the signal was sent)."""
    terminal = result.out + result.err
    assert not re.search(r'File "[^"]*/flodl/', terminal), terminal[-4000:]  # no traceback of flodl's
    lines = STOPPED.findall(terminal)
    assert len(lines) == 1, result.out[-4000:]  # one line, from rank 0
    got, checkpoint, where, resume = lines[0]
    assert got == signame and verify(Path(checkpoint)) is None
    stopped_at = Checkpoint.from_manifest(Path(checkpoint))
    point = stopped_at.point
    assert where == point.words()
    if saved:
        assert point.order > Point(1).order, checkpoint  # the stop's own, after the second epoch's
    run_dir = tmp_path / "run"
    recorded = [r["epoch"] for r in epochs_of(run_dir)]  # 0-based
    whole = point.last_whole_epoch + 1
    assert recorded[:whole] == list(range(whole)) and whole >= 2 and len(recorded) < EPOCHS
    assert read_timeline(run_dir)["epochs"]
    assert list((tmp_path / "stage").iterdir()) == []  # every pack file removed
    assert not leftovers(tmp_path)
    resumed = run(shlex.split(resume), cwd=tmp_path, timeout=240).check()
    assert f"training continues {continues_at(stopped_at)}" in resumed.out, resumed.out[-4000:]
    assert_complete_run(run_dir, world=2, epochs=EPOCHS)  # every epoch exactly once, in order


def rank_pid(tmp_path: Path, rank: int) -> int:
    return int(re.search(r"\(pid (\d+)\)", (tmp_path / "run" / f"rank{rank}.log").read_text()).group(1))


def test_sigint_to_the_elastic_launcher_stops_every_rank_and_the_printed_command_resumes(
    tmp_path: Path,
) -> None:
    args = [PYTHON, TRAIN, "launch.nproc_per_node=2", FAST_START, *overrides(tmp_path)]
    result = stop_mid_run(args, tmp_path, signal.SIGINT, lambda proc: proc.pid)
    assert result.code == 130, result.out[-4000:]
    assert "Traceback" not in result.out, result.out[-4000:]
    # The launcher's line is all of stderr: torch's reports and gloo's native stack frames are in the run dir.
    assert len(result.err.strip().splitlines()) == 1 and STOPPED.match(result.err), result.err[-4000:]
    check_stopped_and_resume(result, tmp_path, "SIGINT")


def _spawned(launcher: psutil.Process) -> int:
    """How many of the launcher's children are spawned ranks (a short-lived other child may be gone)."""
    count = 0
    for child in launcher.children():
        with contextlib.suppress(psutil.Error):
            count += "spawn_main" in " ".join(child.cmdline())
    return count


def test_ctrl_c_while_the_self_launched_ranks_start_stops_them_in_one_line(tmp_path: Path) -> None:
    """The terminal's SIGINT reaches the launcher and its spawned ranks, still importing torch."""
    proc = start(
        [PYTHON, TRAIN, "launch.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        errors=subprocess.PIPE,
    )
    try:
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        while _spawned(launcher) < 2:
            assert proc.poll() is None, f"the job ended early:\n{proc.communicate()[0][-4000:]}"
            assert time.monotonic() < deadline, "the ranks were not started within 120 s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: to every process of the job
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, out[-4000:] + err[-4000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flodl: stopped by SIGINT: "), err[-6000:]
    assert "Traceback" not in out, out[-4000:]
    assert not leftovers(tmp_path)


def test_sigterm_to_one_rank_under_flodl_torchrun_stops_every_rank_and_the_printed_command_resumes(
    tmp_path: Path,
) -> None:
    args = [
        PYTHON,
        "-m",
        "flodl.torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "--monitor-interval=0.1",
        TRAIN,
        *overrides(tmp_path),
    ]
    result = stop_mid_run(args, tmp_path, signal.SIGTERM, lambda proc: rank_pid(tmp_path, 1))
    # Plain torchrun would print a ChildFailedError report with a traceback and exit 1.
    assert result.code == 143, result.out[-4000:]
    assert "Traceback" not in result.out and "ChildFailedError" not in result.out, result.out[-4000:]
    check_stopped_and_resume(result, tmp_path, "SIGTERM")


def test_a_forked_child_such_as_a_dataloader_worker_keeps_the_default_signal_behaviour(
    tmp_path: Path,
) -> None:
    child = (
        "import os, signal, sys\n"
        "from flodl.links.stop import catch_stop_signals\n"
        "catch_stop_signals()\n"
        "codes = []\n"
        "for signum in (signal.SIGTERM, signal.SIGINT):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            os.kill(os.getpid(), signum)\n"
        "            signal.pause()\n"
        "        except KeyboardInterrupt:\n"
        "            os._exit(7)\n"
        "    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "print(codes)\n"
    )
    out = run([PYTHON, "-c", child], cwd=tmp_path, timeout=60).check().out
    # SIGTERM ends the child by the signal; SIGINT is a KeyboardInterrupt there, as torch's workers expect.
    assert out.strip().splitlines()[-1] == f"[{-signal.SIGTERM}, 7]", out


def _stop_after_first_checkpoint(args: list[str], tmp_path: Path, signum: int = signal.SIGTERM) -> Result:
    """Start SYNC_STOP's job, its steps paced; signal its launcher once its first checkpoint is in."""
    proc = start(args, tmp_path, env=child_env(**paced()), errors=subprocess.PIPE)
    try:
        wait_for_path(tmp_path / "run" / "checkpoints" / "epoch-000001", proc)
        os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    return Result(proc.returncode, out, err=err)


# Digits under sync on 2 ranks: 22 steps of 32 samples an epoch on each.
SYNC_DIGITS = ["launch.nproc_per_node=2", FAST_START, "policy=sync", "epochs=3"]
# Run with its steps paced (paced(): 0.1 s a step, an epoch 2.2 s or so on any machine): a stop sent after
# the first epoch lands inside the run. (simulate.factor=40 had slowed a rank by 40 times whatever its step
# took: 5 to 8 s an epoch on 2 busy cores, and the resumed run too.)
SYNC_STOP = [*SYNC_DIGITS, "checkpoint_every=1"]


def test_a_sync_run_stopped_at_a_step_saves_there_and_resumed_ends_bitwise_equal_to_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """With checkpoints by time (every second, at steps the ranks agree on): they change nothing trained."""
    timed = [*SYNC_STOP, "checkpoint_every_s=1", "checkpoint_keep=50"]
    whole = tmp_path / "whole"
    # The uninterrupted run trains beside the stopped one: both paced, mostly waiting.
    uninterrupted = start([PYTHON, TRAIN, *timed, f"hydra.run.dir={whole}"], tmp_path, child_env(**paced()))
    try:
        result = _stop_after_first_checkpoint(
            [PYTHON, TRAIN, *timed, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, signal.SIGUSR1
        )
        first = finish(uninterrupted, 240).check()
    finally:
        kill_group(uninterrupted)
    inside = list((whole / "checkpoints").glob("*-sample-*"))
    assert inside and all(verify(path) is None for path in inside), first.out[-4000:]
    assert result.code == 138, result.out[-4000:] + result.err[-4000:]
    (line,) = result.err.strip().splitlines()
    name, checkpoint, _, resume = STOPPED.match(line).groups()  # type: ignore[union-attr]
    assert name == "SIGUSR1"
    point = Checkpoint.from_manifest(Path(checkpoint)).point
    assert point.order > Point(0).order  # saved at the stop, after the first epoch's checkpoint
    resumed = run(shlex.split(resume), cwd=tmp_path, timeout=240).check()
    assert "training continues" in resumed.out
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The same records; an epoch's training loss summed in float32 in two chunks around the stop differs in
    # its last bits from one chunk's.
    shown = ("epoch", "step", "lr", "eval/loss")
    stopped, ran = epochs_of(tmp_path / "run"), epochs_of(whole)
    assert [[r[k] for k in shown] for r in stopped] == [[r[k] for k in shown] for r in ran]
    assert [r["loss"] for r in stopped] == pytest.approx([r["loss"] for r in ran], rel=1e-6)


@pytest.mark.parametrize("policy", ["cadence", "sync"])
def test_under_survive_a_stop_saves_at_the_next_boundary_and_the_printed_command_resumes(
    tmp_path: Path, policy: str
) -> None:
    """Survive's launcher hosts the run and supervises the ranks: it forwards the signal, the coordinator has
    the members save, and no rank that stopped is started again. A rank holds in the second epoch until the
    coordinator took the stop (tests/helpers/held_steps), each step paced: the run surely has work left."""
    run_dir = tmp_path / "run"
    args = [
        PYTHON,
        TRAIN,
        "launch.nproc_per_node=2",
        FAST_START,
        f"policy={policy}",
        "epochs=4",
        "checkpoint_every=1",
        "fault_tolerance=survive",
        f"hydra.run.dir={run_dir}",
    ]
    # Digits: 22 steps of 32 samples an epoch on each of 2 ranks (sync), about as many under cadence.
    env = child_env(**paced(FLODL_TEST_HOLD_AT_STEP="30", FLODL_TEST_HOLD_DIR=str(tmp_path)))
    result = sigterm_once_held(args, tmp_path, env, stop_log=run_dir / "coordinator.log")
    stopped_at, resume = stopped_by_sigterm(result)
    # The stop's own, past where the ranks were held: in the second epoch (or at its end; sync's agreed step
    # may be in the third), both members' parts.
    assert stopped_at.point.epoch in (1, 2) and stopped_at.point.order > Point(0).order, stopped_at.path
    assert stopped_at.part_ranks == (0, 1)
    check_stop_kept_every_step(run_dir, stopped_at, stops=1)
    launcher = (run_dir / ".launch" / "launcher.log").read_text()
    assert "starting it again" not in launcher, launcher[-3000:]
    _resume_finishes(resume, stopped_at, tmp_path, epochs=4)


def test_a_stop_that_cannot_save_within_stop_grace_s_stops_at_once_naming_the_checkpoint_it_had(
    tmp_path: Path,
) -> None:
    args = [PYTHON, TRAIN, *SYNC_STOP, "stop_grace_s=0.001", f"hydra.run.dir={tmp_path / 'run'}"]
    result = _stop_after_first_checkpoint(args, tmp_path)
    assert result.code == 143, result.out[-4000:] + result.err[-4000:]
    (line,) = result.err.strip().splitlines()
    _, checkpoint, _, _ = STOPPED.match(line).groups()  # type: ignore[union-attr]
    assert Path(checkpoint).name == "epoch-000001" or Checkpoint.from_manifest(Path(checkpoint)).into is None
    assert not list((tmp_path / "run" / "checkpoints").glob("*-sample-*"))  # nothing saved inside an epoch
    # Each rank's last checkpoint (the first epoch's) took longer than the budget: no rank waits it out.
    logs = "".join((tmp_path / "run" / f"rank{r}.log").read_text() for r in (0, 1))
    assert re.search(
        r"the stop could not save \(this rank's last checkpoint took [\d.e-]+ s, more than "
        r"stop_grace_s=0.001\)",
        logs,
    ), logs[-3000:]


def test_with_the_default_config_a_stop_saves_and_the_printed_command_resumes(tmp_path: Path) -> None:
    """No checkpoint_every* key given: a SIGTERM in the second epoch still saves the stop's checkpoint (the
    ranks held there until the coordinator took the stop), and its command finishes the run."""
    run_dir = tmp_path / "run"
    args = [PYTHON, TRAIN, *SYNC_DIGITS, f"hydra.run.dir={run_dir}"]
    env = hooks_env(tmp_path, 30, **PACED)
    result = sigterm_once_held(args, tmp_path, env, stop_log=run_dir / "rank0.log")
    stopped_at, resume = stopped_by_sigterm(result)
    assert stopped_at.point.order > Point(0).order, stopped_at.path  # the stop's own, past the first epoch's
    _resume_finishes(resume, stopped_at, tmp_path, epochs=3)


def test_a_sync_stop_saves_its_own_checkpoint_when_an_earlier_one_commits_after_the_signal(
    tmp_path: Path,
) -> None:
    """The first scheduled checkpoint's commit is held (tests/helpers/held_commit) and the ranks are held at
    step 12; the stop is taken, then that commit finishes, then the ranks go on: the run stops at a
    checkpoint taken after the signal, committed and named (not the held one), and leaves no `.partial`
    dir."""
    run_dir = tmp_path / "run"
    args = [PYTHON, TRAIN, *SYNC_DIGITS, "checkpoint_every_steps=5", f"hydra.run.dir={run_dir}"]
    env = hooks_env(tmp_path, 12, FLODL_TEST_HOLD_COMMIT_DIR=str(tmp_path), **PACED)
    rank0 = run_dir / "rank0.log"

    def let_the_held_commit_finish(proc: subprocess.Popen) -> None:
        (tmp_path / "commit-release").touch()
        wait_for(log_says(rank0, r"checkpoint epoch 1, \d+ samples into it: "), proc, what="the commit")

    result = sigterm_once_held(
        args, tmp_path, env, rank0, held=("commit-held", "held"), before_release=let_the_held_commit_finish
    )
    stopped_at, resume = stopped_by_sigterm(result)
    # Past the step the ranks were held at (12 steps of 2 ranks x 32 samples): taken after the stop.
    assert stopped_at.point.order > Point(0, 12 * 64).order, stopped_at.path
    check_stop_kept_every_step(run_dir, stopped_at, stops=1)  # every part written up to it committed
    _resume_finishes(resume, stopped_at, tmp_path, epochs=3)


def _resume_finishes(resume: str, stopped_at: Checkpoint, cwd: Path, epochs: int) -> None:
    """The printed command continues where the stop's checkpoint is and completes every epoch."""
    resumed = run(shlex.split(resume), cwd=cwd, timeout=240).check()
    assert f"training continues {continues_at(stopped_at)}" in resumed.out, resumed.out[-4000:]
    assert_complete_run(stopped_at.path.parent.parent, world=2, epochs=epochs)
