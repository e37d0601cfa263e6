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

A level the stream splits by whole shards holds every item once only where its shards divide evenly among
the readers there: else the readers' parts differ, the short ones wrap around and the long ones never reach
their end, since a rank takes its readers' batches in turn. Where the shard list shows (webdataset's URLs,
HF's `num_shards`), flodl checks it: it takes a webdataset level over (its splitter stage left out of the
readers' pipelines, and every n-th item kept instead), asks a dataset's `shard` only when its shards divide
among the ranks, and refuses an HF stream whose shards do not divide among a rank's DataLoader workers (HF
splits them there, unasked) with the numbers; a shuffled HF stream under DataLoader workers, whose state
does not load back, is refused too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

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


def readers_per_rank(num_workers: int) -> int:
    """A rank's readers: one per DataLoader worker, or the rank itself."""
    return max(num_workers, 1)


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
    _check_hf(dataset, split, world_size, num_workers)
    return _webdataset_evened(dataset, split, world_size, readers_per_rank(num_workers))


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


def _webdataset_evened(dataset: Any, split: StreamSplit, world_size: int, per_rank: int) -> StreamSplit:
    """`split`, less the levels a webdataset pipeline splits by shards that do not divide among its readers
    there: flodl splits those by item (their splitter stage is left out of the readers' pipelines)."""
    stages = getattr(dataset, "pipeline", None)
    if not type(dataset).__module__.startswith("webdataset") or not isinstance(stages, list) or not stages:
        return split
    import webdataset as wds  # importable: the dataset is one of its classes

    urls = getattr(stages[0], "urls", None) if isinstance(stages[0], wds.SimpleShardList) else None
    if urls is None:  # no shard list to count (drawn, or the user's own source)
        return split
    shards, node, notes = len(urls), wds.split_by_node in stages, []
    ranks, workers = split.ranks, split.workers
    if ranks and node and shards % world_size:
        ranks = False
        notes.append(f"its {shards} shards do not divide among {world_size} ranks")
    rank_shards = shards // world_size if ranks else shards
    by_worker = workers and per_rank > 1 and wds.split_by_worker in stages and (node or not ranks)
    if by_worker and rank_shards % per_rank:
        workers = False
        notes.append(f"a rank's {rank_shards} shards do not divide among its {per_rank} DataLoader workers")
    if not notes:
        return split
    taken = " and ".join(n for n, own in (("split_by_node", ranks), ("split_by_worker", workers)) if not own)
    why = f"{split.why}; {' and '.join(notes)}, so flodl splits by item instead of {taken}"
    return StreamSplit(ranks, workers, why)


def _check_hf(dataset: Any, split: StreamSplit, world_size: int, num_workers: int) -> None:
    """An HF IterableDataset under DataLoader workers: they split its data sources (shards) among
    themselves whatever flodl asks, so those must divide among a rank's workers; and a shuffled one's state,
    taken in a worker, must load back."""
    if num_workers == 0 or not type(dataset).__module__.startswith("datasets."):
        return
    name = type(dataset).__name__
    if _hf_shuffled(dataset):
        raise ValueError(
            f"num_workers={num_workers}: task.train_data ({name}) is shuffled, and HF's state of a shuffled "
            "stream taken in a DataLoader worker does not load back (an IndexError in its load_state_dict), "
            "so no checkpoint of this run could be resumed; set num_workers=0"
        )
    total = getattr(dataset, "num_shards", None)
    if total is None or num_workers == 1:
        return
    sources = total // world_size if _asked_for_shards(dataset, split, world_size) else total
    if sources % num_workers:
        raise ValueError(_uneven_hf_words(name, sources, num_workers))


def _uneven_hf_words(name: str, sources: int, workers: int) -> str:
    """Why a rank's `sources` HF data sources cannot be read evenly by its `workers`, and what to change."""
    counts = [len(range(k, sources, workers)) for k in range(workers)]
    twice = sum(max(Fraction(sources, workers) - c, Fraction(0)) for c in counts)
    fits = max(d for d in range(1, workers) if sources % d == 0)
    return (
        f"num_workers={workers}: task.train_data ({name}) splits a rank's {sources} data sources "
        f"(num_shards) among its {workers} DataLoader workers itself, {', '.join(map(str, counts))}, and a "
        f"rank takes its workers' batches in turn: each pass of the stream would read about {float(twice):g} "
        f"sources' items twice and as many never, on every rank; set num_workers={fits} (a divisor of "
        f"{sources}), or give each rank a multiple of {workers} data sources (the world_size, or the "
        "stream's num_shards)"
    )


def _hf_shuffled(dataset: Any) -> bool:
    """Whether an HF IterableDataset shuffles (a shuffled stage in its chain of example iterables)."""
    stage = getattr(dataset, "_ex_iterable", None)
    while stage is not None:
        if "Shuffled" in type(stage).__name__:
            return True
        stage = getattr(stage, "ex_iterable", None)
    return False


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
    source = dataset.shard(num_shards=world_size, index=rank) if shards else _own_stages(dataset, split)
    return ReaderPart(source, stride, offset, words)


def _own_stages(dataset: Any, split: StreamSplit) -> Any:
    """`dataset`, less the webdataset splitter stages of the levels flodl splits (`_webdataset_evened`)."""
    stages = getattr(dataset, "pipeline", None)
    if not type(dataset).__module__.startswith("webdataset") or not isinstance(stages, list):
        return dataset
    import webdataset as wds  # importable: the dataset is one of its classes

    dropped = [
        s for s, own in ((wds.split_by_node, split.ranks), (wds.split_by_worker, split.workers)) if not own
    ]
    if not any(stage in dropped for stage in stages):
        return dataset
    source = copy.copy(dataset)
    source.pipeline = [stage for stage in stages if stage not in dropped]
    return source


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
    shards = getattr(dataset, "num_shards", None)
    divides = not isinstance(shards, int) or shards % world_size == 0
    return not split.ranks and callable(getattr(dataset, "shard", None)) and divides


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
