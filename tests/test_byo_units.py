"""Samples of any structure through the data plane of a map-style Dataset, in one process: the batches
follow the read plan whatever num_workers is (real DataLoader workers), pack records keep nested samples
exactly, a cacheable dataset is read from its source once, and bad data keys fail naming the key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, default_collate

from flodl.config.schema import FlodlConfig, to_config
from flodl.config.targets import task_target_problems
from flodl.data.feeder import DataPlaneSettings
from flodl.data.pack import PackFile, decode, encode
from flodl.data.partition import epoch_permutation
from flodl.data.sample import check_movable, flatten, same, to_device
from flodl.data.sample_feed import SampleFeeder
from flodl.job.settings import data_plane_settings, task_settings
from tests.helpers.byo_data import dict_collate
from tests.helpers.procs import CONF


class Indexed(Dataset):
    """Deterministic dict samples that say which index they are; counts its reads (in this process)."""

    def __init__(self, n: int = 40) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads += 1
        x = torch.full((3,), float(i))
        return {"x": x, "y": i % 2, "name": f"s{i}", "meta": {"weight": 1.0 + i}}


def _settings(**changes: Any) -> DataPlaneSettings:
    """A one-rank run's data plane settings: batches of 4, and these keys."""
    cfg = FlodlConfig(batch_size=4, seed=0, **changes)
    return data_plane_settings(cfg, ranks_on_host=1)


def _feeder(data: Any, settings: DataPlaneSettings, tiers: Any = None) -> SampleFeeder:
    return SampleFeeder(settings, data, torch.device("cpu"), dict_collate, tiers)


def _epoch(feeder: SampleFeeder, epoch: int, n: int) -> list[dict[str, Any]]:
    """Advise an epoch in three slices (so the loader's iterations restart) and load every batch."""
    picks = epoch_permutation(n, 0, epoch)
    for lo, hi in ((0, 8), (8, 24), (24, n)):
        feeder.advise(epoch, picks[lo:hi])
    return [feeder.load(picks[b : b + 4], epoch) for b in range(0, n, 4)]


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.multiproc
def test_worker_processes_give_the_plans_batches_in_order(persistent: bool):
    data = Indexed()
    expected = [
        dict_collate([data[int(i)] for i in epoch_permutation(40, 0, e)[b : b + 4]])
        for e in (0, 1)
        for b in range(0, 40, 4)
    ]
    in_workers = Indexed()
    plain = _feeder(data, _settings(num_workers=0))
    workers = _feeder(in_workers, _settings(num_workers=2, prefetch_factor=2, persistent_workers=persistent))
    try:
        for feeder in (plain, workers):
            got = _epoch(feeder, 0, 40) + _epoch(feeder, 1, 40)
            assert len(got) == len(expected)
            for a, b in zip(got, expected, strict=True):
                assert same(a, b), (a["names"], b["names"])
        assert in_workers.reads == 0  # every read ran in a worker process, none in this one
    finally:
        plain.close()
        workers.close()


@pytest.mark.multiproc
def test_a_skipped_to_batch_is_read_by_the_workers_and_one_outside_the_plan_in_process():
    data = Indexed()
    feeder = _feeder(data, _settings(num_workers=2))
    try:
        picks = epoch_permutation(40, 0, 0)
        feeder.advise(0, picks)
        feeder.load(picks[:4], 0)
        skipped = feeder.load(picks[32:36], 0)  # the worker jumped past the prefetch depth
        stray = torch.tensor([3, 1, 4, 1])
        unplanned = feeder.load(stray, 0)
        assert skipped["names"] == [f"s{i}" for i in picks[32:36].tolist()]
        assert unplanned["names"] == ["s3", "s1", "s4", "s1"]
        assert data.reads == 4  # only the batch outside the plan was read in this process
    finally:
        feeder.close()


def test_a_cacheable_dataset_is_read_from_its_source_once_and_served_from_disk(tmp_path):
    data = Indexed()
    pack = PackFile(tmp_path, 1 << 20)
    feeder = _feeder(data, _settings(), (None, pack))
    try:
        first = _epoch(feeder, 0, 40)
        assert data.reads == 40 and len(pack.samples()) == 40
        second = _epoch(feeder, 1, 40)
        assert data.reads == 40  # the second epoch came from the pack, dicts and strings included
        assert sorted(n for b in second for n in b["names"]) == sorted(n for b in first for n in b["names"])
        assert all(b["x"][:, 0].tolist() == [float(n[1:]) for n in b["names"]] for b in second)
    finally:
        feeder.close()


def test_pack_records_keep_nested_samples_exactly():
    sample = {
        "ids": torch.arange(5, dtype=torch.int32),
        "pixels": torch.rand(2, 3).to(torch.bfloat16),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "pair": (1, 2.5),
        "tags": ["a", "b", None, True],
        "nested": {"n": 7, 3: "three", "empty": []},
    }
    back = decode(bytearray(encode(9, sample)), 9)
    assert same(back, sample)
    assert (
        type(back["pair"]) is tuple and type(back["tags"]) is list and isinstance(back["array"], np.ndarray)
    )
    assert back["nested"][3] == "three" and back["pair"][0] == 1 and isinstance(back["pair"][1], float)
    rows = [torch.arange(4.0), torch.tensor(3)]  # a BatchDataSet's sample: the list of its field rows
    assert same(decode(bytearray(encode(1, rows)), 1), rows)


def test_a_value_a_record_cannot_hold_is_named_with_its_path():
    with pytest.raises(TypeError, match=r"sample\['meta'\]\[1\]: a builtins.set cannot be staged on disk"):
        flatten({"meta": [1, {2}]})


def test_a_batch_value_that_cannot_move_to_a_device_is_named_with_the_batch_structure():
    class Image:
        pass

    class Encoding:  # moves itself, as a tokenizer's BatchEncoding does
        def to(self, device: torch.device) -> str:
            return f"moved to {device}"

    batch = default_collate([{"x": torch.zeros(2), "label": 1}] * 2) | {
        "names": ["a", "b"],
        "enc": Encoding(),
    }
    check_movable(batch, "task.train_data")
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["names"] == ["a", "b"] and moved["enc"] == "moved to meta"
    with pytest.raises(TypeError) as info:
        check_movable({"x": torch.zeros(2, 2), "img": [Image(), Image()]}, "task.train_data")
    message = str(info.value)
    assert message.startswith("task.train_data: a batch holds a tests.test_byo_units")
    assert "dict{x: Tensor(float32, [2, 2]), img: list[" in message and "task.collate_fn" in message


def test_the_first_batch_names_a_value_that_cannot_move_to_the_device():
    class Handle:
        pass

    class WithHandles(Indexed):
        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": torch.zeros(2), "handle": Handle()}

    def keep_handles(samples: list[dict[str, Any]]) -> dict[str, Any]:
        return {"x": torch.stack([s["x"] for s in samples]), "handles": [s["handle"] for s in samples]}

    feeder = SampleFeeder(_settings(), WithHandles(), torch.device("cpu"), keep_handles)
    try:
        picks = epoch_permutation(40, 0, 0)
        feeder.advise(0, picks)
        with pytest.raises(
            TypeError, match=r"task\.train_data: a batch holds a .*Handle, which cannot be moved"
        ):
            feeder.load(picks[:4], 0)
    finally:
        feeder.close()


def _typed(**task: Any) -> FlodlConfig:
    base = {"name": "t", "model": {"_target_": "tests.helpers.byo_data.linear"}, "loss": {}, "optimizer": {}}
    return to_config({"task": base | task})


def test_task_targets_that_do_not_import_are_refused_before_the_ranks_start():
    cfg = _typed(
        train_data={"_target_": "tests.helpers.byo_data.NoisyPoints"},
        collate_fn={"_target_": "mypkg.collate", "_partial_": True},
        eval_data={"_target_": "tests.helpers.byo_data.NoSuchSet"},
    )
    problems = task_target_problems(cfg)
    assert len(problems) == 2, problems
    assert problems[0].startswith(
        "task.eval_data._target_='tests.helpers.byo_data.NoSuchSet': does not import"
    )
    assert problems[1].startswith("task.collate_fn._target_='mypkg.collate': does not import")
    assert "No module named 'mypkg'" in problems[1]


def test_a_collate_function_without_partial_and_loader_keys_on_a_batch_dataset_are_refused():
    cfg = _typed(
        train_data={"_target_": "flodl.data.npy.NpyFolderDataSet", "folder": "/nowhere"},
        collate_fn={"_target_": "tests.helpers.byo_data.dict_collate"},
    )
    cfg.num_workers = 2
    problems = task_target_problems(cfg)
    assert any(
        p.startswith("task.collate_fn._target_='tests.helpers.byo_data.dict_collate': is a function")
        for p in problems
    )
    assert any(
        p.startswith("num_workers=2: task.train_data is a BatchDataSet (NpyFolderDataSet)") for p in problems
    )
    assert any(p.startswith("task.collate_fn={") and "remove collate_fn" in p for p in problems)


def test_a_factory_that_returns_a_batch_dataset_refuses_loader_keys_when_the_rank_builds_it():
    import yaml

    from flodl.worker.task_setup import build_task

    digits = yaml.safe_load((CONF / "task" / "digits.yaml").read_text())
    cfg = to_config(
        {**{k: v for k, v in digits.items() if k != "task"}, "task": digits["task"], "num_workers": 2}
    )
    assert (
        task_target_problems(cfg) == []
    )  # a factory function: its dataset's kind is unknown before it is built
    with pytest.raises(
        ValueError, match=r"num_workers=2: task.train_data is a BatchDataSet \(TensorDataSet\)"
    ):
        build_task(task_settings(cfg), torch.device("cpu"), 1)
