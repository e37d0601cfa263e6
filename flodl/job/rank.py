"""The body of every rank, whichever way it was started (torchrun, flodl's launcher or supervisor, by hand).

A rank joins the run's store and group, checks it composed the same config as the others, builds its task,
meets the run's host (flodl/job/host.py: rank 0's own process under fault_tolerance=none, a process apart
under survive) for the mailboxes' namespace and the checkpoint to continue from, then trains what the
coordinator hands it until Shutdown.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from flodl.checkpoints.disk import CheckpointError
from flodl.config.host import RankEnv
from flodl.config.layout import Layout
from flodl.config.policy import (
    checkpoint_keys_set,
    collective_backend,
    compile_mode_for,
    hosts_apart,
    step_samples,
    step_words,
)
from flodl.config.rules import ConfigError
from flodl.config.schema import FlodlConfig, to_config
from flodl.coordinator.hooks import CallbackError
from flodl.coordinator.roster import TooFewRanks
from flodl.data.stream import epoch_picks
from flodl.job import failures
from flodl.job.assembly import make_group, make_worker
from flodl.job.coordinator_assembly import hang_saver
from flodl.job.host import HostFailed, RunHost, TaskFacts, coordinator_started, host_namespace, publish_task
from flodl.job.rank_threads import train
from flodl.job.resume import (
    agreed_checkpoint,
    agreed_config,
    agreed_layout,
    covers_every_epoch,
    load_model,
    restore_worker,
)
from flodl.job.settings import checkpoint_store, task_settings
from flodl.job.shared_dir import agree_on_checkpoint_dir
from flodl.links.group import GroupHandle, agree_on_config, init_group, pick_device
from flodl.links.messages import Exiting
from flodl.links.stop import (
    Stopped,
    catch_stop_signals,
    leave_now,
    part_done,
    post,
    posted,
    received,
    watch_signals,
)
from flodl.links.transport import COORDINATOR, InboxReader, Mailbox
from flodl.logs import FILE_ONLY, setup_rank_logging, stderr_to
from flodl.metrics.run_info import RunInfo
from flodl.metrics.wandb_sink import WandbStartError
from flodl.worker.group import RankGroup
from flodl.worker.nonfinite import NonFiniteError
from flodl.worker.task_setup import TaskParts, TaskSettings, build_task, lr_scale_factor

log = logging.getLogger("flodl")

# Errors whose message says all a user needs (what is wrong, what to do).
WORDED = (ConfigError, CheckpointError, WandbStartError, CallbackError, HostFailed)
# A self-launched rank's exit code after a failure it recorded and logged (the launcher words it).
EXIT_WORDED = 3


def run_rank(config: dict[str, Any], info_fields: dict[str, Any], self_launched: bool = False) -> None:
    """The body of every rank (plain values only: it may be spawned). SIGINT / SIGTERM stop it quietly with
    exit code 130 / 143. `self_launched`: this process's launcher tells the user how the run ended (the
    rank's own lines about it go to its log only)."""
    catch_stop_signals()
    watch_signals()
    try:
        _run_rank(config, info_fields, self_launched)
    except Stopped as stop:  # everything worth doing is done, and a preempted job has no seconds to spare
        leave_now(stop.exit_code)


def self_launched_rank(config: dict[str, Any], info_fields: dict[str, Any]) -> None:
    """A rank this process's launcher started. Its stderr goes to its log (native code's reports too); a
    failure, recorded and logged with its traceback, ends it with EXIT_WORDED, and the launcher words it."""
    env = RankEnv.from_environ()
    run_dir = Path(info_fields["run_dir"])
    stderr_to(run_dir / f"rank{env.rank}.log")
    failures.record_pid(run_dir, info_fields["uid"], env.restart_count, env.rank)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # a forked rank's OpenMP read it in the launcher, before the launcher set it
        torch.set_num_threads(int(threads))
    try:
        run_rank(config, info_fields, self_launched=True)
    except Exception:
        leave_now(EXIT_WORDED)
    part_done()  # back in torch's launcher, waiting for the others: its SIGTERM ends this rank at once


def _run_rank(config: dict[str, Any], info_fields: dict[str, Any], self_launched: bool) -> None:
    cfg = to_config(config)
    info = RunInfo(**info_fields)
    env = RankEnv.from_environ()
    run_dir = Path(info.run_dir)
    setup_rank_logging(env.rank, run_dir)
    apart = hosts_apart(cfg) and env.launched  # one in-process rank is its own host
    making = RankMaking(functools.partial(_join, cfg, config, env, run_dir, apart))
    try:
        serve_rank(cfg, config, info, env, making, apart, self_launched)
    finally:
        if dist.is_initialized():  # survive never forms the world (a dead member would hang its teardown)
            dist.destroy_process_group()


@dataclass(frozen=True)
class Joined:
    """A rank in the run: its device, its collectives' backend, and the run's store and group it joined."""

    device: torch.device
    backend: str
    group: GroupHandle


@dataclass(frozen=True)
class RankMaking:
    """How a rank joins the run, gets its group and builds its task. A process's rank: `_join` (the world's
    process group), `make_group`, `build_task`; the in-process harness (tests/helpers/in_process.py) runs
    ranks as threads of one process, each with process groups of its own built on the store."""

    join: Callable[[], Joined]
    group_of: Callable[[FlodlConfig, RankEnv, torch.device, str, PrefixStore, InboxReader], RankGroup] = (
        make_group
    )
    build: Callable[[TaskSettings, torch.device, int, int], TaskParts] = build_task


def serve_rank(
    cfg: FlodlConfig,
    config: dict[str, Any],
    info: RunInfo,
    env: RankEnv,
    making: RankMaking,
    apart: bool = False,
    self_launched: bool = False,
) -> None:
    """A rank's part of the run, from joining it to the coordinator's Shutdown (or its failure, recorded and
    told). `apart`: the run's host is a process apart from the ranks (else rank 0 hosts it)."""
    run_dir = Path(info.run_dir)
    host: RunHost | None = None
    outbox: Mailbox | None = None
    try:
        joined = making.join()
        device, backend, group = joined.device, joined.backend, joined.group

        def connect(namespace: str, owner: int | str) -> Mailbox:
            return Mailbox.connect(group.store_host, group.store_port, namespace, owner, cfg.launch.timeout_s)

        if not apart and env.rank == 0:  # this process is the run's host
            host = RunHost(cfg, config, info, env.world_size, group.exchange, connect)
            host.open()
        _agree_on_checkpoint_dir(cfg, env, run_dir, group.exchange, apart)
        checkpoint = agreed_checkpoint(env.rank, group.exchange)
        cfg = agreed_config(cfg, group.exchange)
        layout = agreed_layout(group.exchange)
        if checkpoint is not None and covers_every_epoch(checkpoint, cfg.epochs):
            return  # the host made the checkpoint's model the run's
        namespace = host_namespace(group.exchange)
        inbox = InboxReader(connect(namespace, env.rank))
        rank_group = making.group_of(cfg, env, device, backend, group.exchange, inbox)
        parts = making.build(task_settings(cfg), device, env.world_size, env.rank)
        picks = epoch_picks(
            parts.train_data, cfg.augment, cfg.steps_per_epoch, env.world_size, step_samples(cfg)
        )
        facts = TaskFacts(picks, parts.eval_data is not None)
        publish_task(group.exchange, facts)
        if host is not None:
            log_plan(cfg, env.world_size, device.type, layout)
            try:
                host.start(facts, hang_saver(cfg, parts.model, device, run_dir), in_rank=True)
            except WORDED as err:  # the others hear it before they wait for the host in a collective
                failures.record(run_dir, info.uid, env.restart_count, env.rank, err)  # first: the cause
                raise
        keeps_evaluated_models = coordinator_started(group.exchange)
        # A restarted rank receives the running group's state when it is admitted, not from a checkpoint.
        if checkpoint is not None and not rank_group.joining:
            load_model(checkpoint, parts.model)
        else:
            checkpoint = None
        outbox = connect(namespace, env.rank)
        worker = make_worker(
            cfg, parts, env, device, inbox, outbox, run_dir, rank_group, layout, keeps_evaluated_models
        )
        if checkpoint is not None:
            restore_worker(checkpoint, worker, env.world_size)
        train(cfg, env, info, worker, group, namespace, connect, host, apart)
        if worker.stopped_by is not None:  # a stop that saved: its checkpoint is committed
            raise Stopped(worker.stopped_by)
        if host is not None:
            host.finish()
    except BaseException as err:
        signum = _wind_down(err, env, info, host, outbox)
        if signum is None:
            # Who tells the user how the run ended: a self-launched rank's launcher, the launch in this
            # process for a single rank; ranks torchrun (or a scheduler) started say it themselves.
            extra = None if env.launched and not self_launched else FILE_ONLY
            log.error("rank %d failed: %s: %s", env.rank, type(err).__name__, err, exc_info=True, extra=extra)
            raise
        if host is not None:
            log.warning(
                "%s", stopped_line(signum, cfg, run_dir, info), extra=FILE_ONLY if self_launched else None
            )
        raise Stopped(signum) from None


def _join(cfg: FlodlConfig, config: dict[str, Any], env: RankEnv, run_dir: Path, apart: bool) -> Joined:
    """This rank's device, its collectives' backend, and the run's store and group joined; the config checked
    the same as the other ranks composed."""
    device = pick_device(cfg.device, env.local_rank)
    backend = collective_backend(cfg.backend, device.type)
    group = init_group(env, backend, device, cfg.launch.timeout_s, hosted_apart=apart)
    log.info(
        "rank %d/%d (pid %d) on %s (%s), master port %s, CUDA_VISIBLE_DEVICES=%s, run dir %s",
        env.rank,
        env.world_size,
        os.getpid(),
        device,
        backend,
        group.store_port,
        os.environ.get("CUDA_VISIBLE_DEVICES", "(all)"),
        run_dir,
    )
    agree_on_config(config, env.rank, env.world_size, group.exchange)
    return Joined(device, backend, group)


def _agree_on_checkpoint_dir(
    cfg: FlodlConfig, env: RankEnv, run_dir: Path, exchange: PrefixStore, apart: bool
) -> None:
    """Before any rank trains: every rank sees the checkpoint dir of the run's host (rank 0's own process
    sees it; a joiner checks itself besides the start's ranks), or none trains (flodl/job/shared_dir.py)."""
    ranks = {*range(env.world_size), env.rank}
    checked = sorted(ranks if apart else ranks - {0})
    together = [] if apart else list(range(env.world_size))  # survive's store is its host's: it stays
    mine = checkpoint_store(cfg, run_dir)
    agree_on_checkpoint_dir(exchange, env.rank, checked, mine, checkpoint_keys_set(cfg), together)


def _wind_down(
    err: BaseException, env: RankEnv, info: RunInfo, host: RunHost | None, outbox: Mailbox | None
) -> int | None:
    """After `err` ended this rank's part: record it, pass a stop signal on, and let the host (in this
    process) stop or tell the coordinator why. Returns the stop signal behind the end (None: a failure)."""
    step = err.step if isinstance(err, NonFiniteError) else None
    planned = isinstance(err, TooFewRanks)
    failures.record(Path(info.run_dir), info.uid, env.restart_count, env.rank, err, step, planned)
    # A stop signal to this rank, or to a peer (whose leaving is then why this rank failed).
    signum = err.signum if isinstance(err, Stopped) else None
    signum = signum or received() or (posted(outbox) if outbox is not None else None)
    if signum is not None and outbox is not None:
        post(outbox, signum)
    if host is not None:  # it shares this process's store: let it stop before the store goes
        host.stop()
    elif outbox is not None:  # tell the coordinator why, so it cuts (survive) or stops with this reason
        with contextlib.suppress(Exception):
            outbox.send(COORDINATOR, Exiting(env.rank, f"{type(err).__name__}: {err}"))
    return signum


def stopped_line(signum: int, cfg: FlodlConfig, run_dir: Path, info: RunInfo) -> str:
    """Where a stopped run stands and the command that continues it."""
    latest = checkpoint_store(cfg, run_dir).latest()
    if latest is not None:
        where = f"last checkpoint {latest.path} ({latest.point.words()})"
    else:
        where = "no checkpoint to resume from (checkpoints are off or none was due): resume starts over"
    resume = info.resume_command or f"resume=auto hydra.run.dir={run_dir}"
    return f"stopped by {signal.Signals(signum).name}: {where}; resume with: {resume}"


def log_plan(cfg: FlodlConfig, world_size: int, device_type: str, layout: Layout) -> None:
    """The run's start line: its global batch and the learning rate's scale the optimizer has, both the
    world's the run is laid out for (`layout`)."""
    factor = lr_scale_factor(layout.world, cfg.lr_scale_ratio)
    log.info(
        "policy=%s world=%d batch=%s/rank (global %d) lr x%.3g (lr_scale_ratio=%g) precision=%s compile=%s",
        cfg.policy,
        world_size,
        step_words(cfg),
        layout.global_batch,
        factor,
        cfg.lr_scale_ratio,
        cfg.precision,
        compile_mode_for(cfg, device_type, world_size) or "off",
    )


def device_type_of(cfg: FlodlConfig, gpus: int) -> str:
    """The ranks' device type, as a host apart (which touches no device) tells it from the host facts."""
    return "cuda" if cfg.device != "cpu" and gpus > 0 else "cpu"
