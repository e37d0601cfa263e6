"""A stream (an IterableDataset) as training data, in one process (flodl/data/stream.py): each reader reads
its own part (what the stream gives it when it splits itself, the dataset's `shard` of its rank, every
R-th item of the whole stream; flodl/data/stream_split.py decides, from webdataset's real pipeline stages or
task.stream_split, and refuses a split twice), a shard that runs out starts again as the next pass, a reader
resumed from its position goes on with the next item (by skipping, or by the dataset's own `state_dict`),
and a rank's feeder takes its DataLoader workers' batches in turn (real workers), the same after a resume
as without one."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from flodl.config.schema import FlodlConfig
from flodl.data.stream import ShardReader, StreamFeeder, epoch_picks, stream_picks
from flodl.data.stream_split import StreamSplit, decide
from flodl.preflight.task_probe import task_problems
from tests.helpers.byo_data import write_point_shards
from tests.helpers.stream_feeds import SEED, fed_ids, stream_feeder

# What auto decides for a stream that shows no split of its own: flodl splits it all.
FLODL = StreamSplit(False, False, "flodl splits it")


class Numbers(IterableDataset):
    """Items 0 .. n-1 in order (reversed in odd passes once `set_epoch` says so), each with a draw from
    torch's global generator; counts the items it yielded (in this process)."""

    def __init__(self, n: int = 40, items: list[int] | None = None) -> None:
        self.items = items if items is not None else list(range(n))
        self.epoch = 0
        self.yielded = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[int, float]]:
        for i in reversed(self.items) if self.epoch % 2 else self.items:
            self.yielded += 1
            yield i, float(torch.rand(()))


class Sharded(Numbers):
    """Declares `shard(num_shards, index)`: contiguous blocks, as HF's `IterableDataset.shard` gives."""

    def shard(self, num_shards: int, index: int) -> Numbers:
        size = -(-len(self.items) // num_shards)
        return type(self)(items=self.items[index * size : (index + 1) * size])


class WorkerSplit(Sharded):
    """Also splits itself among DataLoader workers (`get_worker_info()`), which flodl cannot see: it says so
    with task.stream_split=workers."""

    def __iter__(self) -> Iterator[tuple[int, float]]:
        info = get_worker_info()
        items = self.items if info is None else self.items[info.id :: info.num_workers]
        for i in items:
            yield i, float(torch.rand(()))


class Stateful(Numbers):
    """Keeps its own place: `state_dict` / `load_state_dict`, as HF's (>= 2.18) and torchdata's do."""

    def __init__(self, n: int = 40) -> None:
        super().__init__(n)
        self.at = 0

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]

    def __iter__(self) -> Iterator[tuple[int, float]]:
        while self.at < len(self.items):
            self.at += 1
            self.yielded += 1
            yield self.items[self.at - 1], float(torch.rand(()))
        self.at = 0


def _ids(items: list[tuple[int, float]]) -> list[int]:
    return [i for i, _ in items]


@pytest.mark.parametrize("kind", [Numbers, Sharded])
def test_readers_read_disjoint_shards_that_together_are_the_stream(kind: type[Numbers]) -> None:
    readers = [ShardReader(kind(40), 4, r, SEED, FLODL) for r in range(4)]
    shards = [_ids(reader.take(10)) for reader in readers]
    assert sorted(i for shard in shards for i in shard) == list(range(40))
    if kind is Numbers:  # read whole by every reader, each keeping every 4th item
        assert shards[1] == list(range(1, 40, 4))
    else:  # the dataset's own shards
        assert shards[1] == list(range(10, 20))
    assert all(reader.position()["passes"] == 0 for reader in readers)


def test_a_shard_that_runs_out_starts_again_as_the_next_pass_after_set_epoch() -> None:
    reader = ShardReader(Sharded(12), 2, 1, SEED, FLODL)  # items 6 .. 11
    assert _ids(reader.take(8)) == [6, 7, 8, 9, 10, 11, 11, 10]  # pass 1 is reversed: set_epoch(1)
    assert reader.position() == {"passes": 1, "seen": 2, "state": None}


@pytest.mark.parametrize("kind", [Numbers, Sharded, Stateful])
def test_a_reader_resumed_at_its_position_reads_what_it_would_have_read(kind: type[Numbers]) -> None:
    whole = ShardReader(kind(30), 3, 2, SEED, FLODL)
    expected = [whole.take(4) for _ in range(6)]  # across a pass
    first = ShardReader(kind(30), 3, 2, SEED, FLODL)
    before = [first.take(4) for _ in range(3)]
    position = first.position()
    dataset = kind(30)
    resumed = ShardReader(dataset, 3, 2, SEED, FLODL, position)
    assert before + [resumed.take(4) for _ in range(3)] == expected  # the items and their draws
    if kind is Stateful:  # the dataset's own state: nothing read before the position again
        assert position["state"] is not None
        # The rest of the pass it stood in, then the next pass's first 4 kept items (of every 3rd).
        assert dataset.yielded == (30 - position["seen"]) + 12


def test_reading_does_not_move_the_callers_random_streams() -> None:
    torch.manual_seed(0)
    random.seed(0)
    ShardReader(Numbers(), 1, 0, SEED, FLODL).take(5)
    drawn = float(torch.rand(())), random.random()
    torch.manual_seed(0)
    random.seed(0)
    assert drawn == (float(torch.rand(())), random.random())


def test_an_empty_shard_and_a_stream_shorter_than_its_position_are_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"reader 3 of 4 found no item in its part \(the whole stream, keeping items 3, 3 \+ 4",
    ):
        ShardReader(Numbers(3), 4, 3, SEED, FLODL).take(1)
    with pytest.raises(ValueError, match=r"was 20 items into pass 0 of its shard, which now has 10"):
        ShardReader(Numbers(10), 1, 0, SEED, FLODL, {"passes": 0, "seen": 20, "state": None}).take(1)


def _feeder(
    rank: int,
    world: int,
    workers: int,
    state: dict[str, Any] | None = None,
    kind: type[Numbers] = Numbers,
    split: str = "auto",
    dataset: Any = None,
) -> StreamFeeder:
    feeder = stream_feeder(rank, world, workers, dataset if dataset is not None else kind(200), split)
    if state is not None:
        feeder.restore(state)
    return feeder


@pytest.mark.parametrize(("kind", "split"), [(Numbers, "auto"), (Sharded, "auto"), (WorkerSplit, "workers")])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.multiproc
def test_a_rank_takes_its_readers_batches_in_turn_and_so_does_it_after_a_resume(
    workers: int, kind: type[Numbers], split: str
) -> None:
    whole = fed_ids(_feeder(1, 2, workers, kind=kind, split=split), 9)
    # Rank 1 of 2: its readers are 2 and 3 of 4 with workers (1 of 2 without); Numbers' keep every R-th
    # item; Sharded's read the rank's shard, items 100 .. 199, every other item of it a worker's; the
    # shard splits itself between WorkerSplit's workers (task.stream_split=workers), none split again.
    expected = {
        (Numbers, 2): [[2, 6, 10], [3, 7, 11], [14, 18, 22]],
        (Numbers, 0): [[1, 3, 5], [7, 9, 11], [13, 15, 17]],
        (Sharded, 2): [[100, 102, 104], [101, 103, 105], [106, 108, 110]],
        (Sharded, 0): [[100, 101, 102], [103, 104, 105], [106, 107, 108]],
        (WorkerSplit, 2): [[100, 102, 104], [101, 103, 105], [106, 108, 110]],
        (WorkerSplit, 0): [[100, 101, 102], [103, 104, 105], [106, 107, 108]],
    }
    assert whole[:3] == expected[kind, workers]
    first = _feeder(1, 2, workers, kind=kind, split=split)
    before = fed_ids(first, 5)  # an odd count: the second reader's turn is next
    state = first.state()
    first.close()
    assert before + fed_ids(_feeder(1, 2, workers, state, kind, split), 4) == whole


def test_a_resume_with_other_readers_is_refused() -> None:
    state = _feeder(0, 2, 2).state()
    with pytest.raises(
        ValueError, match=r"of 4 readers, this run has 2 \(world_size x max\(num_workers, 1\)\)"
    ):
        _feeder(0, 2, 0, state)


def test_a_streams_epoch_is_every_ranks_steps() -> None:
    assert stream_picks(5, 3, 8) == 120
    assert epoch_picks(Numbers(), 1, 5, 3, 8) == 120
    assert epoch_picks(list(range(10)), 2, None, 3, 8) == 20


def _webdataset(wds: Any, folder: Path, **splitters: Any) -> Any:
    """The points as 8 real webdataset shards of 6 (ids 0 .. 47), read as its users write it."""
    write_point_shards(folder, 48, 8)
    urls = sorted(str(p) for p in folder.glob("*.tar"))
    return wds.WebDataset(urls, shardshuffle=False, **splitters).decode().to_tuple("id.cls", "x.npy")


@pytest.mark.parametrize("by_node", [True, False], ids=["split_by_node", "none"])
@pytest.mark.multiproc
def test_a_webdataset_that_splits_itself_is_not_split_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wds: Any, by_node: bool
) -> None:
    # 2 ranks (as flodl's ranks have it: RANK and WORLD_SIZE set, which its DataLoader workers inherit) of 2
    # real workers: webdataset splits the shards among the workers (its default split_by_worker) and, with
    # split_by_node, among the ranks; flodl keeps every world_size-th item of a worker's part without it.
    dataset = _webdataset(wds, tmp_path, nodesplitter=wds.split_by_node if by_node else None)
    trained = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        feeder = _feeder(rank, 2, 2, dataset=dataset)
        assert feeder.split.ranks == by_node and feeder.split.workers
        trained += [i for batch in fed_ids(feeder, 8) for i in batch]  # 24 items a rank
        feeder.close()
    assert sorted(trained) == list(range(48))


def test_a_split_twice_or_a_webdataset_that_refuses_several_ranks_is_named(tmp_path: Path, wds: Any) -> None:
    dataset = _webdataset(wds, tmp_path, nodesplitter=wds.split_by_node)
    with pytest.raises(
        ValueError,
        match=r"task.stream_split=flodl: WebDataset splits itself among the ranks "
        r"and workers \(its pipeline's split_by_node and split_by_worker\)",
    ):
        decide(dataset, "flodl", 2)
    with pytest.raises(ValueError, match=r"task.stream_split=ranks: .* among the workers"):
        decide(dataset, "ranks", 2)
    assert decide(dataset, "dataset", 2) == StreamSplit(True, True, "task.stream_split=dataset")
    single = _webdataset(wds, tmp_path)  # webdataset's default nodesplitter, single_node_only
    assert decide(single, "auto", 1) == StreamSplit(False, True, "its pipeline's split_by_worker")
    with pytest.raises(
        ValueError,
        match=r"single_node_only .* refuses several ranks: build it with "
        r"nodesplitter=wds.split_by_node",
    ):
        decide(single, "auto", 2)
    # A stream flodl cannot see into splits nothing unless the key says it does.
    assert decide(Numbers(), "auto", 2) == StreamSplit(False, False, "flodl sees no split of its own in it")
    assert decide(WorkerSplit(), "workers", 2).workers


@pytest.mark.usefixtures("wds")
def test_the_split_is_checked_before_any_rank(tmp_path: Path) -> None:
    write_point_shards(tmp_path, 48, 8)
    cfg = FlodlConfig(batch_size=4, steps_per_epoch=2)
    cfg.task.stream_split = "flodl"
    task = {
        "model": {"_target_": "tests.helpers.byo_data.linear"},
        "train_data": {"_target_": "tests.helpers.byo_data.point_webdataset", "folder": str(tmp_path)},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
        "stream_split": "flodl",
    }
    problems = task_problems(cfg, task, 2)
    assert [p for p in problems if p.startswith("task.stream_split=flodl: WebDataset splits itself")], (
        problems
    )
