"""The device side of the data plane where it starts processes: a one-GPU run through the disk tier (the CLI)
and a map-style dataset's DataLoader workers feeding the device (skipped without CUDA; the rest of the data
plane on a GPU is tests/unit/test_gpu_data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flodl.config.schema import FlodlConfig
from flodl.data.partition import epoch_permutation
from flodl.data.sample_feed import SampleFeeder
from flodl.job.settings import data_plane_settings
from tests.helpers.byo_data import dict_collate
from tests.helpers.procs import train
from tests.helpers.runs import only_run_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiproc,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SAMPLES = 512
BATCH = 32


def test_one_gpu_run_with_the_disk_tier(tmp_path: Path) -> None:
    train(
        "task=npy_blobs",
        "disk_stage_gb=1",
        f"disk_stage_dir={tmp_path}",
        "ram_max_usage=0.0000001",
        "epochs=2",
        f"+task.train_data.folder={tmp_path / 'data'}",
        "+task.train_data.samples=3000",
        f"+task.eval_data.folder={tmp_path / 'data'}",
        "+task.eval_data.samples=3000",
        cwd=tmp_path,
    ).check()
    assert "flodl-stage-" in (only_run_dir(tmp_path / "outputs") / "rank0.log").read_text()
    assert not list(tmp_path.glob("*.pack"))


def test_map_style_dict_batches_from_pinned_workers_arrive_on_the_device_exactly() -> None:
    class Points(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int) -> dict:
            return {"x": torch.full((8,), float(i)), "y": i, "name": f"s{i}", "meta": {"weight": 0.5}}

    data = Points()
    feeder = SampleFeeder(
        data_plane_settings(FlodlConfig(batch_size=BATCH, seed=1, num_workers=2), ranks_on_host=1),
        data,
        torch.device("cuda"),
        dict_collate,
    )
    try:
        for epoch in range(2):
            picks = epoch_permutation(SAMPLES, 1, epoch)
            feeder.advise(epoch, picks)
            for b in range(SAMPLES // BATCH):
                chunk = picks[b * BATCH : (b + 1) * BATCH]
                batch = feeder.load(chunk, epoch)
                total = batch["x"].sum() + batch["weight"].sum()  # a consumer on the compute stream
                want = dict_collate([data[i] for i in chunk.tolist()])
                assert batch["x"].device.type == "cuda" and batch["y"].device.type == "cuda"
                assert torch.equal(batch["x"].cpu(), want["x"]) and torch.equal(batch["y"].cpu(), want["y"])
                assert batch["names"] == want["names"] and torch.isfinite(total)
    finally:
        feeder.close()
