"""One run dir per job, shared by every rank.

Under torchrun each rank composes its own Hydra config, so a timestamped `hydra.run.dir` could split
across a second boundary. The `flodl_run_stamp` resolver makes ranks agree on one stamp through the
rendezvous store torchrun already runs (first writer wins; a torchrun restart reads the same stamp,
so it lands in the same dir). `flodl_output_subdir` lets only rank 0 write `.hydra/`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from omegaconf import OmegaConf

from flodl.cluster_env import adopt_scheduler_environ
from flodl.config.host import RankEnv

STAMP_FORMAT = "%Y-%m-%d/%H-%M-%S"


def env_rank() -> int:
    """Global rank from torchrun's (or the scheduler's) environment; 0 for a single process."""
    adopt_scheduler_environ()  # Hydra resolves the output subdir before flodl's launch code runs
    return RankEnv.from_environ().rank


def agreed_run_stamp() -> str:
    """A timestamp every rank of this torchrun launch agrees on (just `now` outside torchrun)."""
    stamp = datetime.now().strftime(STAMP_FORMAT)
    # Only the agent's store exists before rank 0 calls init_process_group; without it, each
    # rank keeps its own stamp and users pass a fixed hydra.run.dir (see README).
    env = RankEnv.from_environ()
    if not env.agent_store or env.master_addr is None or env.master_port is None:
        return stamp
    from torch.distributed import TCPStore

    store = TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=60))
    key = f"flodl/run_stamp/{env.run_id}"
    return store.compare_set(key, "", stamp).decode()


def output_subdir() -> str | None:
    return ".hydra" if env_rank() == 0 else None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("flodl_run_stamp"):
        OmegaConf.register_new_resolver("flodl_run_stamp", agreed_run_stamp, use_cache=True)
    if not OmegaConf.has_resolver("flodl_output_subdir"):
        OmegaConf.register_new_resolver("flodl_output_subdir", output_subdir)
