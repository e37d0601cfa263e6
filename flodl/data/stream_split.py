"""Who splits a stream among its readers: the stream itself, or flodl; decided once, here.

A stream may split itself at two levels: among the ranks (webdataset's `nodesplitter=split_by_node`, HF's
`split_dataset_by_node`, a dataset that reads RANK / WORLD_SIZE or torch.distributed) and among a rank's
DataLoader workers (webdataset's default `workersplitter=split_by_worker`, every HF IterableDataset, a
dataset that reads `get_worker_info()`). flodl splits the levels the stream does not: among the ranks by
asking the dataset's `shard(world_size, rank)` when it has one, else by keeping every world_size-th item;
among a rank's K workers by keeping every K-th item of what a worker reads. So no level is split twice
and none is left whole.

`task.stream_split` says which levels the stream splits itself; `auto` takes what the packages expose (a
webdataset pipeline's stages, HF's distributed config), and a stream flodl cannot see into splits nothing.
A key that says flodl splits a level the stream visibly splits itself is refused, as is a webdataset
pipeline that refuses several ranks (`single_node_only`, its default node splitter) under several ranks.

A level the stream splits by whole shards must have them divide among its readers there
(flodl/data/stream_shards.py): a webdataset level whose shards do not is split by item instead, where it
can be, and what cannot be read evenly or resumed is refused, with the numbers and the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flodl.data.stream_shards import (
    check_hf,
    declared_shards,
    readers_per_rank,
    shards_divide,
    webdataset_levels,
    without_splitters,
)

# task.stream_split's values (flodl/config/schema.py): whether the stream splits itself among the ranks,
# among a rank's DataLoader workers.
_SAID = {"flodl": (False, False), "dataset": (True, True), "ranks": (True, False), "workers": (False, True)}


@dataclass(frozen=True)
class StreamSplit:
    """The levels a stream splits itself at, and where that was read (for the log)."""

    ranks: bool
    workers: bool
    why: str


@dataclass(frozen=True)
class _Seen:
    # None: the stream shows nothing of that level.
    ranks: bool | None
    workers: bool | None
    why: str
    # Why the stream cannot be read by several ranks as it is (None: it can).
    single_rank: str | None = None


def _webdataset_seen(dataset: Any) -> _Seen | None:
    """A webdataset pipeline (`WebDataset`, `DataPipeline`): its node and worker splitters are stages."""
    stages = getattr(dataset, "pipeline", None)
    if not type(dataset).__module__.startswith("webdataset") or not isinstance(stages, list):
        return None
    import webdataset as wds  # importable: the dataset is one of its classes

    if any(isinstance(stage, wds.ResampledShards) for stage in stages):  # each reader draws its own shards
        return _Seen(True, True, "its pipeline's ResampledShards: each reader draws shards of its own")
    node = wds.split_by_node in stages
    worker = wds.split_by_worker in stages
    names = [n for n, there in (("split_by_node", node), ("split_by_worker", worker)) if there]
    single = (
        "its pipeline's single_node_only (webdataset's default nodesplitter) refuses several ranks: build it "
        "with nodesplitter=wds.split_by_node (it splits the shards among the ranks), or nodesplitter=None "
        "(flodl keeps every world_size-th item)"
        if wds.single_node_only in stages
        else None
    )
    why = f"its pipeline's {' and '.join(names)}" if names else "its pipeline has no node or worker splitter"
    return _Seen(node or None, worker or None, why, single)


def _hf_seen(dataset: Any) -> _Seen | None:
    """An HF `datasets.IterableDataset`: `split_dataset_by_node` records its rank (`_distributed`), and it
    always splits its data sources among DataLoader workers."""
    if not type(dataset).__module__.startswith("datasets.") or not hasattr(dataset, "_distributed"):
        return None
    node = getattr(dataset, "_distributed", None)
    if node is None:
        return _Seen(None, True, "an HF IterableDataset splits its data sources among DataLoader workers")
    return _Seen(
        True,
        True,
        f"HF's split_dataset_by_node (rank {node.rank} of {node.world_size}) and its split among workers",
    )


def _seen(dataset: Any) -> _Seen:
    for look in (_webdataset_seen, _hf_seen):
        seen = look(dataset)
        if seen is not None:
            return seen
    return _Seen(None, None, "flodl sees no split of its own in it")


def decide(dataset: Any, said: str, world_size: int, num_workers: int = 0) -> StreamSplit:
    """The levels `dataset` splits itself at: `said` (task.stream_split) or, `auto`, what it shows, less a
    webdataset level whose shards do not divide among its readers (flodl splits that one by item). Raises
    ValueError naming the key to change for what would split a level twice, cannot run on `world_size`, or
    reads its items unevenly or unresumably under `num_workers` DataLoader workers."""
    seen = _seen(dataset)
    if seen.single_rank is not None and world_size > 1:
        raise ValueError(f"task.train_data: {type(dataset).__name__}: {seen.single_rank}")
    if said == "auto":
        split = StreamSplit(bool(seen.ranks), bool(seen.workers), seen.why)
    else:
        split = _said(dataset, said, seen)
    per_rank = readers_per_rank(num_workers)
    ranks, workers, note = webdataset_levels(dataset, split.ranks, split.workers, world_size, per_rank)
    if note:
        split = StreamSplit(ranks, workers, f"{split.why}; {note}")
    sources = declared_shards(dataset)
    if sources is not None and _asked_for_shards(dataset, split, world_size):
        sources //= world_size
    check_hf(dataset, sources, num_workers)
    return split


def _said(dataset: Any, said: str, seen: _Seen) -> StreamSplit:
    ranks, workers = _SAID[said]
    twice = [
        level
        for level, s, own in (("ranks", seen.ranks, ranks), ("workers", seen.workers, workers))
        if s and not own
    ]
    if twice:
        raise ValueError(
            f"task.stream_split={said}: {type(dataset).__name__} splits itself among the "
            f"{' and '.join(twice)} ({seen.why}), which flodl would split again; leave task.stream_split=auto"
        )
    return StreamSplit(ranks, workers, f"task.stream_split={said}")


@dataclass(frozen=True)
class ReaderPart:
    """What one reader reads: its `source` (the dataset, or its rank's shard of it) and, of the items that
    gives it, those at `offset`, `offset + stride`, ..."""

    source: Any
    stride: int
    offset: int
    words: str


def reader_part(dataset: Any, split: StreamSplit, world_size: int, per_rank: int, index: int) -> ReaderPart:
    """Reader `index` (its rank's worker `index % per_rank`, or the rank) of `world_size x per_rank`."""
    rank, worker = divmod(index, per_rank)
    shards = _asked_for_shards(dataset, split, world_size)
    stride, number = _stride(split, shards, world_size, per_rank)
    offset = {"": 0, "k": worker, "rank": rank, "rank x K + k": index}[number]
    words = _words(
        split, shards, world_size, per_rank, (rank, worker), f"items {offset}, {offset} + {stride}, ..."
    )
    if shards:
        source = dataset.shard(num_shards=world_size, index=rank)
    else:
        source = without_splitters(dataset, split.ranks, split.workers)
    return ReaderPart(source, stride, offset, words)


def readers_words(dataset: Any, split: StreamSplit, world_size: int, per_rank: int) -> str:
    """What each of the `world_size x per_rank` readers reads, in one line for the log."""
    shards = _asked_for_shards(dataset, split, world_size)
    stride, number = _stride(split, shards, world_size, per_rank)
    words = _words(split, shards, world_size, per_rank, None, f"items n, n + {stride}, ... (n = {number})")
    readers = f"a rank's DataLoader worker k of K={per_rank}" if per_rank > 1 else "one per rank"
    return f"each of the {world_size * per_rank} stream readers ({readers}) reads {words} ({split.why})"


def _asked_for_shards(dataset: Any, split: StreamSplit, world_size: int) -> bool:
    """Whether flodl asks the dataset for its rank's `shard`: it has one, does not split among ranks, and
    its shards (`num_shards`, where it says) divide among them: else every rank would not get as many."""
    return (
        not split.ranks and callable(getattr(dataset, "shard", None)) and shards_divide(dataset, world_size)
    )


def _stride(split: StreamSplit, shards: bool, world_size: int, per_rank: int) -> tuple[int, str]:
    """Every how many items flodl keeps one, and which number the first kept item is ('': keeps all)."""
    ranks_cut, workers_cut = split.ranks or shards, split.workers or per_rank == 1
    if ranks_cut and workers_cut:
        return 1, ""
    if ranks_cut:
        return per_rank, "k"
    if workers_cut:
        return world_size, "rank"
    return world_size * per_rank, "rank x K + k"


def _words(
    split: StreamSplit,
    shards: bool,
    world_size: int,
    per_rank: int,
    reader: tuple[int, int] | None,
    kept: str,
) -> str:
    """A reader's part in words: of reader (rank, worker), or of any reader (None)."""
    rank, worker = reader if reader is not None else ("its rank", "k")
    if split.ranks:
        words = f"the stream's own part for {'rank ' if reader else ''}{rank}"
    else:
        words = f"the dataset's shard({world_size}, {rank})" if shards else "the whole stream"
    if split.workers and per_rank > 1:
        words += f" as DataLoader worker {worker} of {per_rank} reads it (the stream splits it)"
    stride, _ = _stride(split, shards, world_size, per_rank)
    return words + (f", keeping {kept}" if stride > 1 else ", every item of it")
