"""Rank-prefixed logging: `[rN]` on the console, and `rank{N}.log` in the run dir."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

from flodl.config.host import RankEnv

LOGGER = "flodl"


def rank_tag(rank: int) -> str:
    """`rN`, or `host:rN` when the job spans several hosts (torchrun --nnodes > 1)."""
    return f"{socket.gethostname()}:r{rank}" if RankEnv.from_environ().spans_hosts else f"r{rank}"


def setup_rank_logging(rank: int, run_dir: Path) -> logging.Logger:
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.INFO)
    # Our own handlers, whatever Hydra or torch configured on the root logger.
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stdout)
    tag = rank_tag(rank)
    console.setFormatter(logging.Formatter(f"[{tag}] %(message)s"))
    logger.addHandler(console)
    run_dir.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(run_dir / f"rank{rank}.log", encoding="utf-8")
    to_file.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s"))
    logger.addHandler(to_file)
    return logger
