"""A stop signal sent to a flodl job under the test hooks that hold its ranks (tests/helpers/held_steps,
held_commit), and what the stopped job printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from flodl.checkpoints.disk import Checkpoint, rank_file, verify
from tests.helpers.procs import REPO, Result, child_env, kill_group, start, wait_for, wait_for_path

# Said by rank 0 under torchrun, by flodl's launcher when it started the ranks.
STOPPED = re.compile(
    r"(?:\[r0\]|flodl:) stopped by (SIG\w+): last checkpoint (\S+) \((after epoch \d+|epoch \d+, \d+ samples "
    r"into it)\); resume with: (.+)"
)

# tests/helpers/held_steps' pace: every step waits 0.1 s first, so a sync stop's agreed step (about two
# seconds of steps ahead, where every checkpoint on the way is committed) is at most ~22 steps past the signal
# on any machine: a short run held at a step still has work left after the stop.
PACED = {"FLODL_TEST_STEP_S": "0.1"}


def paced(**extra: str) -> dict[str, str]:
    """A job's environment additions (`child_env`'s extra): tests/helpers/held_steps' hook, every step PACED
    (the same pace on an idle machine and a busy one); its hold too, with FLODL_TEST_HOLD_* in `extra`."""
    hook = os.pathsep.join([str(REPO / "tests" / "helpers" / "held_steps"), str(REPO)])
    return {"PYTHONPATH": hook, **PACED, **extra}


def hooks_env(tmp_path: Path, hold_at_step: int, **extra: str) -> dict[str, str]:
    """tests/helpers/held_commit's hook (and held_steps' with it): the ranks held at `hold_at_step` until
    tmp_path/release appears; with FLODL_TEST_HOLD_COMMIT_DIR in `extra`, the first commit too."""
    hook = os.pathsep.join([str(REPO / "tests" / "helpers" / "held_commit"), str(REPO)])
    return child_env(
        PYTHONPATH=hook, FLODL_TEST_HOLD_AT_STEP=str(hold_at_step), FLODL_TEST_HOLD_DIR=str(tmp_path), **extra
    )


def log_says(path: Path, pattern: str) -> Callable[[], bool]:
    return lambda: path.is_file() and re.search(pattern, path.read_text()) is not None


TOOK_STOP = r"got SIGTERM: the ranks save a checkpoint at the next"


def sigterm_once_held(
    args: list[str],
    tmp_path: Path,
    env: dict[str, str],
    stop_log: Path,
    held: tuple[str, ...] = ("held",),
    before_release: Callable[[subprocess.Popen], None] | None = None,
) -> Result:
    """Start the job under the held_* hooks (`env`); once the files `held` name are in tmp_path (the hooks'
    signs that they hold the ranks or a commit), SIGTERM its launcher; once `stop_log` says the coordinator
    took the stop, call `before_release`, then let the ranks go. The job must end within 60 s. Its stderr is
    kept apart."""
    proc = start(args, tmp_path, env=env, errors=subprocess.PIPE)
    try:
        for name in held:
            wait_for_path(tmp_path / name, proc)
        os.kill(proc.pid, signal.SIGTERM)
        wait_for(log_says(stop_log, TOOK_STOP), proc, what="the coordinator took the stop")
        if before_release is not None:
            before_release(proc)
        (tmp_path / "release").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    return Result(proc.returncode, out, err=err)


def stopped_by_sigterm(result: Result) -> tuple[Checkpoint, str]:
    """A run a SIGTERM stopped (exit 143) and the one line it printed: the committed checkpoint it names,
    and the command it says resumes the run."""
    assert result.code == 143, result.out[-4000:] + result.err[-4000:]
    (line,) = result.err.strip().splitlines()
    name, checkpoint, _, resume = STOPPED.match(line).groups()  # type: ignore[union-attr]
    assert name == "SIGTERM" and verify(Path(checkpoint)) is None
    return Checkpoint.from_manifest(Path(checkpoint)), resume


def stops_after(log: Path) -> list[int]:
    """The global step each stop that saved left this rank at, oldest first (the log is the whole run's)."""
    return [int(step) for step in re.findall(r"rank \d+ stops after global step (\d+):", log.read_text())]


def check_stop_kept_every_step(run_dir: Path, stopped_at: Checkpoint, stops: int) -> None:
    """After the `stops`-th stop that saved in `run_dir`: no `.partial` dir is left, `latest` is the
    checkpoint the stop named, and each rank's part in it holds the last step the rank trained."""
    checkpoints = run_dir / "checkpoints"
    assert not list(checkpoints.glob("*.partial")), sorted(p.name for p in checkpoints.iterdir())
    assert (checkpoints / "latest").read_text() == stopped_at.path.name
    for rank in stopped_at.part_ranks:
        trained = stops_after(run_dir / f"rank{rank}.log")
        assert len(trained) == stops, trained
        part = torch.load(stopped_at.path / rank_file(rank), weights_only=True)
        assert part["stepper"]["steps_total"] == trained[-1], (rank, stopped_at.path.name, trained)
