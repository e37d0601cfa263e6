"""Rank side of tests/runs/test_supervisor.py: the entry the supervisor starts as each rank.

A rank counts its starts in the supervisor's store, makes ready what the test's plan says for it (signal
handlers), records the start (its pid and the variables the supervisor set) as a JSON line in
<out>/rank<r>.starts, publishes its pid under its start's number, then acts. Only a rank's first start
follows the plan; after that (and by default) it waits until the test sets RELEASE and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

from torch.distributed import TCPStore

RELEASE = "test/release"
# The run's end, as the run's host would say it (what `supervise` waits for).
ENDED = "test/ended"
VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)
# Long past any test's timeout: a rank the test lost ends on its own.
_WAIT_S = 60


def started_key(rank: int) -> str:
    return f"test/started/{rank}"


def kill_key(rank: int) -> str:
    """Set by the test: the "kill-when-told" rank SIGKILLs itself now."""
    return f"test/kill/{rank}"


def pid_key(rank: int, start: int) -> str:
    """Where the `start`-th start (from 1) of `rank` publishes its pid, once its plan is in place."""
    return f"test/pid/{rank}/{start}"


def rank_main(port: int, out: str, plan: dict[int, str]) -> None:
    """One rank. Plans: "kill" (SIGKILL itself; "kill-when-told": once the test sets `kill_key`), "hang"
    (SIGSTOP itself), "stubborn" (ignores SIGTERM), "record-stop" (writes the stop signal it gets to
    rank<r>.signal, exits 128 + it), "exit:N" (exits N once every rank published its pid)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = Path(out)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=_WAIT_S))
    start = store.add(started_key(rank), 1)
    action = plan.get(rank, "") if start == 1 else ""
    if action == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif action == "record-stop":

        def record(signum: int, frame: FrameType | None) -> None:
            (out_dir / f"rank{rank}.signal").write_text(signal.Signals(signum).name)
            os._exit(128 + signum)

        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, record)
    with open(out_dir / f"rank{rank}.starts", "a") as starts:
        starts.write(json.dumps({"pid": os.getpid(), **{v: os.environ[v] for v in VARIABLES}}) + "\n")
    store.set(pid_key(rank, start), str(os.getpid()))
    if action == "kill-when-told":
        store.wait([kill_key(rank)])
    if action.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("exit:"):
        store.wait([pid_key(peer, 1) for peer in range(world)])
        sys.exit(int(action.removeprefix("exit:")))
    # Short sleeps, not store.wait: a signal's Python handler runs only between them.
    deadline = time.monotonic() + _WAIT_S
    while not store.check([RELEASE]):
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: the test never released it")
        time.sleep(0.05)
