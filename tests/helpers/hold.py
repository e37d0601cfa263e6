"""The handshake by files of the test hooks that hold a process (tests/helpers/held_steps, held_commit): they
import it as tests.helpers.hold, the repo being on their PYTHONPATH after the hook's folder."""

from __future__ import annotations

import time
from pathlib import Path


def hold_until_released(held: Path, release: Path) -> None:
    """Touch `held`, the test's sign that the process is held here, and wait until the test creates
    `release`."""
    held.touch()
    while not release.exists():
        time.sleep(0.02)
