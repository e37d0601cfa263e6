"""A rank's training and the threads beside it: its heartbeat (which also ends a rank started apart once the
run's host cut it), its stop watch, and every other rank's watch on rank 0 (whose process hosts the store and
the coordinator when the ranks are self-launched)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from torch.distributed import Store

from flodl.config.host import RankEnv
from flodl.config.policy import (
    heartbeat_timeout_of,
    saves_on_stop,
)
from flodl.config.schema import FlodlConfig
from flodl.coordinator.roster import RankHung
from flodl.coordinator.survivors import root_store, was_cut
from flodl.job import failures
from flodl.job.host import RunHost
from flodl.links.group import GroupHandle
from flodl.links.heartbeat import HeartbeatSender, Rank0Watch, beat_interval
from flodl.links.liveness import Liveness
from flodl.links.messages import StopRequested
from flodl.links.stop import (
    Stopped,
    StopWatch,
    agree_step,
    end_process,
    save_on_stop,
)
from flodl.links.transport import COORDINATOR, Mailbox
from flodl.metrics.run_info import RunInfo
from flodl.worker.base import WorkerBase
from flodl.worker.group import SurvivingGroup

log = logging.getLogger("flodl")


def train(
    cfg: FlodlConfig,
    env: RankEnv,
    info: RunInfo,
    worker: WorkerBase,
    group: GroupHandle,
    namespace: str,
    connect: Callable[[str, int | str], Mailbox],
    host: RunHost | None,
    apart: bool,
) -> None:
    """The worker's run, with its heartbeat, its stop watch and (the host in rank 0's process) a watch on
    rank 0 beside it."""
    interval = beat_interval(heartbeat_timeout_of(cfg))
    surviving = worker.group if apart and isinstance(worker.group, SurvivingGroup) else None
    heartbeat = HeartbeatSender(
        env.rank,
        connect(namespace, env.rank),
        interval,
        lambda: worker.stepper.steps_total,
        # No supervisor ends a rank started apart once cut: it ends itself, from a collective too.
        None if surviving is None else functools.partial(_was_cut, surviving),
        functools.partial(_end_cut, env.rank),
    )
    heartbeat.start()
    watch = _stop_watch(cfg, env.rank, connect(namespace, env.rank), worker)
    watch.start()
    host_watch = None
    if not apart and env.rank != 0:  # the store, and the coordinator, live in rank 0: it may freeze
        # Its store client gives up within a beat.
        quick = Mailbox.connect(group.store_host, group.store_port, namespace, env.rank, interval)
        on_hang = functools.partial(_stop_on_hang, Path(info.run_dir), info.uid, env)
        host_watch = Rank0Watch(quick, heartbeat_timeout_of(cfg), interval, on_hang)
        host_watch.start()
    # Its host learns of this process's end the moment it happens (no supervisor posts it).
    liveness = None
    if surviving is not None:
        store = root_store(worker.outbox.store)
        liveness = Liveness.to_host(store, group.store_host, env.rank, surviving.incarnation)
    try:
        worker.run(alive=lambda: _raise_if_failed(host, worker))
        if liveness is not None:
            liveness.bye()
    except Stopped:
        if liveness is not None:
            liveness.bye()
        raise
    finally:
        if liveness is not None:
            liveness.close()
        if host is not None:
            host.rank_done()
        if host_watch is not None:
            host_watch.stop()
        watch.stop()
        heartbeat.stop()


def _stop_watch(cfg: FlodlConfig, rank: int, mailbox: Mailbox, worker: WorkerBase) -> StopWatch:
    """The rank's stop watch: a peer's stop raised here; with a stop that saves, this rank's signal carried
    out (the request posted and sent to the coordinator, sync's step agreed), within stop_grace_s; sync's
    checkpoints by time handed to the worker."""

    def on_checkpoint(request: int) -> None:
        worker.on_checkpoint_request(functools.partial(agree_step, mailbox, request=request))

    checkpoints = on_checkpoint if cfg.checkpoint_every_s is not None else None
    if not saves_on_stop(cfg):
        return StopWatch(mailbox, on_checkpoint=checkpoints)

    def announce(signum: int) -> None:
        mailbox.send(COORDINATOR, StopRequested(rank, signum))

    def on_request() -> bool:
        return worker.on_stop_request(functools.partial(agree_step, mailbox))

    def save_s() -> float | None:
        return worker.checkpointer.last_save_s if worker.checkpointer is not None else None

    return StopWatch(mailbox, save_on_stop(), announce, on_request, cfg.stop_grace_s, checkpoints, save_s)


def _raise_if_failed(host: RunHost | None, worker: WorkerBase) -> None:
    """While this rank waits for work: the coordinator in its process failed, or the run's host cut it."""
    coordinator = host.coordinator if host is not None else None
    if coordinator is not None and coordinator.error is not None:
        raise RuntimeError(f"the coordinator failed: {coordinator.error}") from coordinator.error
    group = worker.group
    if isinstance(group, SurvivingGroup) and was_cut(worker.outbox.store, group.rank, group.incarnation):
        raise RuntimeError(f"rank {group.rank} was cut out of the run (its host heard nothing of it)")


def _was_cut(group: SurvivingGroup, store: Store) -> bool:
    return was_cut(store, group.rank, group.incarnation)


def _end_cut(rank: int) -> None:
    """The run went on without this process (heard again after a partition or a freeze): it writes, commits
    and averages nothing more; its restart loop starts the rank again."""
    log.error("rank %d was cut out of the run while it could not be heard; ending this process", rank)
    end_process(1)


def _stop_on_hang(run_dir: Path, uid: str, env: RankEnv, why: str) -> None:
    """Rank 0 went silent: this rank's training thread waits in a collective with it, so end the process now
    (the launcher stops the others), naming rank 0."""
    log.error("%s; stopping rank %d", why, env.rank)
    failures.record(run_dir, uid, env.restart_count, env.rank, RankHung(why))
    end_process(1)
