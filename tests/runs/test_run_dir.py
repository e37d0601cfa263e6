"""Run dirs, run identity, the metrics file and the closed rendezvous, one function at a time (real files,
real stores, real processes where a pid must be alive or dead)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flodl.launcher.run_dir import OWNER_FILE, RunDirTaken, claim_run_dir


def _owner(run_dir: Path, uid: str, pid: int) -> None:
    started = psutil.Process(pid).create_time()
    record = {"uid": uid, "host": socket.gethostname(), "pid": pid, "pid_started": started}
    (run_dir / OWNER_FILE).write_text(json.dumps(record))


@pytest.mark.multiproc
def test_a_dir_a_live_run_owns_is_refused_and_a_dead_run_s_is_taken_over(tmp_path: Path) -> None:
    _owner(tmp_path, "other", os.getpid())  # this test process: alive
    with pytest.raises(RunDirTaken, match=rf"run dir {tmp_path} belongs to run other, still running"):
        claim_run_dir(tmp_path, "mine")
    claim_run_dir(tmp_path, "other")  # its own dir: a restart of that run
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    record = {
        "uid": "other",
        "host": socket.gethostname(),
        "pid": ended.pid,
        "pid_started": psutil.Process(ended.pid).create_time(),
    }
    ended.wait()
    (tmp_path / OWNER_FILE).write_text(json.dumps(record))
    claim_run_dir(tmp_path, "mine")
    assert json.loads((tmp_path / OWNER_FILE).read_text())["uid"] == "mine"
