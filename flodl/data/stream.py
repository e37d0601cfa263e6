"""Streams: a torch IterableDataset as training data (HF streaming datasets, webdataset, your own generator).

A stream has no length and no index, so an epoch is `steps_per_epoch` optimizer steps per rank: its pick
space is `steps_per_epoch x world_size x step_samples` positions, planned like a map-style epoch's (the
planner, the ledger and the checkpoints count in it), but a position names no item: a rank trains the next
items of its own shard, in order.

Readers. A rank reads through K = max(num_workers, 1) readers (its DataLoader workers, or itself); reader
`r = rank x K + k` of `R = world_size x K` reads a part of the stream no other reader reads. The stream
may split itself among the ranks, among a rank's workers, or both (webdataset's splitters, HF's
`split_dataset_by_node`, `task.stream_split`: flodl/data/stream_split.py decides); flodl splits the rest,
among the ranks by the dataset's `shard(world_size, rank)` when it has one, else by keeping every R-th (or
world_size-th) item, and among the workers by keeping every K-th item. No level is split twice.
Each batch of `batch_size` items comes from one reader; a rank takes its readers' batches in turn.

Passes. A reader whose shard runs out starts it again (after `set_epoch(pass)` when the dataset has one, as
HF's reshuffles with), so an item is trained once per pass of its reader's shard.

Positions. A reader's position is the passes it finished, the items of its shard it read in this pass and,
for a dataset with `state_dict` / `load_state_dict`, the dataset's state after them. A rank's checkpoint
part holds its readers' positions after the last batch it trained and how many batches it took: a resumed
reader goes on from its state (`load_state_dict`) or reads the pass again and skips what it had read, and
the rank takes its readers' batches in the same turn as before (a worker's batch read before its reader's
turn waits for it).

Randomness. Each batch is read under random streams of its own (flodl/data/streams.py), seeded from (seed,
reader, pass, the batch's place in the pass), and the reader's generators are put back after it: what an
item draws from torch's, numpy's or Python's generators while it is read is the same in every run, resumed
or not, and reading never moves the step's draws.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from flodl.data.dataset import is_stream
from flodl.data.feeder import DataPlaneSettings
from flodl.data.sample import check_movable, to_device
from flodl.data.stream_shards import readers_per_rank
from flodl.data.stream_split import StreamSplit, decide, reader_part, readers_words
from flodl.data.streams import batch_streams, mixed_seed
from flodl.data.tiers import FeedStats

log = logging.getLogger(__name__)

Collate = Callable[[list[Any]], Any]
# Tags that keep a stream's batch seeds and its DataLoader's worker seeds apart from every other stream.
_READER = 0x53545245
_LOADER = 0x4C4F4144


def stream_picks(steps_per_epoch: int, world_size: int, step_samples: int) -> int:
    """A stream's epoch in picks: `steps_per_epoch` steps of `step_samples` for each of `world_size` ranks."""
    return steps_per_epoch * world_size * step_samples


def epoch_picks(
    train_data: Any, augment: int, steps_per_epoch: int | None, world_size: int, step_samples: int
) -> int:
    """An epoch's pick space: a stream's `stream_picks`, else every view of every sample."""
    if not is_stream(train_data):
        return len(train_data) * augment
    assert steps_per_epoch is not None, "a stream's epoch is steps_per_epoch (checked before any rank)"
    return stream_picks(steps_per_epoch, world_size, step_samples)


def start_position() -> dict[str, Any]:
    """A reader's position before its first item (plain values: checkpoints load with weights_only)."""
    return {"passes": 0, "seen": 0, "state": None}


class ShardReader:
    """One reader's items, pass after pass, and where it stands: reader `index` of `readers`, `per_rank` of
    them a rank's."""

    def __init__(
        self,
        dataset: Any,
        readers: int,
        index: int,
        seed: int,
        split: StreamSplit,
        position: dict[str, Any] | None = None,
        per_rank: int = 1,
    ) -> None:
        self.index = index
        self.readers = readers
        self.seed = seed
        part = reader_part(dataset, split, readers // per_rank, per_rank, index)
        # The items the source gives this reader's process, every stride-th kept from offset.
        self.source, self.stride, self.offset = part.source, part.stride, part.offset
        self.shard_words = part.words
        self.stateful = all(
            callable(getattr(self.source, m, None)) for m in ("state_dict", "load_state_dict")
        )
        start = position or start_position()
        self.passes, self.seen, self.state = int(start["passes"]), int(start["seen"]), start["state"]
        self._items: Iterator[Any] | None = None
        # Whether this pass was read from its beginning, and the items kept of it so far.
        self._whole_pass = False
        self._kept = 0

    def take(self, count: int) -> list[Any]:
        """The next `count` items, read under the batch's own random streams."""
        with batch_streams(mixed_seed(_READER, self.seed, self.index, self.passes, self.seen)):
            return [self._next() for _ in range(count)]

    def position(self) -> dict[str, Any]:
        """Where this reader stands, after the last item it gave."""
        state = self.source.state_dict() if self.stateful and self._items is not None else self.state
        return {"passes": self.passes, "seen": self.seen, "state": state}

    def _next(self) -> Any:
        while True:
            if self._items is None:
                self._items = self._open()
            for item in self._items:
                index = self.seen
                self.seen += 1
                if index % self.stride == self.offset:
                    self._kept += 1
                    return item
            if self._whole_pass and self._kept == 0:
                raise ValueError(
                    f"task.train_data: stream reader {self.index} of {self.readers} found no item in its "
                    f"part ({self.shard_words}); give the stream more items (or data sources), or use fewer "
                    "readers (world_size x max(num_workers, 1))"
                )
            self.passes, self.seen, self.state, self._items = self.passes + 1, 0, None, None

    def _open(self) -> Iterator[Any]:
        """This pass's items from where the reader stands: the dataset's state loaded, or the items read
        before skipped (under streams of their own: the batch's are not moved by them)."""
        set_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.passes)
        self._whole_pass, self._kept = self.seen == 0 and self.state is None, 0
        if self.stateful and self.state is not None:
            self.source.load_state_dict(self.state)
            return iter(self.source)
        items = iter(self.source)
        with batch_streams(mixed_seed(_READER, self.seed, self.index, self.passes)):
            skipped = sum(1 for _ in itertools.islice(items, self.seen))
        if skipped < self.seen:  # the pass is shorter than the position says: the stream changed
            raise ValueError(
                f"task.train_data: stream reader {self.index} of {self.readers} was {self.seen} items into "
                f"pass {self.passes} of its shard, which now has {skipped}; a stream must give the same "
                "items each time it is read"
            )
        return items


class _WorkerReaders(IterableDataset):
    """A rank's readers as a DataLoader's dataset: worker k is reader k of the rank's; each item a whole
    batch, with its reader and the reader's position after it."""

    def __init__(
        self,
        dataset: Any,
        split: StreamSplit,
        readers: int,
        first: int,
        positions: list[dict[str, Any] | None],
        batch_size: int,
        collate: Collate,
        seed: int,
    ) -> None:
        self.dataset, self.split, self.readers, self.first = dataset, split, readers, first
        self.positions, self.batch_size, self.collate, self.seed = positions, batch_size, collate, seed

    def __iter__(self) -> Iterator[tuple[Any, int, dict[str, Any]]]:
        info = get_worker_info()
        assert info is not None, "a stream's worker readers run in DataLoader workers"
        k, per_rank = info.id, info.num_workers
        index = self.first + k
        reader = ShardReader(
            self.dataset, self.readers, index, self.seed, self.split, self.positions[k], per_rank
        )
        while True:
            yield self.collate(reader.take(self.batch_size)), k, reader.position()


def _as_is(batch: Any) -> Any:
    return batch


class StreamFeeder:
    """The data plane of a stream: each `load` trains the rank's next batch, from its readers in turn; no
    read plan (a stream is read in order, so there is nothing to stage or find ahead), the DataLoader's
    workers read ahead."""

    # The Feeder protocol's (flodl/data/feeders.py): a pick is a place in the epoch, the readers' positions
    # are checkpointed.
    in_order = True

    def __init__(
        self, settings: DataPlaneSettings, dataset: Any, device: torch.device, collate: Collate
    ) -> None:
        self.settings = settings
        self.dataset = dataset
        self.device = device
        self.collate = collate
        self.per_rank = readers_per_rank(settings.num_workers)
        self.readers = settings.world_size * self.per_rank
        self.first = settings.rank * self.per_rank
        # Each reader's position after the last batch this rank trained of it (None: its start), and the
        # batches taken: whose turn is next.
        self.positions: list[dict[str, Any] | None] = [None] * self.per_rank
        self.taken = 0
        self.stats = FeedStats()
        self._batches: Iterator[tuple[Any, int, dict[str, Any]]] | None = None
        # Batches read before their reader's turn (after a resume the workers start at worker 0 again).
        self._early: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._checked = False
        # Which levels the stream splits itself (checked before any rank: flodl/preflight/task_probe.py).
        self.split = decide(dataset, settings.stream_split, settings.world_size, settings.num_workers)
        if settings.rank == 0:
            words = readers_words(dataset, self.split, settings.world_size, self.per_rank)
            log.info("task.train_data (%s): %s", type(dataset).__name__, words)

    def advise(self, epoch: int, picks: torch.Tensor) -> None:
        """Nothing to plan: a stream's next batch is whatever its reader reads next."""

    def load(self, picks: torch.Tensor, epoch: int) -> Any:
        """The rank's next batch of the stream (`picks` only says how many items), on the device."""
        started = time.perf_counter()
        assert len(picks) == self.settings.batch_size, "a stream is read in whole batches"
        batch, k, position = self._next_in_turn()
        before = self.positions[k]
        if before is not None and position["passes"] > before["passes"]:
            log.info(
                "stream reader %d of %d read its whole shard: pass %d starts",
                self.first + k,
                self.readers,
                position["passes"] + 1,
            )
        self.positions[k] = position
        self.taken += 1
        if not self._checked:  # once: a value the device move would leave behind fails here, named
            check_movable(batch, "task.train_data")
            self._checked = True
        self.stats.add("source_reads", len(picks))
        batch = to_device(batch, self.device, non_blocking=True)
        self.stats.record_load(started)
        return batch

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: each reader's position after the batches trained, and the turn."""
        return {"readers": self.readers, "taken": self.taken, "positions": copy.deepcopy(self.positions)}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue where a checkpoint's `state` stood (before the first batch is read)."""
        assert self._batches is None, "a stream's positions are restored before it is read"
        if int(state["readers"]) != self.readers:
            raise ValueError(
                f"the checkpoint's stream positions are of {state['readers']} readers, this run has "
                f"{self.readers} (world_size x max(num_workers, 1)): each reads its own shard, so resume "
                "with the same world_size and num_workers"
            )
        self.positions = list(state["positions"])
        self.taken = int(state["taken"])

    def close(self) -> None:
        self._batches = None  # a DataLoader iterator shuts its workers down when it goes
        self._early = {}

    def _next_in_turn(self) -> tuple[Any, int, dict[str, Any]]:
        """The batch of the reader whose turn it is; the workers' batches come in their order, so those of
        the readers before it wait (at most one round of them)."""
        if self._batches is None:
            self._batches = self._open()
        k = self.taken % self.per_rank
        while k not in self._early:
            batch, reader, position = next(self._batches)
            self._early[reader] = (batch, position)
        batch, position = self._early.pop(k)
        return batch, k, position

    def _open(self) -> Iterator[tuple[Any, int, dict[str, Any]]]:
        settings = self.settings
        if settings.num_workers == 0:
            return self._own_batches()
        readers = _WorkerReaders(
            self.dataset,
            self.split,
            self.readers,
            self.first,
            self.positions,
            settings.batch_size,
            self.collate,
            settings.seed,
        )
        loader = DataLoader(
            readers,
            batch_size=None,
            num_workers=settings.num_workers,
            collate_fn=_as_is,
            pin_memory=settings.pin_memory and self.device.type == "cuda",
            prefetch_factor=settings.prefetch_factor,
            # The workers' base seed from a generator of the rank's own: the rank's streams are not drawn.
            generator=torch.Generator().manual_seed(mixed_seed(_LOADER, settings.seed, settings.rank)),
        )
        return iter(loader)

    def _own_batches(self) -> Iterator[tuple[Any, int, dict[str, Any]]]:
        """The rank's one reader, read in the step's thread when a batch is due (as torch's DataLoader does
        without workers)."""
        reader = ShardReader(
            self.dataset, self.readers, self.first, self.settings.seed, self.split, self.positions[0]
        )
        while True:
            yield self.collate(reader.take(self.settings.batch_size)), 0, reader.position()
