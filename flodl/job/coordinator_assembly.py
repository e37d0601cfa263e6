"""Put the run's coordinator together, in the run's host (flodl/job/host.py): the roster, the policy's driver,
the ledger, the committer and the sinks, every structure sized for the job's seats.

The policy's facts are resolved once (flodl/config/policy.py: `PolicyFacts`) and the config is mapped to
each room's settings by flodl/job/settings.py; what is built here takes those.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn

from flodl.checkpoints.disk import Point
from flodl.checkpoints.identity import run_identity
from flodl.config.layout import Layout
from flodl.config.policy import (
    PolicyFacts,
    checkpoint_epochs,
    checkpoints_on,
    heartbeat_timeout_of,
    step_samples,
)
from flodl.config.schema import FlodlConfig
from flodl.coordinator.commit import HANG_MODEL_FILE, CheckpointCommitter, consensus_saver
from flodl.coordinator.coordinator import Coordinator
from flodl.coordinator.driver import Driver, EpochSchedule
from flodl.coordinator.hooks import CallbackError, Hooks, Run
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.local_sgd_driver import LocalSgdDriver
from flodl.coordinator.lockstep import KeptBatch
from flodl.coordinator.roster import Roster, SurvivingRoster
from flodl.coordinator.survivors import SurviveSettings
from flodl.coordinator.sync_driver import PLAN_LOOKAHEAD, SyncDriver
from flodl.data.partition import equal_slices
from flodl.job.settings import (
    elche_settings,
    resume_settings,
    wandb_settings,
)
from flodl.links.heartbeat import HeartbeatMonitor, beat_interval
from flodl.links.transport import InboxReader, Mailbox
from flodl.metrics.run_info import RunInfo
from flodl.metrics.sinks import METRICS_FILE, ConsoleSink, JsonlSink, Sink
from flodl.metrics.timeline import Timeline
from flodl.rounds.elche import ElChe
from flodl.rounds.group_pace import whole_groups
from flodl.rounds.guard import guard_from_state, make_guard
from flodl.rounds.planner import LocalSgdPlanner
from flodl.rounds.supply import Supplied

log = logging.getLogger("flodl")


@dataclass(frozen=True)
class CoordinatorSetup:
    """What the run's host (flodl/job/host.py) knows when it builds the coordinator, beyond the config."""

    # The resolved config (recorded in checkpoints and W&B) and the job's names.
    config: dict[str, Any]
    info: RunInfo
    # The ranks the job starts with, and the most it holds at once (rank_capacity: seats for joiners).
    world_size: int
    capacity: int
    # The task, as the ranks built it: the epoch's picks, and whether there is eval data.
    total_picks: int
    has_eval: bool
    # The coordinator's inbox and its outbox to the ranks.
    reader: InboxReader
    outbox: Mailbox
    # The coordinator state of the checkpoint this run continues from (None: a fresh run), and the world the
    # run is laid out for (built with the choice of that checkpoint: flodl/job/resume.py).
    resumed: dict[str, Any] | None
    layout: Layout
    # Under sync with the host in rank 0's process: writes rank 0's parameters (the consensus) if a peer
    # hangs (None: nothing worth saving there).
    hang_saver: Callable[[], None] | None = None
    # The ranks of the world that wrote the checkpoint this run continues from (None: a fresh run).
    saved_world: int | None = None


def hang_saver(
    cfg: FlodlConfig, model: nn.Module, device: torch.device, run_dir: Path
) -> Callable[[], None] | None:
    """Under sync, rank 0's parameters are the consensus a hung peer leaves: what its host saves then (a
    sharded model's are a shard, which the hung peer's group could not gather)."""
    if PolicyFacts.of(cfg).averages_parameters or cfg.shard_group > 1:
        return None
    return consensus_saver(model, device, run_dir / HANG_MODEL_FILE)


def _heartbeat_monitor(cfg: FlodlConfig, world_size: int, capacity: int) -> HeartbeatMonitor:
    """The seats past the start's unwatched until taken; a rank not heard from yet has the start's bound."""
    return HeartbeatMonitor(
        capacity,
        heartbeat_timeout_of(cfg),
        0.0,
        ignored=set(range(world_size, capacity)),
        startup_s=cfg.launch.timeout_s,
    )


def make_coordinator(cfg: FlodlConfig, setup: CoordinatorSetup) -> Coordinator:
    """The run's coordinator: every structure sized for the job's seats, its members the ranks it starts
    with (the seats past them wait for ranks that join)."""
    info, world_size, capacity, resumed = setup.info, setup.world_size, setup.capacity, setup.resumed
    policy = PolicyFacts.of(cfg)
    step_size = step_samples(cfg)
    schedule = EpochSchedule(
        cfg.epochs, world_size, setup.total_picks, step_size, cfg.eval_every, setup.has_eval
    )
    timeline = Timeline(capacity)
    run_dir = Path(info.run_dir)
    # Where a resumed run starts: the epoch after its checkpoint, or the one it was taken inside.
    first = Point(resumed["epoch"], resumed.get("into")).next_epoch if resumed else 0
    comm_total = resumed["comm_bytes_total"] if resumed else 0
    committer = None
    if checkpoints_on(cfg):
        due = {e for e in checkpoint_epochs(cfg) if e >= first}
        settings = resume_settings(cfg, run_dir, run_identity(setup.config, info.uid))
        committer = CheckpointCommitter(
            settings.checkpoints, world_size, due, settings.kind, settings.run, setup.layout
        )
    monitor = _heartbeat_monitor(cfg, world_size, capacity)
    if policy.averages_parameters:  # a sharded group's ranks train as many batches (rounds/group_pace.py)
        batches_per_epoch = whole_groups(setup.total_picks // step_size, cfg.shard_group)
    else:  # DDP's steps: whole global steps of the world
        batches_per_epoch = (
            equal_slices(setup.total_picks, world_size, step_size)[0].size // step_size * world_size
        )
    ledger = EpochLedger(
        cfg.epochs,
        world_size,
        batches_per_epoch,
        policy.averages_parameters,
        first,
        comm_total,
        policy.crosses_epochs,
    )
    if (
        resumed is not None and resumed.get("ledger") is not None
    ):  # what the epoch's record held at the checkpoint
        ledger.resume_partial(first, resumed["ledger"])
    roster: Roster
    if cfg.fault_tolerance == "survive":
        roster = SurvivingRoster(
            world_size,
            setup.outbox,
            monitor,
            ledger,
            timeline,
            SurviveSettings(cfg.min_ranks, capacity, cfg.shard_group),
        )
    else:
        roster = Roster(world_size, setup.outbox, monitor)
    driver: Driver
    if policy.averages_parameters:
        driver = _local_sgd_driver(cfg, policy, schedule, ledger, setup, roster, timeline, committer)
    else:
        driver = _sync_driver(cfg, schedule, ledger, setup, roster, committer)
    total_batches = (cfg.epochs - first) * ledger.batches_per_epoch - ledger.reported_batches(first)
    sinks = _sinks(cfg, setup, policy, total_batches, first)
    hooks = Hooks(
        build_callbacks(cfg.callbacks), Run(run_dir, policy.name, world_size, cfg.epochs, setup.config)
    )
    return Coordinator(
        setup.reader,
        setup.outbox,
        ledger,
        driver,
        sinks,
        timeline,
        run_dir,
        monitor,
        committer,
        hooks,
        roster,
        setup.hang_saver,
        gathers_model=cfg.shard_group > 1,
    )


def _sync_driver(
    cfg: FlodlConfig,
    schedule: EpochSchedule,
    ledger: EpochLedger,
    setup: CoordinatorSetup,
    roster: Roster,
    committer: CheckpointCommitter | None,
) -> SyncDriver:
    resumed, layout = setup.resumed, setup.layout
    inside = resumed is not None and resumed.get("ledger") is not None
    return SyncDriver(
        schedule,
        ledger,
        setup.outbox,
        roster,
        ledger.first_epoch,
        committer,
        0 if cfg.fault_tolerance == "survive" else PLAN_LOOKAHEAD,  # survive: admissions at the next epoch
        cfg.checkpoint_every_steps,
        resumed["driver"] if resumed is not None and inside else None,
        cfg.checkpoint_every_s,
        KeptBatch(layout, cfg.batch_size) if layout.kept else None,
    )


def _sinks(
    cfg: FlodlConfig, setup: CoordinatorSetup, policy: PolicyFacts, total_batches: int, first: int
) -> list[Sink]:
    """Where the run's metrics go: the console, metrics.jsonl in the run dir, and W&B when logger=wandb (its
    run continued where the run resumes from a checkpoint, from `first`, the first epoch it trains)."""
    sinks: list[Sink] = [
        ConsoleSink(cfg.epochs, total_batches, setup.capacity),
        JsonlSink(Path(setup.info.run_dir) / METRICS_FILE),
    ]
    if cfg.logger.name == "wandb":
        from flodl.metrics.wandb_sink import Resumed, WandbSink

        saved = setup.saved_world
        resumed = None if saved is None else Resumed(first, saved, setup.world_size)
        sinks.append(WandbSink(wandb_settings(cfg), setup.info, setup.config, policy.name, resumed))
    return sinks


def build_callbacks(nodes: list[Any]) -> list[object]:
    built = []
    for i, node in enumerate(nodes):
        try:
            built.append(instantiate(node))
        except Exception as err:
            target = node.get("_target_")
            raise CallbackError(f"callbacks[{i}] ({target}): could not build it: {err}") from err
    return built


def _local_sgd_driver(
    cfg: FlodlConfig,
    policy: PolicyFacts,
    schedule: EpochSchedule,
    ledger: EpochLedger,
    setup: CoordinatorSetup,
    roster: Roster,
    timeline: Timeline,
    committer: CheckpointCommitter | None,
) -> LocalSgdDriver:
    resumed, first_members = setup.resumed, setup.world_size
    settings = elche_settings(cfg, setup.capacity, policy)
    planner = LocalSgdPlanner(
        world_size=setup.capacity,
        batches_per_epoch=ledger.batches_per_epoch,
        batch_size=schedule.batch_size,
        epochs=cfg.epochs,
        is_async=policy.crosses_epochs,
        eval_epochs=schedule.eval_epochs(),
        barrier_epochs=checkpoint_epochs(cfg),
        first_epoch=ledger.first_epoch,
        first_batch=(resumed.get("into") or 0) // schedule.batch_size if resumed else 0,
        checkpoint_every_batches=_checkpoint_every_batches(cfg, schedule),
        overlap=cfg.overlap_rounds,
        first_members=first_members,
    )
    guard = make_guard(cfg.divergence_guard, cfg.divergence_threshold, policy.blends)
    elche = ElChe(settings, epoch_batches=ledger.batches_per_epoch, first_members=first_members)
    if resumed is not None:  # ElChe's anchor and counts, the guard's history, the round clock
        state = resumed["driver"]
        planner.restore(state["planner"])
        elche = ElChe.from_state(settings, state["elche"], ledger.batches_per_epoch, first_members)
        guard = guard_from_state(state["guard"])
        log.info("ElChe resumed at anchor %d (round %d)", elche.anchor, planner.round)
    # Async under survive trains on while a silent member holds up a round; a sharded group steps whole.
    keeps_supplied = policy.crosses_epochs and cfg.fault_tolerance == "survive" and cfg.shard_group == 1
    supplied = Supplied(beat_interval(roster.monitor.timeout_s)) if keeps_supplied else None
    return LocalSgdDriver(
        planner,
        elche,
        guard,
        ledger,
        setup.outbox,
        timeline,
        roster,
        committer,
        cfg.checkpoint_every_s,
        supplied,
    )


def _checkpoint_every_batches(cfg: FlodlConfig, schedule: EpochSchedule) -> int | None:
    """checkpoint_every_steps as batches the local-SGD planner hands out (a global step: one per rank)."""
    every = cfg.checkpoint_every_steps
    return None if every is None else every * schedule.world_size
