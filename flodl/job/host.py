"""The run's host: the process that holds what must outlive a training rank.

The coordinator (plans, rounds, aggregation, membership) with its sinks (console, metrics.jsonl, W&B,
timeline), the checkpoint the ranks continue from and the commits of new ones, and the run's end (model.pt,
asked of a member; the run's times; on_run_end). Under fault_tolerance=none it is rank 0's process: a rank's
death ends the run anyway, and torchrun starts no process of flodl's besides the ranks. Under survive it is a
process apart from the ranks, so that any rank, rank 0 included, may die: the supervisor of a self-launch,
or `flodl-coordinator` beside ranks started on several hosts. That process then trains nothing, and is the
one whose loss ends the run.

The ranks and their host meet in the run's store, as JSON under the run's exchange: the host publishes the
namespace of the run's mailboxes and the checkpoint to continue from, the ranks publish what their task holds
(its picks, whether it has eval data: the host builds no task), and the host says whether its coordinator
started (and whether a callback keeps the evaluated models, which the group's first member then writes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import PrefixStore

from flodl.checkpoints.disk import MODEL_FILE, Checkpoint, CheckpointDir, atomic_save
from flodl.checkpoints.identity import run_identity
from flodl.config.layout import Layout
from flodl.config.policy import PolicyFacts, checkpoint_keys_set, checkpoints_on, rank_capacity
from flodl.config.schema import FlodlConfig
from flodl.coordinator.coordinator import Coordinator
from flodl.coordinator.hooks import RunSummary
from flodl.coordinator.roster import TooFewRanks
from flodl.job.coordinator_assembly import CoordinatorSetup, make_coordinator
from flodl.job.failures import Consequence
from flodl.job.resume import (
    agreed_config,
    agreed_layout,
    coordinator_state,
    covers_every_epoch,
    publish_checkpoint_choice,
    resize_of,
)
from flodl.job.settings import resume_settings
from flodl.job.shared_dir import mark_checkpoint_dir, ranks_see_it
from flodl.links.group import publish_json, read_json
from flodl.links.threads import wait_ended
from flodl.links.transport import COORDINATOR, InboxReader, Mailbox
from flodl.metrics import run_clock
from flodl.metrics.run_info import RunInfo
from flodl.metrics.sinks import METRICS_FILE

log = logging.getLogger("flodl")

# The exchange's keys between the ranks and their host.
_NAMESPACE = "namespace"
_TASK = "task"
_STARTED = "coordinator_started"


class HostFailed(Consequence):
    """The run's host could not start the run (its reason is in the message): every rank stops with it."""


@dataclass(frozen=True)
class TaskFacts:
    """What the host learns of the task from the ranks: the epoch's picks (dataset length x augment) and
    whether there is eval data."""

    total_picks: int
    has_eval: bool


def publish_task(exchange: PrefixStore, facts: TaskFacts) -> None:
    """A rank's task, for its host (every rank publishes the same)."""
    publish_json(exchange, _TASK, dataclasses.asdict(facts))


def host_namespace(exchange: PrefixStore) -> str:
    """The namespace of the run's mailboxes, as the host published it (waits for it)."""
    return str(read_json(exchange, _NAMESPACE))


def coordinator_started(exchange: PrefixStore) -> bool:
    """Waits for the host's coordinator to start: whether a callback keeps each eval's model (BestModel: the
    group's first member then writes it); HostFailed with the host's reason if it could not start."""
    started = read_json(exchange, _STARTED)
    if "error" in started:
        raise HostFailed(f"the run's host could not start the run: {started['error']}")
    return bool(started["keeps_evaluated_models"])


class RunHost:
    def __init__(
        self,
        cfg: FlodlConfig,
        config: dict[str, Any],
        info: RunInfo,
        world_size: int,
        exchange: PrefixStore,
        connect: Callable[[str, int | str], Mailbox],
    ) -> None:
        """`connect(namespace, owner)`: a mailbox of this run in the store the ranks share."""
        self.cfg = cfg
        self.config = config
        self.info = info
        self.world_size = world_size
        self.exchange = exchange
        self.connect = connect
        self.run_dir = Path(info.run_dir)
        self.namespace = uuid.uuid4().hex
        self.checkpoint: Checkpoint | None = None
        # The world the run is laid out for, built with the choice of checkpoint (None: not chosen yet).
        self.layout: Layout | None = None
        # The mark left in the checkpoint dir for this start (None: checkpoints off, or not opened yet).
        self.checkpoints: CheckpointDir | None = None
        self.mark: str | None = None
        self.coordinator: Coordinator | None = None
        # Set once the coordinator ended (done, failed or stopped): the ranks are told, the host may go.
        self.ended = threading.Event()
        self.error: BaseException | None = None

    def open(self) -> Checkpoint | None:
        """Before any rank needs them: the run's namespace, its checkpoint dir marked for the ranks to look
        for (flodl/job/shared_dir.py), and the checkpoint it continues from. A checkpoint that covers every
        epoch leaves nothing to train: its model is the run's."""
        publish_json(self.exchange, _NAMESPACE, self.namespace)
        identity = run_identity(self.config, self.info.uid)
        settings = resume_settings(self.cfg, self.run_dir, identity)
        self.checkpoints = settings.checkpoints
        try:
            self.checkpoint = publish_checkpoint_choice(settings, self.world_size, self.exchange)
        finally:  # after the history is put in line (a fresh start moves checkpoints/ aside); the ranks
            # wait for the mark before they read the choice, or why there is none. A run with nothing left
            # to train writes no checkpoint.
            writes = checkpoints_on(self.cfg) and not self.nothing_left
            self.mark = mark_checkpoint_dir(self.exchange, self.checkpoints if writes else None)
        self.cfg = agreed_config(self.cfg, self.exchange)
        self.layout = agreed_layout(self.exchange)
        if self.checkpoint is not None and self.checkpoint.world_size != self.world_size:
            shares = not PolicyFacts.of(self.cfg).averages_parameters
            log.warning("%s", resize_of(self.checkpoint, self.world_size, shares).words())
        if self.nothing_left:
            assert self.checkpoint is not None
            log.info(
                "checkpoint %s covers all %d epochs: nothing left to train",
                self.checkpoint.path,
                self.cfg.epochs,
            )
            atomic_save(self.checkpoint.model(), self.run_dir / MODEL_FILE)
        return self.checkpoint

    @property
    def nothing_left(self) -> bool:
        """The checkpoint the run continues from covers every epoch (the ranks see it too)."""
        return self.checkpoint is not None and covers_every_epoch(self.checkpoint, self.cfg.epochs)

    def start(
        self, facts: TaskFacts, hang_saver: Callable[[], None] | None = None, in_rank: bool = False
    ) -> Coordinator:
        """Build and start the coordinator for the ranks' task; the ranks hear whether it started.
        `hang_saver` (rank 0's process under sync): what to save when a peer hangs. `in_rank`: this is
        rank 0's process (`rank_done` says when that rank's last parts are said)."""
        resumed = coordinator_state(self.checkpoint) if self.checkpoint is not None else None
        assert self.layout is not None, "the coordinator started before the host chose its checkpoint"
        reader = InboxReader(self.connect(self.namespace, COORDINATOR))
        setup = CoordinatorSetup(
            self.config,
            self.info,
            self.world_size,
            rank_capacity(self.cfg, self.world_size),
            facts.total_picks,
            facts.has_eval,
            reader,
            self.connect(self.namespace, COORDINATOR),
            resumed,
            self.layout,
            hang_saver,
            None if self.checkpoint is None else self.checkpoint.world_size,
        )
        try:
            coordinator = make_coordinator(self.cfg, setup)
        except Exception as err:  # the ranks hear it before they wait for the host in a collective
            publish_json(self.exchange, _STARTED, {"error": f"{type(err).__name__}: {err}"})
            raise
        if in_rank:
            coordinator.hosting_rank_done = threading.Event()
        keeps = coordinator.hooks.run.keeps_evaluated_models
        publish_json(self.exchange, _STARTED, {"keeps_evaluated_models": keeps})
        coordinator.start()
        self.coordinator = coordinator
        return coordinator

    def serve(self) -> None:
        """A host apart from the ranks (a thread of the supervisor or of flodl-coordinator): start the
        coordinator once a rank said what its task holds, and wait for it to end."""
        try:
            if self.nothing_left:
                return
            if self.mark is not None:  # the ranks of the start see this host's checkpoint dir, or none trains
                ranks_see_it(self.exchange, list(range(self.world_size)), checkpoint_keys_set(self.cfg))
            facts = TaskFacts(**read_json(self.exchange, _TASK))
            self.start(facts).join()
        except BaseException as err:
            self.error = err
        finally:
            self.ended.set()

    def finish(self) -> None:
        """After the coordinator ended: its failure raised; else the run's times and on_run_end (model.pt was
        written by a member), and a planned stop for too few ranks raised, naming why."""
        self._unmark()
        if self.error is not None:
            raise self.error
        if self.nothing_left:
            return
        coordinator = self.coordinator
        assert coordinator is not None, "finish() before the coordinator started"
        wait_ended(coordinator)
        if coordinator.error is not None:
            raise RuntimeError(f"the coordinator failed: {coordinator.error}") from coordinator.error
        assert coordinator.started_at is not None and coordinator.ended_at is not None
        run_clock.record(
            self.run_dir, training_started_at=coordinator.started_at, training_ended_at=coordinator.ended_at
        )
        model = self.run_dir / MODEL_FILE
        log.info("run dir %s: %s, %s", self.run_dir, METRICS_FILE, MODEL_FILE)
        lines = (self.run_dir / METRICS_FILE).read_text().splitlines()
        records = [json.loads(line) for line in lines if line]
        coordinator.hooks.run_end(RunSummary(coordinator.last_epoch, coordinator.stopped, model, records[-1]))
        too_few = coordinator.roster.too_few
        if too_few is not None:  # the consensus is saved: now the run ends, naming why
            raise TooFewRanks(f"{too_few}; its consensus is saved as {model}")

    def rank_done(self) -> None:
        """This process's rank has trained its part and said Saved for its last parts: a failed coordinator
        may commit what they complete."""
        if self.coordinator is not None and self.coordinator.hosting_rank_done is not None:
            self.coordinator.hosting_rank_done.set()

    def stop_on_signal(self, signum: int) -> bool:
        """A stop signal to the run's host apart (flodl-coordinator): the run stops as on a member's, the
        ranks saving a checkpoint first (told, if the signal reached this process alone); False when its
        coordinator has not started yet (nothing to save: stop now)."""
        if self.coordinator is None:
            return False
        self.coordinator.stop_from_host(signum)
        return True

    def stop(self) -> None:
        """The run stops (a signal, a failure): let the coordinator end (it keeps the timeline so far)."""
        self._unmark()
        if self.coordinator is not None:
            self.coordinator.stop_requested.set()
            wait_ended(self.coordinator, timeout=10)

    def _unmark(self) -> None:
        """No rank looks for this start's mark once the run ends."""
        if self.checkpoints is not None and self.mark is not None:
            self.checkpoints.unmark(self.mark)
