"""A process of a GPU rank's own that writes its checkpoint parts, so that writing shares nothing with the
training thread.

On a GPU the training thread is a Python thread launching kernels: a writer thread beside it (torch.save's
pickling, the file's writes, the fsync) takes the interpreter's lock from it often enough to slow every step
while a part is written (a probe on one H200, gpt_nano's step with a part of its state written beside it:
8-9% slower from a thread, 0.6% from a process). The rank copies its state into a shared-memory region
(flodl/worker/host_snapshot.py); the process maps it once and is sent, per part, only the state's structure
with `Slot`s in place of its tensors.

Once its imports are done (the rank waits for that before it trains, so they do not run beside training) it
runs at idle priority (Linux's SCHED_IDLE): it writes on cores training leaves idle, never in training's way.
Where every core trains (CPU ranks), parts then take longer and checkpoints by time come at the pace idle
cores allow; a rank whose next save finds the last part unwritten waits for it, leaving its core to the
writer. CPU ranks write on a thread unless asked (`checkpoint_writer=process`): a process costs a torch
import per rank at the start, which only frequent checkpoints repay (bench/checkpoint_stall.py).

The process ignores the stop signals (a stop saves a checkpoint: its parent decides when it ends) and dies
with its parent (Linux: the parent-death signal; elsewhere at the end of its pipe)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # shares the region through its file descriptor, not a copy

from flodl.checkpoints.disk import CheckpointError, write_part_file
from flodl.links.stop import STOP_SIGNALS
from flodl.worker.host_snapshot import HostRegion, carve, fill

_PR_SET_PDEATHSIG = 1


class PartWriterProcess:
    """The rank's side: start the process, hand it parts to write, wait for each."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA, no threads inherited
        self._pipe, child = context.Pipe()
        self._process = context.Process(
            target=serve, args=(child, os.getpid()), name=f"flodl-part-writer-{rank}", daemon=True
        )
        self._process.start()  # its imports run while the rank sets up; it waits for them before it trains
        child.close()
        self._mapped: HostRegion | None = None  # the region the process has mapped
        self._ready = False

    def wait_ready(self) -> None:
        """Wait until the process has started (its imports done), so that they do not run beside training.
        A process that ended raises `WriterGone`."""
        if self._ready:
            return
        try:
            self._pipe.recv()
        except (EOFError, OSError) as err:
            raise self._gone("as it started") from err
        self._ready = True

    def write(self, region: HostRegion, files: list[tuple[Path, Any]]) -> None:
        """Write each (path, skeleton) from `region`; returns once every file is on disk. A process that
        ended raises `WriterGone`; a write that failed there raises CheckpointError naming its file."""
        self.wait_ready()
        try:
            self._pipe.send((region.bytes if region is not self._mapped else None, files))
            self._mapped = region
            failure = self._pipe.recv()
        except (EOFError, OSError) as err:
            raise self._gone(f"while writing {files[0][0]}") from err
        if failure is not None:
            raise CheckpointError(f"rank {self.rank}: {failure}")

    def _gone(self, when: str) -> WriterGone:
        """What to raise once its pipe broke: the process ended, `when`, with its exit code."""
        self._process.join(timeout=5)
        return WriterGone(f"the checkpoint writer process ended (exit code {self._process.exitcode}) {when}")

    def close(self) -> None:
        with contextlib.suppress(OSError):  # it ended already
            self._pipe.send(None)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._pipe.close()


class WriterGone(RuntimeError):
    """The writer process is not there any more (killed by hand or for memory, or it never started)."""


def serve(pipe: Connection, parent: int) -> None:
    """The process: write the parts it is sent until its parent says so or goes."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform == "linux":  # sent when the thread that started this process ends: the rank's main one
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it went before the death signal was set up
        return
    torch.set_num_threads(1)
    if hasattr(os, "SCHED_IDLE"):  # Linux: it writes on cores training leaves idle, never in training's way
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    pipe.send("ready")
    region: torch.Tensor | None = None
    while True:
        try:
            message = pipe.recv()
        except EOFError:
            return
        if message is None:
            return
        mapped, files = message
        if mapped is not None:
            region = mapped
        assert region is not None, "a part sent before its region"
        for path, skeleton in files:
            try:
                write_part_file(fill(skeleton, functools.partial(carve, region)), Path(path))
            except Exception as err:
                pipe.send(f"writing {path}: {type(err).__name__}: {err}")
                break
        else:
            pipe.send(None)
