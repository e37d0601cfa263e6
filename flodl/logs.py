"""Rank-prefixed logging: `[rN]` on the console, and `rank{N}.log` in the run dir (tracebacks there only)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from flodl.config.host import RankEnv

LOGGER = "flodl"


def rank_tag(rank: int) -> str:
    """`rN`, or `host:rN` when the job spans several hosts (torchrun --nnodes > 1)."""
    return f"{socket.gethostname()}:r{rank}" if RankEnv.from_environ().spans_hosts else f"r{rank}"


def setup_rank_logging(rank: int, run_dir: Path) -> logging.Logger:
    """`[rN]` on the console, `rank{N}.log` in the run dir."""
    return _setup_logging(rank_tag(rank), run_dir / f"rank{rank}.log")


def setup_host_logging(run_dir: Path) -> logging.Logger:
    """The run's host apart from the ranks (flodl/job/host.py): `[coordinator]`, `coordinator.log`."""
    return _setup_logging("coordinator", run_dir / "coordinator.log")


def setup_supervisor_logging(rank: int, run_dir: Path) -> logging.Logger:
    """The supervisor of a rank started apart (flodl/launcher/apart.py): `[rN supervisor]`, in the rank's
    log beside the rank's own lines."""
    return _setup_logging(f"{rank_tag(rank)} supervisor", run_dir / f"rank{rank}.log")


def _setup_logging(tag: str, path: Path) -> logging.Logger:
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.INFO)
    # Our own handlers, whatever Hydra or torch configured on the root logger.
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(_OneLine(f"[{tag}] %(message)s"))
    console.addFilter(_on_console)
    logger.addHandler(console)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s"))
    logger.addHandler(to_file)
    return logger


# `extra=FILE_ONLY`: a record for the rank's log file alone (the launcher tells the user in its own line).
FILE_ONLY = {"file_only": True}


def _on_console(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


class _OneLine(logging.Formatter):
    """The console gets a record's line; its traceback goes to the log file only."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = saved


def one_line(text: str, limit: int | None = None) -> str:
    """`text` on one line (whitespace collapsed); past `limit` characters, cut at a word and marked `…`."""
    flat = " ".join(text.split())
    if limit is None or len(flat) <= limit:
        return flat
    return flat[: limit - 2].rsplit(" ", 1)[0] + " …"


def stderr_to(path: Path) -> None:
    """Send this process's stderr (file descriptor 2: Python's, native code's, and that of every child it
    starts from now on) to the end of `path`."""
    sys.stderr.flush()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as target:
        os.dup2(target.fileno(), 2)


@contextlib.contextmanager
def stderr_kept_in(path: Path) -> Iterator[None]:
    """While inside: stderr into `path` (`stderr_to`); then back where it was."""
    saved = os.dup(2)
    try:
        stderr_to(path)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
