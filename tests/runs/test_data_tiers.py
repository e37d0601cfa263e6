"""The staging tiers and the feeder on real files: the same batches as the source, whatever tier serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl.data.pack import PackFile
from tests.helpers.procs import REPO, child_env

_HOLD_A_PACK = """
import sys, time
from flodl.data.pack import PackFile
pack = PackFile(sys.argv[1], 1 << 20)
print(pack.path, flush=True)
time.sleep(120)
"""


@pytest.mark.multiproc
def test_pack_file_of_a_killed_process_is_removed_at_the_next_start(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_PACK, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
        start_new_session=True,
    )
    try:
        path = Path(proc.stdout.readline().strip())  # type: ignore[union-attr]
        assert path.exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert path.exists()  # no chance to clean up
    deadline = time.monotonic() + 10
    while not _dead(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = PackFile(tmp_path, 1 << 20)
    assert not path.exists()
    assert fresh.path.exists()
    fresh.close()
    assert list(tmp_path.glob("*.pack")) == []


def _dead(pid: int) -> bool:
    import psutil

    return not psutil.pid_exists(pid)
