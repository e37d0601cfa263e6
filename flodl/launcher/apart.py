"""A rank started apart with restarts: `flodl-train` run with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(no torchrun) beside `flodl-coordinator`, under fault_tolerance=survive with launch.max_restarts > 0.

This process supervises its rank as the self-launch supervisor does a one-host job's ranks (what torchrun's
agent is to a host): the rank's death is posted to the coordinator the moment it happens; a rank the
coordinator cut while it could not be heard (a freeze, its host's network cut off) is ended as soon as this
process reads the cut, not when the rank wakes; and the rank is started again in a spare process that has
done its imports already (launch.spare), so that a restart costs a fraction of a second, not torch's import
(seconds on a GPU host). Its starts are numbered in the run's store, as an unsupervised rank numbers its
own: a scheduler that starts this command again once its restarts are spent continues the count.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from flodl.config.host import RankEnv
from flodl.config.policy import hosts_apart, saves_on_stop
from flodl.config.schema import FlodlConfig
from flodl.job.rank import self_launched_rank
from flodl.launcher.join import why_left
from flodl.launcher.rank_exit import SupervisedRankFailure
from flodl.launcher.self_launch import RankFailure, launcher_log, spare_imports
from flodl.launcher.supervisor import SupervisedRank, supervise
from flodl.links.group import hosted_exchange
from flodl.links.seats import count_start
from flodl.logs import setup_supervisor_logging, stderr_kept_in
from flodl.metrics.run_info import RunInfo


def supervised_apart(cfg: FlodlConfig, env: RankEnv) -> bool:
    """This process is a rank started apart that may be started again: it supervises the rank instead of
    being it (with no restarts, the rank runs here, and its scheduler or loop starts it again)."""
    return env.launched and hosts_apart(cfg) and cfg.launch.max_restarts > 0


def supervise_apart(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig, env: RankEnv) -> None:
    """Run rank `env.rank` in a process of its own, started again up to launch.max_restarts times, until the
    run ends. Raises RankFailure when the run's host does not answer, or the rank ended before the run with
    no restarts left; Stopped on a stop signal (forwarded to the rank first)."""
    run_dir = Path(info.run_dir)
    setup_supervisor_logging(env.rank, run_dir)
    with stderr_kept_in(launcher_log(run_dir)):  # torch's retries and their C++ frames, for the log
        store = _run_store(env, cfg.launch.timeout_s)
    exchange = hosted_exchange(store)

    def numbered() -> int:
        return count_start(exchange, env.rank)

    rank = SupervisedRank(env.rank, {}, cfg.launch.max_restarts, numbered(), numbered=numbered)
    since = time.time()
    try:
        # torch's reports on a store that went (the run's end: its host leaves first) go to the log, not the
        # console; the supervisor's own lines go to stdout.
        with stderr_kept_in(launcher_log(run_dir)):
            supervise(
                self_launched_rank,
                (config, info.as_dict()),
                [rank],
                cfg.launch.start_method,
                store,
                run_dir,
                ended=lambda: False,  # its rank ends well only when the run told it
                saving_s=cfg.stop_grace_s if saves_on_stop(cfg) else 0.0,
                spare_imports=spare_imports(cfg),
            )
    except SupervisedRankFailure as err:
        cause = why_left(err, run_dir, info.uid, env.rank, since)
        raise RankFailure(
            f"rank {env.rank} left the run before its end ({cause}) with no restarts left "
            f"(launch.max_restarts={cfg.launch.max_restarts}); see {run_dir / f'rank{env.rank}.log'}"
        ) from None


def _run_store(env: RankEnv, timeout_s: float) -> TCPStore:
    """The store of the run's host (flodl-coordinator) as the rank reaches it; a line if it never answers."""
    addr, port = env.master_addr or "127.0.0.1", env.master_port
    if port is None:
        raise RankFailure(f"rank {env.rank}: set MASTER_PORT and MASTER_ADDR: where flodl-coordinator is")
    try:
        return TCPStore(addr, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as err:
        raise RankFailure(
            f"rank {env.rank}: the run's host does not answer at MASTER_ADDR={addr} MASTER_PORT={port} "
            f"within launch.timeout_s={timeout_s:g} ({type(err).__name__}): start flodl-coordinator first"
        ) from None
