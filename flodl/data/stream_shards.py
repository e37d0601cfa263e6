"""Whether a stream's shards divide among its readers, where its shard list shows; pure.

A level a stream splits by whole shards (webdataset's `split_by_node` / `split_by_worker` stages over its
URLs, HF's split of its data sources among DataLoader workers) holds every item once a pass only where its
shards divide among the readers there: else the readers' parts differ, and since a rank takes its readers'
batches in turn, the short parts wrap round while the long ones never reach their end. So:

- a webdataset level whose shards do not divide is read without its splitter stage, and flodl keeps every
  n-th item instead (`webdataset_levels`, `without_splitters`); unless the pipeline shuffles where the
  readers of that level would shuffle differently (an unseeded shuffle; among the ranks, any shuffle, as
  each rank's pipeline draws its own seed): then it is refused with the numbers;
- an HF stream whose data sources do not divide among a rank's workers is refused with the numbers (HF
  splits them there whatever flodl asks), as is a shuffled HF stream under DataLoader workers (its state,
  taken in a worker, does not load back: `check_hf`);
- a dataset's `shard(world_size, rank)` is asked only where its `num_shards` divide among the ranks
  (`shards_divide`).

The numbers are in shards' worth of items: exact for shards of equal length.
"""

from __future__ import annotations

import copy
from fractions import Fraction
from typing import Any


def readers_per_rank(num_workers: int) -> int:
    """A rank's readers: one per DataLoader worker, or the rank itself."""
    return max(num_workers, 1)


def declared_shards(dataset: Any) -> int | None:
    """How many shards a dataset says it has: `num_shards` (HF's, `n_shards` before datasets 3), or None."""
    shards = getattr(dataset, "num_shards", getattr(dataset, "n_shards", None))
    return shards if isinstance(shards, int) else None


def shards_divide(dataset: Any, world_size: int) -> bool:
    """Whether a dataset's shards, where it says, divide among `world_size` ranks."""
    shards = declared_shards(dataset)
    return shards is None or shards % world_size == 0


def webdataset_levels(
    dataset: Any, ranks: bool, workers: bool, world_size: int, per_rank: int
) -> tuple[bool, bool, str]:
    """The levels a webdataset pipeline still splits itself (of `ranks`, `workers`: those it does), less
    those whose shards do not divide among their readers, and the note saying so ('' if none). Raises
    ValueError with the numbers where such a level cannot be split by item (its readers shuffle apart)."""
    stages = getattr(dataset, "pipeline", None)
    if not type(dataset).__module__.startswith("webdataset") or not isinstance(stages, list) or not stages:
        return ranks, workers, ""
    import webdataset as wds  # importable: the dataset is one of its classes

    urls = getattr(stages[0], "urls", None) if isinstance(stages[0], wds.SimpleShardList) else None
    if urls is None:  # no shard list to count (drawn, or the user's own source)
        return ranks, workers, ""
    shards = len(urls)
    node = ranks and wds.split_by_node in stages
    worker = workers and per_rank > 1 and wds.split_by_worker in stages and (node or not ranks)
    node_off = node and shards % world_size != 0
    rank_shards = shards // world_size if node and not node_off else shards
    worker_off = worker and rank_shards % per_rank != 0
    if not node_off and not worker_off:
        return ranks, workers, ""
    shuffles = _shuffles(stages, seeded=not node_off)
    if shuffles:
        counts = _counts(shards, world_size, per_rank, node, worker)
        fixes = [_node_fix(shards, world_size)] if node_off else []
        if worker_off:
            fixes.append(_worker_fix(rank_shards, per_rank))
        uneven = _uneven_words(f"its {shards} shards", f"its {len(counts)} readers", counts)
        raise ValueError(
            f"task.train_data ({type(dataset).__name__}): {uneven}, and its pipeline shuffles ({shuffles}) "
            f"where its readers would not shuffle alike, so flodl cannot keep every n-th item instead; "
            f"{'; or '.join(fixes)}"
        )
    notes = [f"its {shards} shards do not divide among {world_size} ranks"] if node_off else []
    if worker_off:
        notes.append(f"a rank's {rank_shards} shards do not divide among its {per_rank} DataLoader workers")
    taken = " and ".join(
        n for n, off in (("split_by_node", node_off), ("split_by_worker", worker_off)) if off
    )
    note = f"flodl leaves {taken} out of its readers' pipelines and splits by item: {' and '.join(notes)}"
    return ranks and not node_off, workers and not worker_off, note


def without_splitters(dataset: Any, ranks: bool, workers: bool) -> Any:
    """`dataset`, less the webdataset splitter stages of the levels it does not split (`webdataset_levels`
    took them over)."""
    stages = getattr(dataset, "pipeline", None)
    if not type(dataset).__module__.startswith("webdataset") or not isinstance(stages, list):
        return dataset
    import webdataset as wds  # importable: the dataset is one of its classes

    levels = ((wds.split_by_node, ranks), (wds.split_by_worker, workers))
    dropped = [stage for stage, own in levels if not own]
    if not any(stage in dropped for stage in stages):
        return dataset
    source = copy.copy(dataset)
    source.pipeline = [stage for stage in stages if stage not in dropped]
    return source


def check_hf(dataset: Any, rank_sources: int | None, num_workers: int) -> None:
    """An HF IterableDataset under DataLoader workers, of `rank_sources` data sources a rank (None: it does
    not say): they must divide among a rank's workers, and a shuffled one's state must load back."""
    if num_workers == 0 or not type(dataset).__module__.startswith("datasets."):
        return
    name = type(dataset).__name__
    if _hf_shuffled(dataset):
        raise ValueError(
            f"num_workers={num_workers}: task.train_data ({name}) is shuffled, and HF's state of a shuffled "
            "stream taken in a DataLoader worker does not load back (an IndexError in its load_state_dict), "
            "so no checkpoint of this run could be resumed; set num_workers=0"
        )
    if rank_sources is None or rank_sources % num_workers == 0:
        return
    counts = _counts(rank_sources, 1, num_workers, False, True)
    given = f"a rank's {rank_sources} data sources (num_shards)"
    uneven = _uneven_words(given, f"its {num_workers} DataLoader workers", counts, "data sources")
    raise ValueError(
        f"num_workers={num_workers}: task.train_data ({name}) {uneven}, on every rank; "
        f"{_worker_fix(rank_sources, num_workers, 'data sources')}"
    )


def _counts(shards: int, world_size: int, per_rank: int, node: bool, worker: bool) -> list[Fraction]:
    """Each reader's shards' worth of items: of the rank's shards (every world_size-th from its rank, or
    all with every world_size-th item kept), every per_rank-th from its worker (or all, every per_rank-th
    item kept)."""
    counts = []
    for rank in range(world_size):
        mine, part = (
            (len(range(rank, shards, world_size)), Fraction(1)) if node else (shards, Fraction(1, world_size))
        )
        for k in range(per_rank):
            counts.append(len(range(k, mine, per_rank)) * part if worker else mine * part / per_rank)
    return counts


def _uneven_words(given: str, among: str, counts: list[Fraction], what: str = "shards") -> str:
    """`given` (how many `what`, whose) split `among` readers as `counts`, and what each pass would read
    twice and never."""
    fair = sum(counts, Fraction(0)) / len(counts)
    twice = sum(max(fair - c, Fraction(0)) for c in counts)
    each = ", ".join(f"{float(c):g}" for c in counts)
    return (
        f"splits {given} among {among} itself ({each} {what} each), and a rank takes its readers' batches in "
        f"turn: each pass of the stream would read about {float(twice):g} {what}' items twice and as many "
        "never"
    )


def _node_fix(shards: int, world_size: int) -> str:
    return f"run on a number of ranks that divides {shards}, or write a multiple of {world_size} shards"


def _worker_fix(rank_shards: int, workers: int, what: str = "shards") -> str:
    fits = max(d for d in range(1, workers) if rank_shards % d == 0)
    return (
        f"set num_workers={fits} (a divisor of a rank's {rank_shards} {what}), or give each rank a multiple "
        f"of {workers} {what}"
    )


def _shuffles(stages: list[Any], seeded: bool) -> str:
    """The pipeline's shuffling stages its readers would not draw alike: unseeded ones, or (`seeded`
    False) any; '' if none."""
    import webdataset as wds  # importable: the caller's dataset is one of its classes

    found = []
    for stage in stages:
        if isinstance(stage, wds.filters.detshuffle) and stage.bufsize > 1 and not seeded:
            found.append("detshuffle")
        elif getattr(stage, "f", None) is wds.filters._shuffle:
            size = stage.args[0] if stage.args else stage.kw.get("bufsize", 1000)
            if size and size > 1 and not (seeded and stage.kw.get("seed") is not None):
                found.append(f"shuffle({size})")
    return ", ".join(found)


def _hf_shuffled(dataset: Any) -> bool:
    """Whether an HF IterableDataset shuffles (a shuffled stage in its chain of example iterables)."""
    stage = getattr(dataset, "_ex_iterable", None)
    while stage is not None:
        if "Shuffled" in type(stage).__name__:
            return True
        stage = getattr(stage, "ex_iterable", None)
    return False
