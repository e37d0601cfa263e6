"""A test hook, loaded at start-up by every Python process that has this folder on PYTHONPATH: with
$FLODL_TEST_SAMPLE_LOG set (a dir) and $FLODL_TEST_SAMPLE_START (which start of the job this process belongs
to), every training step a rank takes appends one JSON line to `<start>-rank<R>-<pid>.jsonl` in that dir:
the epoch, the rank's step count after it (`steps_total`, as its checkpoint part holds it) and the sample ids
it trained (the step's picks; with augment=1 a pick is its sample's id). The line is written once the
optimizer stepped, unbuffered: a process killed after it still leaves it. tests/helpers/chaos.py reads these
files back. It loads tests/helpers/held_steps' hook too ($FLODL_TEST_STEP_S paces the steps). With
$FLODL_TEST_KILL_BEFORE_REPORT=R:N the first process of rank R SIGKILLs itself as it is about to send its N-th
chunk report: after the chunk's steps, before the coordinator hears of them (tests/runs/
test_sharded_survive.py)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).parent.parent / "held_steps" / "sitecustomize.py"))

_DIR = os.environ.get("FLODL_TEST_SAMPLE_LOG")

if _DIR:
    import json
    from typing import Any

    from torch import Tensor

    from flodl.worker.stepper import Stepper

    _load_step = Stepper.load_step
    _step = Stepper.step
    _LOGS = Path(_DIR)
    _LOGS.mkdir(parents=True, exist_ok=True)
    _trained: dict[int, tuple[int, list[int]]] = {}  # the stepper's (id) next step: its epoch and picks

    def _logged_load_step(self: Stepper, picks: Tensor, epoch: int) -> list[Any]:
        _trained[id(self)] = (epoch, picks.tolist())
        return _load_step(self, picks, epoch)

    def _logged_step(self: Stepper, micro_batches: list[Any]) -> Tensor:
        loss = _step(self, micro_batches)
        epoch, picks = _trained.pop(id(self))
        rank = os.environ.get("RANK", "0")
        name = f"{os.environ.get('FLODL_TEST_SAMPLE_START', '0')}-rank{rank}-{os.getpid()}.jsonl"
        line = json.dumps({"epoch": epoch, "step": self.steps_total, "ids": picks}) + "\n"
        fd = os.open(_LOGS / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return loss

    Stepper.load_step = _logged_load_step  # type: ignore[method-assign]
    Stepper.step = _logged_step  # type: ignore[method-assign]

_KILL_BEFORE_REPORT = os.environ.get("FLODL_TEST_KILL_BEFORE_REPORT")

if _KILL_BEFORE_REPORT:
    import signal

    from flodl.links.messages import ChunkReport, Message
    from flodl.worker.base import WorkerBase

    _report = WorkerBase.report
    _reports = [0]

    def _report_or_die(self: WorkerBase, message: Message) -> None:
        # Its incarnation as the run knows it: a spare, started before the death, took over as a restart
        # with the environment of a first process.
        if isinstance(message, ChunkReport) and getattr(self.group, "incarnation", 0) == 0:
            _reports[0] += 1
            if f"{self.rank}:{_reports[0]}" == _KILL_BEFORE_REPORT:
                os.kill(os.getpid(), signal.SIGKILL)
        _report(self, message)

    WorkerBase.report = _report_or_die  # type: ignore[method-assign]
