"""The join card: what a running job that may grow (launch.max_ranks) says in its run dir, for as long as it
runs, so that `flodl-join` (flodl/launcher/join.py) can start a rank in it."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CARD = Path(".launch") / "join.json"


@dataclass(frozen=True)
class JoinCard:
    """What a rank needs to join the running job: its store, its seats, its config and its names."""

    store_addr: str
    store_port: int
    # The ranks the job started with (seats 0..world_size-1, under its own supervisor) and its most at once.
    world_size: int
    capacity: int
    config: dict[str, Any]
    info: dict[str, Any]
    start_method: str
    timeout_s: float
    # Where the job's ranks run and import from: the working dir and sys.path of the process that writes the
    # card, the job's launcher, which its ranks inherit (flodl-train puts the user's project dir first).
    cwd: str = field(default_factory=os.getcwd)
    sys_path: list[str] = field(default_factory=lambda: [os.path.abspath(entry) for entry in sys.path])


def write_card(run_dir: Path, card: JoinCard) -> Path:
    path = run_dir / CARD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(card)))
    tmp.replace(path)  # a joiner reads a whole card or none
    return path


class JoinError(RuntimeError):
    """A rank cannot join (no running job that takes ranks, its task does not import here, no free seat): the
    message says what to do."""


def read_card(run_dir: Path) -> JoinCard:
    path = run_dir / CARD
    if not path.is_file():
        raise JoinError(
            f"no running job that takes more ranks in {run_dir} (no {CARD}): start it with "
            "fault_tolerance=survive and launch.max_ranks above its ranks, and run flodl-join while it trains"
        )
    return JoinCard(**json.loads(path.read_text()))
