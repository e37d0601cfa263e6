"""Streams fed to a rank in one process (flodl/data/stream.py's StreamFeeder, with real DataLoader workers
where asked), and an HF `datasets` stream of numbered items as a task's train data."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate

from flodl.config.schema import FlodlConfig
from flodl.data.stream import StreamFeeder
from flodl.job.settings import data_plane_settings

SEED = 7
BATCH = 3


def stream_feeder(rank: int, world: int, workers: int, dataset: Any, split: str = "auto") -> StreamFeeder:
    """Rank `rank` of `world`'s feeder of `dataset`, read by `workers` DataLoader workers, BATCH a batch."""
    cfg = FlodlConfig(batch_size=BATCH, seed=SEED, num_workers=workers)
    cfg.task.stream_split = split
    settings = data_plane_settings(cfg, ranks_on_host=1, rank=rank, world_size=world)
    return StreamFeeder(settings, dataset, torch.device("cpu"), default_collate)


def fed_ids(feeder: StreamFeeder, count: int) -> list[list[int]]:
    """The first field of the items of the feeder's next `count` batches (the items' ids)."""
    picks = torch.arange(BATCH)
    return [feeder.load(picks, 0)[0].tolist() for _ in range(count)]


def hf_numbers(n: int, shards: int, ranks: int = 1, shuffle: bool = False) -> Any:
    """Ids 0 .. n-1 as an HF IterableDataset of `shards` data sources; split for rank 0 of `ranks` by HF's
    split_dataset_by_node when ranks > 1; shuffled with a buffer when asked."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    stream = datasets.Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=shards)
    if shuffle:
        stream = stream.shuffle(seed=3, buffer_size=8)
    return split_dataset_by_node(stream, rank=0, world_size=ranks) if ranks > 1 else stream
