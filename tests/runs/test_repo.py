"""The repository's own rules: its layout, the hooks a commit runs, tests that share only tests/helpers/."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.procs import PYTHON, finish, start


@pytest.mark.multiproc
def test_a_job_that_writes_more_than_a_pipe_holds_goes_on_while_the_test_waits(tmp_path: Path) -> None:
    """Tests and benchmarks watch a running job for an event; its output must not stall it meanwhile (a pipe
    nobody reads blocks the writer at 64 KiB, and with it the job's logging lock)."""
    marker = tmp_path / "went-on"
    script = f"import sys; sys.stdout.write('x' * (1 << 20)); sys.stdout.flush(); open({str(marker)!r}, 'w')"
    proc = start([PYTHON, "-c", script], tmp_path)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None or marker.exists(), "the job ended without going on"
        assert time.monotonic() < deadline, "the job stalled on its own output"
        time.sleep(0.05)
    assert finish(proc, timeout=60).check().out == "x" * (1 << 20)
