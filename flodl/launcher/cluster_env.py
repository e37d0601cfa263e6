"""Rank variables from a scheduler that starts one process per rank itself (Slurm's srun, submitit).

flodl reads torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`). When a job's processes were started by Slurm (one task per GPU, as
Hydra's submitit launcher does) or by submitit's local executor, these are derived from the scheduler's
own variables. Pure: the environment comes in as a mapping, the torchrun-style variables come out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# The store port is derived from the job id, so every task of a job computes the same one and two jobs on
# one node (array tasks) rarely collide; MASTER_PORT in the environment overrides it.
PORT_BASE = 20000
PORT_SPAN = 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`gpu[01-03,07],head`) as host names, in order."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}")
    return hosts


def _tasks_on_first_node(tasks_per_node: str) -> int:
    """`SLURM_TASKS_PER_NODE` is e.g. `4(x2),3`; every node of a flodl job runs the same count."""
    return int(tasks_per_node.split(",")[0].split("(")[0])


def scheduler_rank_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun-style variables for a process started by Slurm or submitit with several tasks; empty when
    torchrun already set them, or when this process is not one task of a multi-task job."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return {}
    if int(environ.get("SUBMITIT_LOCAL_NTASKS", "1")) > 1 and "SUBMITIT_LOCAL_GLOBALID" in environ:
        tasks = environ["SUBMITIT_LOCAL_NTASKS"]
        derived = {
            "RANK": environ["SUBMITIT_LOCAL_GLOBALID"],
            "WORLD_SIZE": tasks,
            "LOCAL_RANK": environ["SUBMITIT_LOCAL_LOCALID"],
            "LOCAL_WORLD_SIZE": tasks,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(PORT_BASE + int(environ["SUBMITIT_LOCAL_JOB_ID"]) % PORT_SPAN),
        }
    # SLURM_STEP_ID: inside an srun step (a batch script itself is one process, not a rank).
    elif int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in environ:
        derived = {
            "RANK": environ["SLURM_PROCID"],
            "WORLD_SIZE": environ["SLURM_NTASKS"],
            "LOCAL_RANK": environ["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": str(_tasks_on_first_node(environ["SLURM_TASKS_PER_NODE"])),
            "MASTER_ADDR": expand_nodelist(environ["SLURM_JOB_NODELIST"])[0],
            "MASTER_PORT": str(PORT_BASE + int(environ["SLURM_JOB_ID"]) % PORT_SPAN),
        }
    else:
        return {}
    return {key: environ.get(key, value) for key, value in derived.items()}


def adopt_scheduler_environ() -> None:
    """Set torchrun's variables in this process from the scheduler's, when it started the ranks."""
    os.environ.update(scheduler_rank_environ(os.environ))
