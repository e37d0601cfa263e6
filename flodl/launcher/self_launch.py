"""Starting a job's ranks on this host (launch.nproc_per_node > 1): torch's elastic launcher, or under
fault_tolerance=survive flodl's supervisor with the run's host in this process; and the one line the
terminal gets for a failure.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from flodl.config.policy import hosts_apart, rank_capacity, saves_on_stop
from flodl.config.rules import START_METHODS
from flodl.config.schema import FlodlConfig
from flodl.config.targets import task_target_paths
from flodl.coordinator.roster import TooFewRanks
from flodl.job import failures
from flodl.job.host import RunHost
from flodl.job.rank import EXIT_WORDED, device_type_of, log_plan, self_launched_rank, stopped_line
from flodl.job.settings import checkpoint_store
from flodl.launcher.join_card import JoinCard, write_card
from flodl.launcher.rank_exit import SupervisedRankFailure, signal_name
from flodl.launcher.signal_deaths import SignalDeaths
from flodl.launcher.supervisor import StopSignals, host_ranks, supervise
from flodl.links.group import hosted_exchange, loopback_store
from flodl.links.stop import STOP_EXIT_CODES, Stopped, catch_stop_signals
from flodl.links.transport import Mailbox
from flodl.logs import setup_host_logging, stderr_kept_in
from flodl.metrics.run_info import RunInfo

log = logging.getLogger("flodl")

# How long past stop_grace_s flodl-coordinator waits for its ranks to carry out a stop before it ends the run.
_STOP_MARGIN_S = 30.0


class RankFailure(RuntimeError):
    """A rank this process launched failed; the message names the rank that began it and its log."""


def keep_on_loopback() -> None:
    """A job flodl starts itself has every rank on this host: gloo's and NCCL's own sockets listen on the
    loopback interface too (they would take the address the host name resolves to), unless the user chose."""
    import psutil

    loopback = [
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses)
    ]
    if loopback:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback[0])


@contextlib.contextmanager
def plain_start_method(method: str) -> Iterator[None]:
    """A spawned (or forkserver) rank first takes up the start method of this process's default context.
    A process that runs jobs for a pool of its own has one no rank knows (joblib's loky workers: 'loky'),
    and its ranks would die before flodl's first line: while ranks start, the default is `method`."""
    current = multiprocessing.get_start_method(allow_none=True)
    if current is None or current in START_METHODS:
        yield
        return
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(current, force=True)


def self_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig, gpus: int) -> None:
    """Start the ranks and wait for them. The terminal gets one line of flodl's for a failure or a stop: what
    the ranks, torch's launcher and gloo write to stderr goes to the run dir (each rank's own into its
    rank{N}.log, the rest into .launch/launcher.log)."""
    run_dir = Path(info.run_dir)
    catch_stop_signals()  # a stop while the launcher sets up is a stop too (torch's launcher takes over)
    try:
        with stderr_kept_in(launcher_log(run_dir)), plain_start_method(cfg.launch.start_method):
            if hosts_apart(cfg):
                _supervised_launch(config, info, cfg, gpus)
            else:
                _elastic_launch(config, info, cfg)
    except Stopped as stop:
        say(stopped_line(stop.signum, cfg, run_dir, info))
        raise


def launcher_log(run_dir: Path) -> Path:
    return run_dir / ".launch" / "launcher.log"


def say(line: str) -> None:
    print(f"flodl: {line}", file=sys.stderr)


def _elastic_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = Path(info.run_dir)
    # Every rank is on this host, so nothing listens beyond loopback: the rendezvous store is ours, bound
    # to 127.0.0.1 (torch's would listen on every interface); the agent does not open a shared store of
    # its own, and rank 0 hosts the ranks' store on MASTER_ADDR=127.0.0.1 (flodl/links/group.py).
    rendezvous = loopback_store(0, None, timedelta(seconds=cfg.launch.timeout_s))
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.launch.nproc_per_node,
        run_id=f"flodl-{uuid.uuid4().hex[:12]}",
        # The default rendezvous needs etcd; c10d joins the store above as a client.
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{rendezvous.port}",
        rdzv_configs={"is_host": False},
        local_addr="127.0.0.1",
        # Each restart starts every rank again; they resume from the run's last checkpoint (resume=auto).
        max_restarts=cfg.launch.max_restarts,
        monitor_interval=0.1,
        start_method=cfg.launch.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / ".launch")),
    )

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_quiet_stops)
    signal_deaths = SignalDeaths(run_dir, info.uid)
    try:
        with signal_deaths:
            elastic_launch(launch_config, self_launched_rank)(config, info.as_dict())
    except SignalException as err:  # the launcher got it: the agent forwarded it and waited for the ranks
        raise Stopped(err.sigval) from None
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if len(codes) == 1 and codes <= STOP_EXIT_CODES:  # a rank got it and every rank stopped on it
            raise Stopped(codes.pop() - 128) from None
        failed = sorted(err.failures)
        recorded = failures.recorded(run_dir, info.uid, cfg.launch.max_restarts)
        # The agent reports the first rank it found exited; a rank a signal killed unreported is seen too.
        first_record = min((f.time for f in recorded), default=None)
        deaths = signal_deaths.began(cfg.launch.max_restarts, first_record)
        deaths |= {r: signal_name(-f.exitcode) for r, f in err.failures.items() if f.exitcode < 0}
        exits = ", ".join(f"rank {r}: exit code {err.failures[r].exitcode}" for r in failed)
        logs = ", ".join(str(log) for log in logs_of(run_dir, failed)) or "no log was written"
        otherwise = f"rank(s) {failed} failed ({exits}; see {logs})"
        raise RankFailure(
            failure_line(cfg, run_dir, cfg.launch.nproc_per_node, recorded, deaths, otherwise)
        ) from None


def _supervised_launch(config: dict[str, Any], info: RunInfo, cfg: FlodlConfig, gpus: int) -> None:
    """fault_tolerance=survive: each rank supervised on its own (torch's elastic agent would stop them all
    when one dies); this process hosts the store and the run (flodl/job/host.py), which outlive any rank,
    rank 0 included."""
    world = cfg.launch.nproc_per_node
    store = loopback_store(0, None, timedelta(seconds=cfg.launch.timeout_s))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def supervised(ended: Callable[[], bool]) -> None:
        supervise(
            self_launched_rank,
            (config, info.as_dict()),
            host_ranks(world, store.port, cfg.launch.max_restarts),
            cfg.launch.start_method,
            store,
            Path(info.run_dir),
            ended,
            saving_s=cfg.stop_grace_s if saves_on_stop(cfg) else 0.0,
            spare_imports=spare_imports(cfg),
        )

    host_run(config, info, cfg, world, gpus, store, "127.0.0.1", supervised)


def spare_imports(cfg: FlodlConfig) -> tuple[str, ...]:
    """What a spare rank imports ahead (`launch.spare`): the ranks' body, torch's compiler (a rank's first
    optimizer step imports it) and the task's targets."""
    if not cfg.launch.spare:
        return ()
    return (self_launched_rank.__module__, "torch._dynamo", *task_target_paths(cfg))


def host_run(
    config: dict[str, Any],
    info: RunInfo,
    cfg: FlodlConfig,
    world: int,
    gpus: int,
    store: TCPStore,
    store_addr: str,
    ranks: Callable[[Callable[[], bool]], None] | None = None,
) -> None:
    """This process hosts the run (flodl/job/host.py) in `store` (at `store_addr`, as ranks reach it), while
    `ranks(ended)` supervises its ranks until `ended()` (None: the ranks run apart; the host ends with the
    run). A planned stop (min_ranks) and a failure end in one line."""
    run_dir = Path(info.run_dir)
    setup_host_logging(run_dir)

    def connect(namespace: str, owner: int | str) -> Mailbox:  # the store listens here too
        return Mailbox.connect("127.0.0.1", store.port, namespace, owner, cfg.launch.timeout_s)

    # The host's own connection to the store: a client holds its lock through a blocking wait, and the host
    # waits for the ranks' first words (what they see of its checkpoint dir, the task) while the supervisor
    # polls the store for cuts: on one client, a rank dying before it spoke froze the supervisor, which then
    # never started it again.
    own = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=cfg.launch.timeout_s))
    host = RunHost(cfg, config, info, world, hosted_exchange(own), connect)
    host.open()
    assert host.layout is not None  # chosen with the checkpoint, in open()
    log_plan(host.cfg, world, device_type_of(cfg, gpus), host.layout)
    card = _join_card(config, info, cfg, world, store_addr, store.port)
    serving = threading.Thread(target=host.serve, name="flodl-run-host", daemon=True)
    serving.start()
    try:
        if ranks is None:
            _until_the_run_ends(host, cfg.stop_grace_s)
        else:
            ranks(host.ended.is_set)
        while not host.ended.wait(0.5):  # a stop signal can land between the waits
            pass
        serving.join()
        host.finish()
    except SupervisedRankFailure as err:
        host.stop()
        raise RankFailure(f"{err}; {where_run_stands(cfg, run_dir)}") from None
    except TooFewRanks as err:  # a planned stop: one line naming min_ranks
        raise RankFailure(str(err)) from None
    except BaseException:
        host.stop()
        raise
    finally:
        if card is not None:  # no rank joins a run that ended
            card.unlink(missing_ok=True)


def _until_the_run_ends(host: RunHost, grace_s: float) -> None:
    """The run's host apart (flodl-coordinator): wait for the run. A stop signal to it stops the run as a
    member's does (the ranks save a checkpoint at the next boundary, then stop, told by the run if the signal
    reached this process alone), then raises Stopped; past `grace_s` (stop_grace_s) and a margin, it stops
    the run where it is."""
    with StopSignals() as stop:
        deadline = None
        while not host.ended.wait(0.1):
            if stop.signum is None:
                continue
            if deadline is None:
                if not host.stop_on_signal(stop.signum):
                    break
                deadline = time.monotonic() + grace_s + _STOP_MARGIN_S
            elif time.monotonic() > deadline:
                log.warning("the ranks did not stop within stop_grace_s=%g s: stopping the run", grace_s)
                break
    if stop.signum is not None:
        raise Stopped(stop.signum)


def _join_card(
    config: dict[str, Any], info: RunInfo, cfg: FlodlConfig, world: int, store_addr: str, store_port: int
) -> Path | None:
    """A job with seats past its start (launch.max_ranks) says in its run dir how a rank joins it
    (flodl-join); its path (None: the job does not grow)."""
    capacity = rank_capacity(cfg, world)
    if capacity == world:
        return None
    card = JoinCard(
        store_addr,
        store_port,
        world,
        capacity,
        config,
        info.as_dict(),
        cfg.launch.start_method,
        cfg.launch.timeout_s,
    )
    path = write_card(Path(info.run_dir), card)
    log.info("the job takes up to %d ranks; one more joins with: flodl-join %s", capacity, info.run_dir)
    return path


def failure_line(
    cfg: FlodlConfig,
    run_dir: Path,
    world_size: int,
    recorded: list[failures.Failure],
    deaths: dict[int, str],
    otherwise: str,
) -> str:
    """The launcher's line for failed ranks: the one that began it (flodl/job/failures.py) and its log, or
    `otherwise` when none recorded why and none was killed; where the run stands."""
    where = where_run_stands(cfg, run_dir)
    blamed = failures.blame(recorded, deaths)
    if blamed is None:
        return f"{otherwise}; {where}"
    return failures.verdict(blamed, world_size, where, next(iter(logs_of(run_dir, [blamed.rank])), None))


def where_run_stands(cfg: FlodlConfig, run_dir: Path) -> str:
    latest = checkpoint_store(cfg, run_dir).latest()
    return f"the last checkpoint is {latest.path}" if latest else "no checkpoint was written"


def logs_of(run_dir: Path, ranks: list[int]) -> list[Path]:
    """The logs of `ranks` that were written; else the launcher's, if it wrote one (a rank that died before
    its first line: its traceback went to the launcher's stderr)."""
    written = [run_dir / f"rank{rank}.log" for rank in ranks if (run_dir / f"rank{rank}.log").is_file()]
    return written or [log for log in [launcher_log(run_dir)] if log.is_file()]


def _quiet_stops(record: logging.LogRecord) -> bool:
    """The elastic launcher logs a rank that exits 130 / 143 as failed, with a traceback: a stop is not; nor
    is a rank that recorded its failure (EXIT_WORDED: the launcher words it)."""
    err = record.exc_info[1] if record.exc_info else None
    return getattr(err, "exit_code", None) not in {*STOP_EXIT_CODES, EXIT_WORDED}
