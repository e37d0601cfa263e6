"""One run, one dir, shared by every rank of the run and by nobody else.

- An auto-stamped dir (`outputs/${flodl_run_stamp:outputs}`) is created exclusively: a stamp another job
  already took gets a suffix (`12-00-00-1`). Under torchrun each rank composes its own Hydra config, so
  ranks agree on one stamp through the rendezvous store torchrun's agent runs (the first to publish wins;
  a torchrun restart reads the same stamp and lands in the same dir). What comes from the store is checked
  to be a stamp before it becomes a path.
- Every run has a uid: the same on every rank and across torchrun / launcher restarts, new for each launch.
- The run dir records its owner (`.flodl-owner.json`: uid, host, pid); a run refuses a dir that a live run
  with another uid owns (an explicit `hydra.run.dir` given to two jobs at once).
- `flodl_output_subdir` lets only rank 0 write `.hydra/`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import re
import socket
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
from omegaconf import OmegaConf

from flodl.config.host import RankEnv
from flodl.launcher.cluster_env import adopt_scheduler_environ

STAMP_FORMAT = "%Y-%m-%d/%H-%M-%S"
_STAMP = re.compile(r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}(-\d{1,6})?")
OWNER_FILE = ".flodl-owner.json"


class RunDirTaken(RuntimeError):
    pass


def env_rank() -> int:
    """Global rank from torchrun's (or the scheduler's) environment; 0 for a single process."""
    adopt_scheduler_environ()  # Hydra resolves the output subdir before flodl's launch code runs
    return RankEnv.from_environ().rank


def agent_store() -> Any:
    """torchrun's agent store, the only store there is before rank 0 calls init_process_group; None
    outside torchrun (or when torchrun does not share it)."""
    env = RankEnv.from_environ()
    if not env.agent_store or env.master_addr is None or env.master_port is None:
        return None
    from torch.distributed import TCPStore

    return TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=60))


def launch_key(name: str) -> str:
    return f"flodl/{name}/{RankEnv.from_environ().run_id}"


# Stamp dirs this process claimed, with their base: a config refused before the run starts gives them back.
_CLAIMED: list[tuple[Path, Path]] = []


def claim_stamp(base: Path) -> str:
    """A stamp (now) whose dir under `base` this call created; a taken one gets the next free suffix."""
    stamp = datetime.now().strftime(STAMP_FORMAT)
    (base / stamp).parent.mkdir(parents=True, exist_ok=True)
    for suffix in range(1_000_000):
        candidate = f"{stamp}-{suffix}" if suffix else stamp
        with contextlib.suppress(FileExistsError):
            (base / candidate).mkdir()
            _CLAIMED.append((base, base / candidate))
            return candidate
    raise RunDirTaken(f"every run dir {base / stamp}-N is taken: clean up {base / stamp}*")


def release_claimed() -> None:
    """Remove the stamp dirs this process claimed and the dirs above them up to their base, each only while
    empty (rmdir): what a run refused before it started leaves behind is nothing."""
    while _CLAIMED:
        base, empty = _CLAIMED.pop()
        while True:
            with contextlib.suppress(OSError):
                empty.rmdir()
            if empty == base:
                break
            empty = empty.parent


def checked_stamp(value: str, source: str) -> str:
    if not _STAMP.fullmatch(value):
        raise RunDirTaken(
            f"the run stamp {value!r} from {source} is not a flodl stamp (YYYY-MM-DD/HH-MM-SS[-N])"
        )
    return value


def agreed_run_stamp(base: str, mode: Any, used_in: str) -> str:
    """This run's stamp under `base`: claimed here, or, under torchrun, the one the first rank claimed.
    Hydra resolves both the run dir and the sweep dir: only the one `mode` (Hydra's RunMode) uses, `used_in`,
    is claimed."""
    if getattr(mode, "name", mode) != used_in:
        return datetime.now().strftime(STAMP_FORMAT)
    store = agent_store()
    if store is None:
        return claim_stamp(Path(base))
    key = launch_key(f"run_stamp/{base}")
    if store.check([key]):  # a restart, or a rank that came late
        return checked_stamp(store.get(key).decode(), "the rendezvous store")
    mine = claim_stamp(Path(base))
    agreed = store.compare_set(key, "", mine).decode()
    if agreed != mine:  # another rank of this run published first: its dir is the run's
        with contextlib.suppress(OSError):
            (Path(base) / mine).rmdir()
    return checked_stamp(agreed, "the rendezvous store")


def run_uid(run_dir: Path) -> str:
    """The same on every rank of this run and across its restarts; new for each run (each job of a sweep
    that ranks walk together is a run of its own, in its own dir)."""
    env = RankEnv.from_environ()
    if not env.launched and not env.hosts_ranks_apart:  # one process, or one that self-launches the ranks
        return uuid.uuid4().hex
    store = agent_store()
    if store is not None:
        return store.compare_set(launch_key(f"run_uid/{run_dir}"), "", uuid.uuid4().hex).decode()
    # Ranks a scheduler (or a person) started, and flodl-coordinator beside them: what they share of this run.
    shared = [env.job_id, env.run_id, env.master_addr or "", str(env.master_port or ""), str(run_dir)]
    return hashlib.sha256("/".join(shared).encode()).hexdigest()[:32]


def _owner_process() -> psutil.Process:
    """The process that lives as long as the run: torchrun's agent for a torchrun rank, else this one."""
    this = psutil.Process()
    return (this.parent() or this) if RankEnv.from_environ().run_id else this


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the recorded owner still runs; another host's owner cannot be checked and counts as alive."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        return psutil.Process(owner["pid"]).create_time() == owner["pid_started"]
    except (psutil.Error, KeyError, TypeError):
        return False


def claim_run_dir(run_dir: Path, uid: str) -> None:
    """Record this run as `run_dir`'s owner; refuse a dir that a live run with another uid owns."""
    from flodl.checkpoints.disk import atomic_write_bytes  # torch: not at config-composition time

    run_dir.mkdir(parents=True, exist_ok=True)
    owner_path = run_dir / OWNER_FILE
    process = _owner_process()
    me = {"uid": uid, "host": socket.gethostname(), "pid": process.pid, "pid_started": process.create_time()}
    with (run_dir / ".flodl-owner.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # check-and-set: two runs starting together see each other
        try:
            current = json.loads(owner_path.read_text())
        except (OSError, ValueError):
            current = None
        if current is not None and current.get("uid") == uid:
            return
        if current is not None and _alive(current):
            raise RunDirTaken(
                f"run dir {run_dir} belongs to run {current.get('uid')}, still running (pid "
                f"{current.get('pid')} on {current.get('host')}): give this run its own hydra.run.dir (or "
                f"leave it out for a fresh stamped one); if that run is over, delete {owner_path}"
            )
        atomic_write_bytes(json.dumps(me).encode(), owner_path)


def output_subdir() -> str | None:
    return ".hydra" if env_rank() == 0 else None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("flodl_run_stamp"):
        OmegaConf.register_new_resolver("flodl_run_stamp", agreed_run_stamp, use_cache=True)
    if not OmegaConf.has_resolver("flodl_output_subdir"):
        OmegaConf.register_new_resolver("flodl_output_subdir", output_subdir)
