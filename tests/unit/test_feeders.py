"""The data plane chosen once for the train data (flodl/data/feeders.py), and a rank's checkpoint asking the
feeder, not its type: a stream's reader positions go in and come back; a checkpoint of other data is refused,
either way, naming what to do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.utils.data import default_collate

from flodl.config.schema import register_configs, to_config
from flodl.data.dataset import TensorDataSet
from flodl.data.feeder import BatchFeeder
from flodl.data.feeders import feeder_for
from flodl.data.sample_feed import SampleFeeder
from flodl.data.stream import StreamFeeder
from flodl.job.settings import data_plane_settings
from flodl.launcher.run_dir import register_resolvers
from tests.helpers.procs import CONF

CPU = torch.device("cpu")


def settings() -> Any:
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_config(compose(config_name="config", overrides=["batch_size=4", "debug.stager=false"]))
    return data_plane_settings(cfg, 1)


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(i)])}


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter({"x": torch.tensor([float(i)])} for i in range(64))


def test_each_kind_of_data_gets_its_feeder_and_says_whether_it_reads_in_order() -> None:
    data = settings()
    batches = feeder_for(data, TensorDataSet(torch.arange(16.0)), CPU, default_collate)
    samples = feeder_for(data, Points(), CPU, default_collate, cacheable=False)
    stream = feeder_for(data, Counting(), CPU, default_collate)
    try:
        assert isinstance(batches, BatchFeeder) and not batches.in_order and batches.state() is None
        assert isinstance(samples, SampleFeeder) and not samples.in_order and samples.state() is None
        assert isinstance(stream, StreamFeeder) and stream.in_order
        picks = torch.arange(4)
        assert stream.load(picks, 0)["x"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert stream.state() is not None and stream.state()["taken"] == 1
    finally:
        for feeder in (batches, samples, stream):
            feeder.close()


def test_a_stream_checkpoint_is_refused_by_other_data_and_the_other_way_round() -> None:
    from flodl.worker.rank_state import _restore_readers

    data = settings()
    stream = feeder_for(data, Counting(), CPU, default_collate)
    positions = stream.state()
    assert positions is not None
    samples = feeder_for(data, Points(), CPU, default_collate, cacheable=False)

    class Holder:
        def __init__(self, feeder: Any) -> None:
            self.feeder = feeder

    try:
        with pytest.raises(ValueError, match=r"was a stream .* resume=never"):
            _restore_readers(Holder(samples), positions)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"was no stream .* resume=never"):
            _restore_readers(Holder(stream), None)  # type: ignore[arg-type]
        _restore_readers(Holder(stream), positions)  # type: ignore[arg-type]
        _restore_readers(Holder(samples), None)  # type: ignore[arg-type]
    finally:
        stream.close()
        samples.close()
