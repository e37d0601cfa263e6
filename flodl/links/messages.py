"""Typed control and report messages, encoded as JSON (never pickle).

Worker -> coordinator: ChunkReport (one per chunk), Reached, RoundAck, EvalResult, Saved, Heartbeat, Exiting,
ModelSaved, Joined and Regrouped (fault_tolerance=survive).
Coordinator -> worker: StartEpoch (sync: the rank's slice of the epoch), ExtendPartition (local SGD: more
batches and the count to report at), AverageNow (start an averaging round), Regroup (survive: the averaging
group changed), SaveModel (the run's end: one member writes model.pt), Shutdown.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class EpochSlice:
    """Picks `[offset, offset + size)` of one epoch's shared permutation: what a rank is told to train,
    from the planner (or the sync partition) down to the stepper."""

    epoch: int
    offset: int
    size: int


def _as_slice(value: EpochSlice | dict[str, int]) -> EpochSlice:
    return value if isinstance(value, EpochSlice) else EpochSlice(**value)  # JSON brings a dict back


@dataclass
class StartEpoch:
    """Sync: train these picks of `epoch` in lock step with the other members (the same number of steps)."""

    epoch: int
    slices: list[EpochSlice]
    # Evaluate the model after this epoch and report an EvalResult.
    evaluate: bool = False
    # Write this rank's checkpoint part after the epoch and report Saved.
    checkpoint: bool = False
    # fault_tolerance=survive: the group this plan is for (a plan of an older generation is dropped), and
    # the steps of the epoch the members trained before it (the rest of an epoch a membership change cut).
    generation: int = 0
    first_step: int = 0
    # Checkpoints inside the share: [step of the epoch after which to save, samples of the epoch trained
    # by then], in order (each saved and reported with Saved, after a ChunkReport of the steps before it).
    checkpoint_steps: list[list[int]] = field(default_factory=list)
    # Samples of each of this rank's steps (0: its own; keep_global_batch gives fewer members more).
    step_samples: int = 0

    def __post_init__(self) -> None:
        self.slices = [_as_slice(s) for s in self.slices]


@dataclass
class ExtendPartition:
    """Local SGD: append these slices to the rank's queue."""

    slices: list[EpochSlice]
    # Report Reached once this many steps were taken since the last reduce (None: slices only, past a
    # count already reached).
    target: int | None

    def __post_init__(self) -> None:
        self.slices = [_as_slice(s) for s in self.slices]


@dataclass
class AverageNow:
    round: int
    # Evaluate the consensus before adopting it, once, reported for each of these epochs.
    evaluate_epochs: list[int] = field(default_factory=list)
    # A segment's (or the run's) last reduce: adopt the consensus exactly (no EASGD blend).
    final: bool = False
    # Write this rank's checkpoint part for that epoch after adopting, before acknowledging.
    checkpoint_epoch: int | None = None
    # The averaging group's generation it is meant for (survive: an order for a group that could not be
    # formed is superseded by the next Regroup's).
    generation: int = 0
    # A checkpoint inside `checkpoint_epoch`: the samples of it trained (None: after the epoch, whole).
    checkpoint_into: int | None = None


@dataclass
class Shutdown:
    reason: str = "done"
    # A stop that saved: the signal that asked for it (the rank exits 128 + it); None: the run's end.
    signum: int | None = None


@dataclass
class SaveModel:
    """The run is over: write the model (every member holds the final one) to `path`, then say ModelSaved."""

    path: str


@dataclass
class ModelSaved:
    rank: int


@dataclass
class ChunkReport:
    rank: int
    epoch: int
    batches: int
    samples: int
    # Sum over batches of the batch-mean loss (the loss is reported batch-weighted).
    loss_sum: float
    # Wall time of the chunk on this rank, and the part spent waiting for data.
    wall_ms: float
    data_ms: float
    steps_total: int = 0
    # Bytes this rank put on the wire during the chunk (sync: DDP's gradient all-reduces).
    comm_bytes: int = 0
    # The learning rate (first param group) at the end of the chunk.
    lr: float = 0.0
    # record_scalar's (sum, count) per name over the chunk.
    scalars: dict[str, list[float]] = field(default_factory=dict)
    # When the chunk's first step began and its last ended, on the rank's own clock (unix seconds).
    started_at: float = 0.0
    ended_at: float = 0.0
    # The first step of a compiled model (tracing, code generation), left out of wall_ms.
    compile_s: float = 0.0
    # Where the chunk's slice starts in its epoch (local SGD: a chunk is one handed-out EpochSlice, or its
    # trained start as a round took its snapshot, and then its rest).
    offset: int = 0
    # Sync under fault_tolerance=survive: the generation of the plan the chunk trained.
    generation: int = 0
    # Throughput people compare (flodl/metrics/flops.py): the model's FLOPs per training sample and this
    # rank's device peak (0: not known), the tokens a sample holds (0: not a token task), and the most
    # device memory allocated during the chunk (0: on the CPU).
    flops_per_sample: float = 0.0
    peak_flops: float = 0.0
    tokens_per_sample: int = 0
    peak_memory: int = 0


@dataclass
class Progress:
    """Every `logger.log_every` steps: the rank's recent loss and speed, for live curves and the bar."""

    rank: int
    epoch: int
    step: int
    # Mean loss over the steps since the previous Progress.
    loss: float
    samples_per_s: float
    lr: float


@dataclass
class Reached:
    rank: int
    steps: int
    # Time spent on this window's batches (data + compute), excluding waits for messages.
    busy_ms: float


@dataclass
class RoundAck:
    rank: int
    round: int
    # Steps this rank contributed (n_k) and whether the round had any mass at all.
    steps: int
    skipped: bool
    divergence: float
    # How long the round held up this rank's training thread.
    round_ms: float
    # Batches still queued on the rank (async overshoot not yet trained).
    queued: int
    # Steps the rank trained while the round was in flight (cpu backend, async).
    steps_during_round: int = 0
    # Bytes this rank put on the wire for the round (after bf16 compression).
    payload_bytes: int = 0
    # Wall time of the window (from the last round's end to this one's) this rank did not train.
    idle_ms: float = 0.0
    # The averaging group's generation the round ran in (survive: an ack of a cut round is stale).
    generation: int = 0
    # From the round's start to its consensus on this rank, waited for or not (overlapped rounds train the
    # next window meanwhile; round_ms is what the rank waited of it).
    comm_ms: float = 0.0


@dataclass
class EvalResult:
    rank: int
    epoch: int
    # Per-metric sums over this rank's share of the eval set, and that share's size.
    sums: dict[str, float]
    count: int
    # What the evaluated model was trained on: optimizer steps (sync: global-batch steps; cadence/async:
    # every rank's steps up to the round it is the consensus of) and samples.
    step: int = 0
    samples: int = 0
    # The averaging group's generation of the round evaluated (survive: a cut round's eval is stale).
    generation: int = 0
    # This rank's own optimizer steps in the evaluated model (the scale of a record's `step`), and when it
    # took the model up (unix seconds, its clock): where the eval stands on the run's step and time axes.
    own_steps: int = 0
    taken_at: float = 0.0


@dataclass
class Saved:
    """This rank's checkpoint part is on disk."""

    rank: int
    epoch: int
    # A part inside the epoch: the samples of it trained (None: after the epoch).
    into: int | None = None
    # Sync, a part no plan asked for (a stop that saves): the step of the epoch it was written after.
    step: int | None = None
    # The chunks of the epoch this rank reported before the part (the epoch's record at the checkpoint).
    chunks: int = 0
    # A checkpoint the stop that saves may end at (one taken before may still commit after the signal, since
    # parts are written in the background): local SGD, any part taken after this rank learned of the stop;
    # sync, the agreed step's part alone (the parts on the way there are committed before it).
    after_stop: bool = False


@dataclass
class Heartbeat:
    """Sent every few seconds by each rank's heartbeat thread: the process is alive and scheduling."""

    rank: int
    step: int


@dataclass
class Regroup:
    """fault_tolerance=survive: the averaging group is now `members` (generation `generation`); a round cut
    by the change is redone (the coordinator sends its AverageNow again)."""

    generation: int
    members: list[int]
    joining: list[int] = field(default_factory=list)
    # The round in flight that the change cut (None: the change came between rounds).
    cut_round: int | None = None
    # Every member receives the `sharer`'s state: a joiner's first, or any change before the first round
    # closed (a death while the ranks started may have cut the start's own broadcast).
    shares_state: bool = False
    # Sync's admissions: taken where the members reach it in their inboxes (after the epochs planned before
    # it), releasing nothing in flight. Otherwise a Regroup aborts the group the moment it arrives.
    in_order: bool = False

    @property
    def sharer(self) -> int:
        """The member whose state the others receive when it `shares_state`: the first one that is not
        joining (a joiner holds nothing yet; rank 0 restarted is one)."""
        return self.sharer_in(self.members)

    def sharer_in(self, ranks: Sequence[int]) -> int:
        """The sharer among `ranks`, members all: with sharded groups, the ranks holding one shard index (a
        rank's shard comes from the first of them not joining)."""
        return min(set(ranks) - set(self.joining))


@dataclass
class Regrouped:
    """A rank formed the new group: how long it took to let go of the old one and form the new."""

    rank: int
    generation: int
    release_ms: float
    form_ms: float
    # Sync: where the members agreed they are, [epoch, steps of it trained] (the coordinator plans the rest).
    position: list[int] | None = None


@dataclass
class FirstStep:
    """Sync under fault_tolerance=survive: the first optimizer step of a new group went through (the first
    member says so)."""

    rank: int
    generation: int


@dataclass
class Joined:
    """A restarted rank (its `incarnation`-th start) is ready and waits to be admitted."""

    rank: int
    incarnation: int
    # From the process's start to this message: what a restart costs before the rank can be admitted.
    startup_s: float = 0.0


@dataclass
class StopRequested:
    """This rank got a stop signal: the ranks save a checkpoint at the next boundary, then stop."""

    rank: int
    signum: int


@dataclass
class Exiting:
    rank: int
    # Why, when the rank knows (an error message).
    reason: str = ""


Message = (
    StartEpoch
    | ExtendPartition
    | AverageNow
    | Shutdown
    | SaveModel
    | ModelSaved
    | ChunkReport
    | Progress
    | Reached
    | RoundAck
    | EvalResult
    | Saved
    | Heartbeat
    | Exiting
    | StopRequested
    | Regroup
    | Regrouped
    | FirstStep
    | Joined
)
_TYPES: dict[str, type] = {t.__name__: t for t in Message.__args__}


class MessageError(ValueError):
    pass


def encode(message: Message) -> bytes:
    return json.dumps({"type": type(message).__name__, "body": asdict(message)}).encode()


def decode(raw: bytes) -> Message:
    try:
        data: dict[str, Any] = json.loads(raw)
        return _TYPES[data["type"]](**data["body"])
    except (KeyError, TypeError, ValueError, RecursionError) as err:
        raise MessageError(f"undecodable flodl message {raw[:200]!r}: {err}") from err
