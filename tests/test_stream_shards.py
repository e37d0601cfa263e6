"""A stream split by whole shards holds every item once a pass only where its shards divide among its
readers (flodl/data/stream_split.py): real webdataset shards whose count does not divide among the ranks or
a rank's workers are split by item instead (each reader's part as long as another's, together the stream
once), an HF stream whose data sources do not divide among a rank's DataLoader workers is refused before any
rank with the numbers, `shard` is not asked of an HF stream whose shards do not divide among the ranks, and a
shuffled HF stream under DataLoader workers (whose state does not load back) is refused naming num_workers.
webdataset and HF `datasets` are optional: their tests are skipped where they are not installed."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from flodl.config.schema import FlodlConfig
from flodl.data.stream import ShardReader
from flodl.data.stream_split import decide
from flodl.preflight.task_probe import task_problems
from tests.helpers.byo_data import write_point_shards
from tests.helpers.stream_feeds import SEED, fed_ids, hf_numbers, stream_feeder

PER_SHARD = 4  # items a shard holds: every shard alike, so equal shard counts are equal parts


def _webdataset(wds: Any, folder: Path, shards: int, shardshuffle: int = 0, **options: Any) -> Any:
    """`shards` real webdataset shards of PER_SHARD points (ids 0 ..), read as its users read them on
    several ranks: split_by_node, and its default split_by_worker; the shards' order shuffled, if asked."""
    write_point_shards(folder, shards * PER_SHARD, shards)
    urls = sorted(str(p) for p in folder.glob("*.tar"))
    dataset = wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=shardshuffle, **options)
    return dataset.decode().to_tuple("id.cls")


def _part(reader: ShardReader) -> list[int]:
    """The ids of one pass of a reader's part (read up to the first item of its next pass)."""
    part: list[int] = []
    while True:
        (item,) = reader.take(1)
        if reader.position()["passes"]:
            return part
        part.append(int(item["id"] if isinstance(item, dict) else item[0]))  # HF's dicts, webdataset's tuples


def _parts(dataset: Any, world: int, workers: int, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every reader's part of `dataset` on `world` ranks of `workers` DataLoader workers, each read in this
    process as its worker reads it (webdataset's RANK / WORLD_SIZE / WORKER / NUM_WORKERS)."""
    per_rank = max(workers, 1)
    split = decide(dataset, "auto", world, workers)
    parts = []
    for index in range(world * per_rank):
        rank, worker = divmod(index, per_rank)
        for key, value in (
            ("RANK", rank),
            ("WORLD_SIZE", world),
            ("WORKER", worker),
            ("NUM_WORKERS", workers),
        ):
            monkeypatch.setenv(key, str(value))
        parts.append(_part(ShardReader(dataset, world * per_rank, index, SEED, split, None, per_rank)))
    return parts


@pytest.mark.parametrize(
    ("shards", "world", "workers"),
    [(6, 2, 2), (8, 2, 2), (3, 2, 0), (3, 2, 2), (6, 4, 3), (5, 1, 2), (4, 2, 3), (9, 3, 2), (2, 1, 3)],
)
def test_every_reader_of_a_webdataset_reads_as_many_items_and_together_the_stream_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wds: Any, shards: int, world: int, workers: int
) -> None:
    parts = _parts(_webdataset(wds, tmp_path, shards), world, workers, monkeypatch)
    assert sorted(i for part in parts for i in part) == list(range(shards * PER_SHARD))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1, [len(p) for p in parts]


def test_a_seeded_shard_shuffle_that_a_ranks_workers_draw_alike_is_split_by_item_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wds: Any
) -> None:
    # 5 shards among 1 rank's 2 workers, their order shuffled from the pipeline's seed: each worker reads
    # all 5 in the same order and keeps every other item.
    parts = _parts(_webdataset(wds, tmp_path, 5, shardshuffle=5, seed=1), 1, 2, monkeypatch)
    assert sorted(parts[0] + parts[1]) == list(range(20))
    assert [len(p) for p in parts] == [10, 10]


def test_uneven_shards_whose_readers_would_shuffle_apart_are_refused_with_the_numbers(
    tmp_path: Path, wds: Any
) -> None:
    # Issue 54's shape with an unseeded sample shuffle (each worker would draw its own order): refused.
    with pytest.raises(ValueError) as refused:
        decide(_webdataset(wds, tmp_path / "workers", 6).shuffle(8), "auto", 2, 2)
    assert str(refused.value) == (
        "task.train_data (WebDataset): splits its 6 shards among its 4 readers itself (2, 1, 2, 1 shards "
        "each), and a rank takes its readers' batches in turn: each pass of the stream would read about 1 "
        "shards' items twice and as many never, and its pipeline shuffles (shuffle(8)) where its readers "
        "would not shuffle alike, so flodl cannot keep every n-th item instead; set num_workers=1 (a divisor "
        "of a rank's 3 shards), or give each rank a multiple of 2 shards"
    )
    # 3 shards on 2 ranks, shuffled from a seed each rank's pipeline draws itself: refused too.
    with pytest.raises(
        ValueError,
        match=r"splits its 3 shards among its 2 readers itself \(2, 1 shards each\).* about 0.5 shards' "
        r"items twice .* shuffles \(shuffle\(3\)\) .*; run on a number of ranks that divides 3, or write a "
        r"multiple of 2 shards$",
    ):
        decide(_webdataset(wds, tmp_path / "ranks", 3, shardshuffle=3, seed=1), "auto", 2, 0)


@pytest.mark.multiproc
def test_six_webdataset_shards_on_two_ranks_of_two_workers_train_every_item_once_a_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wds: Any
) -> None:
    # Issue 54's case, through a rank's feeder and real DataLoader workers: 6 shards do not divide among a
    # rank's 2 workers (3 a rank), so they read by item; 2 passes of 24 items, 8 batches of 3 a rank.
    dataset = _webdataset(wds, tmp_path, 6)
    monkeypatch.setenv("WORLD_SIZE", "2")
    trained: Counter[int] = Counter()
    with caplog.at_level(logging.INFO, logger="flodl"):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            feeder = stream_feeder(rank, 2, 2, dataset)
            trained.update(i for batch in fed_ids(feeder, 8) for i in batch)
            feeder.close()
    assert trained == Counter({i: 2 for i in range(24)})
    assert (
        "reads the stream's own part for its rank, keeping items n, n + 2, ... (n = k) (its pipeline's "
        "split_by_node and split_by_worker; flodl leaves split_by_worker out of its readers' pipelines and "
        "splits by item: a rank's 3 shards do not divide among its 2 DataLoader workers)"
    ) in caplog.text


def _probed(world: int, workers: int, **stream: Any) -> list[str]:
    """What the preflight finds in `hf_numbers(**stream)` as the train data of `world` ranks."""
    cfg = FlodlConfig(batch_size=4, steps_per_epoch=2, num_workers=workers)
    task = {
        "model": {"_target_": "tests.helpers.byo_data.linear"},
        "train_data": {"_target_": "tests.helpers.stream_feeds.hf_numbers", **stream},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
    }
    return task_problems(cfg, task, world)


@pytest.mark.usefixtures("hf")
def test_hf_data_sources_that_do_not_divide_among_a_ranks_workers_are_refused_with_the_numbers() -> None:
    # Issue 54's case: 3 sources, split_dataset_by_node on 2 ranks (by example: 3 do not divide), and HF
    # splits each rank's 3 among its 2 workers as 2 and 1.
    assert _probed(2, 2, n=120, shards=3, ranks=2) == [
        "num_workers=2: task.train_data (IterableDataset) splits a rank's 3 data sources (num_shards) among "
        "its 2 DataLoader workers itself (2, 1 data sources each), and a rank takes its readers' batches in "
        "turn: each pass of the stream would read about 0.5 data sources' items twice and as many never, on "
        "every rank; set num_workers=1 (a divisor of a rank's 3 data sources), or give each rank a multiple "
        "of 2 data sources"
    ]
    assert _probed(2, 3, n=120, shards=3, ranks=2) == []
    assert _probed(2, 2, n=120, shards=4, ranks=2) == []  # 2 sources a rank: one a worker


@pytest.mark.usefixtures("hf")
def test_an_hf_stream_whose_shards_do_not_divide_among_the_ranks_is_split_by_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parts = _parts(hf_numbers(120, 3), 2, 0, monkeypatch)  # HF's own shard(2, r) would give 80 and 40
    assert [len(p) for p in parts] == [60, 60]
    assert sorted(parts[0] + parts[1]) == list(range(120))


@pytest.mark.usefixtures("hf")
def test_a_shuffled_hf_stream_under_dataloader_workers_is_refused_naming_num_workers() -> None:
    assert _probed(1, 2, n=48, shards=4, shuffle=True) == [
        "num_workers=2: task.train_data (IterableDataset) is shuffled, and HF's state of a shuffled stream "
        "taken in a DataLoader worker does not load back (an IndexError in its load_state_dict), so no "
        "checkpoint of this run could be resumed; set num_workers=0"
    ]
    assert _probed(1, 0, n=48, shards=4, shuffle=True) == []
    assert _probed(1, 2, n=48, shards=4) == []
