"""Why a run's ranks failed, and which failure began it: the one line the launcher prints.

A rank that flodl's launcher started records its pid first (`.launch/pid-<run uid>-<restart>-<rank>`):
the launcher names by it a rank that a signal killed (flodl/launcher/signal_deaths.py). Every rank that
fails records why in the run dir (`.launch/failure-<run uid>-<restart>-<rank>.json`, its first cause only:
what it does after that follows from it) before it leaves; a run resumed in the same dir has a uid of its own.
Once the ranks are gone, the launcher blames one of them (`blame`):
- a rank that died by a signal without a record (SIGKILL, the OOM killer, a crash in native code) began it:
  its peers' errors (a collective whose peer left) follow from its death;
- else a rank's own fault before one that only follows from another process's (`Consequence`: the run's
  host could not start, and each rank stops with it, possibly recording that before the host records why);
- else the fault that names the earliest training step: under sync a non-finite loss reaches every rank
  through the gradient all-reduce, each rank catching it a step later at its own chunk end, in any order;
- else the record written first.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from flodl.logs import one_line


class Consequence(RuntimeError):
    """A rank's failure that follows from another process's: never blamed over that one's own record."""


@dataclass(frozen=True)
class Failure:
    rank: int
    # When the rank recorded it (time.time()).
    time: float
    # The exception's class name and its message, on one line.
    error: str
    message: str
    # The training step at which the fault arose, when it names one (a non-finite loss).
    step: int | None = None
    # An end the run planned (survive's min_ranks), not a fault.
    planned: bool = False
    # The signal that killed a rank that recorded nothing (seen by the launcher).
    killed_by: str | None = None
    # It follows from another process's failure (a `Consequence`).
    follows: bool = False

    @property
    def cause(self) -> str:
        return f"{self.error}: {self.message}"


def _path(run_dir: Path, run: str, restart: int, rank: int | str) -> Path:
    return run_dir / ".launch" / f"failure-{run}-{restart}-{rank}.json"


def _pid_path(run_dir: Path, run: str, restart: int | str, rank: int | str) -> Path:
    return run_dir / ".launch" / f"pid-{run}-{restart}-{rank}"


def record_pid(run_dir: Path, run: str, restart: int, rank: int) -> None:
    """Record that this process is `rank` of run `run`, attempt `restart`."""
    path = _pid_path(run_dir, run, restart, rank)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(os.getpid()))


def rank_pids(run_dir: Path, run: str) -> dict[int, tuple[int, int]]:
    """The process id -> (attempt, rank) of every rank of run `run` that recorded its own."""
    found = {}
    for path in (run_dir / ".launch").glob(_pid_path(run_dir, run, "*", "*").name):
        with contextlib.suppress(OSError, ValueError):
            restart, rank = path.name.removeprefix(f"pid-{run}-").split("-")
            found[int(path.read_text())] = (int(restart), int(rank))
    return found


def record(
    run_dir: Path,
    run: str,
    restart: int,
    rank: int,
    err: BaseException,
    step: int | None = None,
    planned: bool = False,
) -> None:
    """Record why `rank` of run `run` (its uid), attempt `restart`, fails: its first cause only."""
    path = _path(run_dir, run, restart, rank)
    failure = Failure(
        rank,
        time.time(),
        type(err).__name__,
        one_line(str(err)),
        step,
        planned,
        follows=isinstance(err, Consequence),
    )
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(json.dumps(asdict(failure)))


def recorded(run_dir: Path, run: str, restart: int, rank: int | None = None) -> list[Failure]:
    """The failures the ranks of run `run`, attempt `restart` (or only `rank`), recorded."""
    found = []
    for path in (run_dir / ".launch").glob(_path(run_dir, run, restart, "*" if rank is None else rank).name):
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(Failure(**json.loads(path.read_text())))
    return found


def blame(failures: list[Failure], signal_deaths: Mapping[int, str]) -> Failure | None:
    """The failure that began it all (see the module's docstring); `signal_deaths`: the rank -> signal name of
    each rank the launcher saw die by a signal. None when nothing is known."""
    said = {f.rank for f in failures}
    silent = sorted(rank for rank in signal_deaths if rank not in said)
    if silent:
        rank = silent[0]
        return Failure(rank, 0.0, "", "", killed_by=signal_deaths[rank])
    if not failures:
        return None
    return min(failures, key=lambda f: (f.follows, f.step is None, f.step or 0, f.time))


def verdict(blamed: Failure, world_size: int, where: str, log: Path | None) -> str:
    """The launcher's line: what happened, where the run stands (`where`: its last checkpoint), and the log
    that says more (None: nothing was written)."""
    see = f"; see {log}" if log is not None else ""
    if blamed.planned:
        return f"{blamed.message}; {where}{see}"
    if blamed.killed_by is not None:
        what = f"rank {blamed.rank} was killed by {blamed.killed_by}"
    else:
        first = " first" if world_size > 1 else ""
        what = f"rank {blamed.rank} failed{first} ({blamed.cause})"
    return f"{what}; {where}{see}"
