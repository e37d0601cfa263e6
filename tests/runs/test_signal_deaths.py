"""The launcher sees which ranks a signal killed as they die, and leaves them for torch's agent to reap
(flodl/launcher/signal_deaths.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flodl.launcher.signal_deaths import SignalDeaths
from tests.helpers.procs import PYTHON, REPO, child_env

RUN = "run-uid-1"


def _rank(run_dir: Path, attempt: int, rank: int) -> subprocess.Popen:
    """A process that records itself as `rank` of RUN's attempt `attempt`, says so, and waits for a line."""
    code = (
        "import sys; from pathlib import Path; from flodl.job import failures; "
        f"failures.record_pid(Path({str(run_dir)!r}), {RUN!r}, {attempt}, {rank}); "
        "print('recorded', flush=True); sys.exit(int(sys.stdin.readline() or 0))"
    )
    pipe, env = subprocess.PIPE, child_env()
    child = subprocess.Popen([PYTHON, "-c", code], cwd=REPO, env=env, stdin=pipe, stdout=pipe, text=True)
    assert child.stdout is not None and child.stdout.readline() == "recorded\n"
    return child


def _until(happened: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait for the launcher's watch to see a death, without reaping a child."""
    deadline = time.monotonic() + timeout
    while not happened():
        assert time.monotonic() < deadline, "the launcher's watch did not see the death"
        time.sleep(0.02)


@pytest.mark.multiproc
def test_a_rank_killed_by_a_signal_is_named_and_left_for_the_agent_to_reap(tmp_path: Path) -> None:
    with SignalDeaths(tmp_path, RUN) as deaths:
        failed, killed, stopped = (_rank(tmp_path, 1, rank) for rank in range(3))
        earlier = _rank(tmp_path, 0, 1)  # rank 1 of the attempt before
        stopped.terminate()  # the agent's SIGTERM to a rank left: not what began it
        os.waitid(os.P_PID, stopped.pid, os.WEXITED | os.WNOWAIT)  # dead, looked at before the others
        killed.kill()
        earlier.kill()
        _until(lambda: deaths.began(1, None) == {1: "SIGKILL"} and deaths.began(0, None) == {1: "SIGKILL"})
        failed.communicate("1\n")  # a peer that failed on its own word: its record names it
        # The agent still reaps them: their exit statuses were looked at, not taken.
        assert (killed.wait(), earlier.wait(), stopped.wait(), failed.returncode) == (-9, -9, -15, 1)
        assert deaths.began(1, None) == {1: "SIGKILL"}
        # A death seen long after the first failure a rank recorded is the agent's SIGKILL, not the cause.
        assert deaths.began(1, first_record=time.time() - 60) == {}
    assert not [t for t in threading.enumerate() if t.name == "flodl-rank-deaths"]  # the watch ended with it
