"""Ranks spawned by a test (torch.multiprocessing), each in a process group of its own that the test kills
whatever happens; they meet through a TCPStore the parent hosts on a port the OS picks."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# Under the parent's join timeout, so that a stuck rank's stacks reach the report.
STUCK_AFTER_S = 100
JOIN_TIMEOUT_S = 120.0


def _kill(proc: Any) -> None:
    """Terminate, then kill, a rank's process group (each rank leads its own; see join_group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not proc.is_alive():
            return
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:  # killed before it could call setpgrp: never signal the parent's group
                os.kill(proc.pid, sig)
        except ProcessLookupError:
            return
        proc.join(timeout=5)


def run_ranks(worker: Callable[..., None], world: int, out_dir: Path, *args: Any) -> None:
    """Spawn `world` ranks of `worker(rank, port, out_dir, *args)` and wait for them (OMP_NUM_THREADS=1); a
    rank that fails or is stuck fails the test with every rank's stacks."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
        ctx = tmp.start_processes(
            worker, args=(store.port, str(out_dir), *args), nprocs=world, join=False, start_method="spawn"
        )
    deadline = time.monotonic() + JOIN_TIMEOUT_S

    def stacks() -> str:
        return "\n".join(p.read_text() for p in sorted(out_dir.glob("rank*.stacks")))

    try:
        # join() raises with the rank's traceback if one fails (and stops the others); a rank stuck for
        # STUCK_AFTER_S writes its stacks and exits.
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {JOIN_TIMEOUT_S}s; their stacks:\n{stacks()}")
    except tmp.ProcessExitedException as err:
        pytest.fail(f"{err}; the ranks' stacks:\n{stacks()}")
    finally:
        for proc in ctx.processes:
            _kill(proc)
        del store


def join_group(rank: int, port: int, world: int, out_dir: str, backend: str = "gloo") -> None:
    """A spawned rank's start: its own process group, one thread, the parent's store, the process group; a
    rank stuck past STUCK_AFTER_S leaves its threads' stacks for the parent's report, then exits."""
    os.setpgrp()  # so the parent can kill this rank and anything it started in one go
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=COLLECTIVE_TIMEOUT)
    if backend == "nccl":  # one GPU a rank
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    stacks = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(STUCK_AFTER_S, exit=True, file=stacks)


def leave(results: Any, rank: int, out_dir: str) -> None:
    """Save the rank's results and end the process (skipping the interpreter's teardown: seconds, after torch
    pulled in torch._dynamo). On an error the exception propagates to the parent instead."""
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
