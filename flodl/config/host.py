"""What this host and its launcher say: the one reader of the torchrun environment, and the host probe.

Every place that needs torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_*, SLURM_JOB_ID; a supervisor's FLODL_INCARNATION) asks `RankEnv.from_environ()`;
flodl/launcher/cluster_env.py writes them from Slurm's.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
# Set by a supervisor as it starts a rank (RankEnv.incarnation).
INCARNATION_ENV = "FLODL_INCARNATION"


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    # Ranks on this host (torchrun's LOCAL_WORLD_SIZE; 1 for a plain run).
    local_world_size: int
    # Set by torchrun / the elastic launcher; absent for a plain single-process run.
    launched: bool = False
    # The rendezvous store (MASTER_ADDR / MASTER_PORT; None outside a launcher).
    master_addr: str | None = None
    master_port: int | None = None
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True, the default since torch 2.3).
    agent_store: bool = False
    # TORCHELASTIC_RESTART_COUNT: how often the elastic agent restarted this group.
    restart_count: int = 0
    # TORCHELASTIC_RUN_ID: the same across the restarts of one torchrun launch ("" outside torchrun).
    run_id: str = ""
    # SLURM_JOB_ID: the scheduler's job, shared by the ranks it started ("" outside Slurm).
    job_id: str = ""
    # FLODL_INCARNATION: how often the rank's seat was started before this process, as its supervisor (the
    # self-launch's, or flodl-join's: flodl/links/seats.py) counts them; None: ranks started apart count their
    # starts in the run's store.
    incarnation: int | None = None

    @classmethod
    def from_environ(cls) -> RankEnv:
        env = os.environ
        world_size = int(env.get("WORLD_SIZE", "1"))
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            launched="RANK" in env and "WORLD_SIZE" in env,
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            job_id=env.get("SLURM_JOB_ID", ""),
            incarnation=int(env[INCARNATION_ENV]) if INCARNATION_ENV in env else None,
        )

    @property
    def hosts_ranks_apart(self) -> bool:
        """This process hosts a run whose WORLD_SIZE ranks are started apart from it (flodl-coordinator: the
        job's variables set, but no RANK)."""
        return not self.launched and "WORLD_SIZE" in os.environ

    @property
    def spans_hosts(self) -> bool:
        """The job has ranks on more than this host (torchrun --nnodes > 1)."""
        return self.world_size > self.local_world_size


@dataclass(frozen=True)
class HostFacts:
    """What the rules need to know about the host this config will run on."""

    gpus: int
    # Ranks this host will run (torchrun's LOCAL_WORLD_SIZE, or launch.nproc_per_node).
    ranks_per_node: int
    # Ranks in the whole job (torchrun's WORLD_SIZE, or launch.nproc_per_node).
    world_size: int
    under_torchrun: bool
    # Free bytes in the disk stage dir; None when the dir does not exist.
    stage_dir_free_bytes: int | None
    # RAM available to this host's ranks (the cgroup limit honoured), as the data plane reads it.
    available_ram: int
    # The ranks run under torchrun's agent (TORCHELASTIC_RUN_ID), which stops every rank of a host when one
    # dies; not so for ranks started one by one with RANK / WORLD_SIZE set.
    elastic_agent: bool = False
    # CPU cores this process may run on (None: not probed).
    cpu_cores: int | None = None
    # The lowest CUDA compute capability among the visible GPUs (None: no GPU), and whether this torch has
    # float8 matmuls (torch._scaled_mm): what precision=fp8 needs.
    gpu_capability: tuple[int, int] | None = None
    float8_matmul: bool = False

    @classmethod
    def probe(cls, nproc_per_node: int, disk_stage_dir: str | None) -> HostFacts:
        """This host, for a run of `launch.nproc_per_node` staging under `disk_stage_dir` (plain values: the
        host knows nothing of the schema, which imports the CLI's resolvers that ask RankEnv)."""
        env = RankEnv.from_environ()
        under_torchrun = env.launched
        ranks = env.local_world_size if under_torchrun else 1 if env.hosts_ranks_apart else nproc_per_node
        world = env.world_size if under_torchrun or env.hosts_ranks_apart else nproc_per_node
        stage_dir = stage_dir_of(disk_stage_dir)
        free = shutil.disk_usage(stage_dir).free if os.path.isdir(stage_dir) else None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return cls(
            gpu_count(),
            ranks,
            world,
            under_torchrun,
            free,
            available_ram(),
            env.run_id != "",
            cores,
            gpu_capability(),
            float8_matmul(),
        )


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def gpu_capability() -> tuple[int, int] | None:
    """The lowest compute capability among the visible CUDA devices (None: none visible)."""
    import torch

    found = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    return min(found) if found else None


def float8_matmul() -> bool:
    import torch

    return hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn")


def stage_dir_of(disk_stage_dir: str | None) -> str:
    """Where the disk tier goes: `disk_stage_dir`, or this user's private temp dir."""
    return disk_stage_dir or str(user_temp_dir())


def user_temp_dir() -> Path:
    """`<tmp>/flodl-<uid>`, private to this user (0700): generated data and stage files never sit at a
    path another user can predict and prepare."""
    path = Path(tempfile.gettempdir()) / f"flodl-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{path} is not a private dir of this user (uid {os.getuid()}, mode 0700): remove it, or set "
            "TMPDIR to a dir of your own"
        )
    return path


# --- available RAM ---
# A container's cgroup limit counts (v2 `memory.max`, v1 `memory.limit_in_bytes`): psutil alone reports the
# host's memory, and caches sized from it OOM-kill containers (deeplake#2987).

CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 reports "no limit" as a huge page-aligned number; anything above this is no limit.
_UNLIMITED = 1 << 60


def parse_cgroup_available(root: Path, own_path: str = "/") -> int | None:
    """Bytes left under this process's cgroup memory limit (limit - usage + reclaimable page cache), or None
    without a limit. `root` is the cgroup mount, `own_path` the process's group from /proc/self/cgroup."""
    candidates = [
        # v2 (unified): memory.max in the process's own group, or at the mount root inside a container.
        (root / own_path.lstrip("/"), "memory.max", "memory.current", "inactive_file"),
        (root, "memory.max", "memory.current", "inactive_file"),
        # v1: the memory controller's own hierarchy.
        (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ]
    for folder, limit_file, usage_file, reclaimable in candidates:
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is None or usage is None:
            continue
        if limit >= _UNLIMITED:
            return None
        return max(limit - usage + _stat_value(folder / "memory.stat", reclaimable), 0)
    return None


def available_ram(root: Path = CGROUP_ROOT) -> int:
    """Available RAM: psutil's MemAvailable, lowered to the cgroup's headroom when a limit is set."""
    import psutil

    available = int(psutil.virtual_memory().available)
    limited = parse_cgroup_available(root, _own_cgroup_v2_path())
    return available if limited is None else min(available, limited)


def _own_cgroup_v2_path() -> str:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:] or "/"
    except OSError:
        pass
    return "/"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
