"""The device side of the data plane: prefetch on a side stream, depth re-sizing, the device sample pool.

Skipped without CUDA; run on a GPU machine with `python -m pytest tests/unit/test_gpu_data.py -m gpu`. What
starts processes (DataLoader workers, a run) is in tests/runs/test_gpu_data.py.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from flodl.config.schema import FlodlConfig
from flodl.data.feeder import BatchFeeder
from flodl.data.npy import NpyFolderDataSet, write_npy_folder
from flodl.data.partition import epoch_permutation
from flodl.job.settings import data_plane_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SAMPLES = 512
BATCH = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> NpyFolderDataSet:
    rng = np.random.default_rng(0)
    folder = write_npy_folder(
        tmp_path_factory.mktemp("npy"),
        {"x": rng.normal(size=(SAMPLES, 8, 8)).astype(np.float32), "y": np.arange(SAMPLES)},
    )
    return NpyFolderDataSet(folder)


def feeder_for(dataset: NpyFolderDataSet, **changes: object) -> BatchFeeder:
    cfg = FlodlConfig(batch_size=BATCH, seed=1)
    for key, value in changes.items():
        setattr(cfg, key, value)
    settings = data_plane_settings(cfg, ranks_on_host=1)
    return BatchFeeder(settings, dataset, torch.device("cuda"))  # no index: the feeder names it


def run_chunk(feeder: BatchFeeder, dataset: NpyFolderDataSet, epoch: int) -> None:
    """Advise one epoch as one chunk, load every batch, and check it against the source."""
    picks = epoch_permutation(SAMPLES, 1, epoch)
    feeder.advise(epoch, picks)
    for b in range(SAMPLES // BATCH):
        chunk = picks[b * BATCH : (b + 1) * BATCH]
        batch = feeder.load(chunk, epoch)
        # A step-like consumer on the compute stream: it must see the finished copy.
        total = batch[0].sum() + batch[1].sum()
        want = dataset.get_batch(chunk)
        assert batch[0].device.type == "cuda"
        assert torch.equal(batch[0].cpu(), want[0]) and torch.equal(batch[1].cpu(), want[1])
        assert torch.isfinite(total)


def test_first_chunk_is_synchronous_then_prefetch_depth_is_sized_from_vram(dataset):
    feeder = feeder_for(dataset, vram_pool=False)
    try:
        assert feeder.side is not None and feeder.side != torch.cuda.current_stream()
        run_chunk(feeder, dataset, 0)
        assert feeder.prefetcher is not None and feeder.prefetcher.depth == 0  # calibration chunk
        assert feeder.batch_bytes == BATCH * (64 * 4 + 8)
        picks = epoch_permutation(SAMPLES, 1, 1)
        feeder.advise(1, picks)
        depth = feeder.prefetcher.depth
        assert 0 < depth <= SAMPLES // BATCH  # capped at the chunk's batches
        assert feeder.activation is not None
        deadline = time.monotonic() + 10
        while len(feeder.prefetcher._ready) < min(depth, 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        ready = list(feeder.prefetcher._ready.values())
        assert ready, "the prefetch thread assembled nothing ahead"
        batch, event = ready[0]
        assert isinstance(event, torch.cuda.Event)
        assert all(t.device.type == "cuda" for t in batch)
        for b in range(SAMPLES // BATCH):
            chunk = picks[b * BATCH : (b + 1) * BATCH]
            got = feeder.load(chunk, 1)
            assert torch.equal(got[1].cpu(), chunk)
        # A tighter VRAM budget at the next advice re-sizes the queue.
        feeder.settings = dataclasses.replace(feeder.settings, vram_max_usage=0.5)
        free, total = torch.cuda.mem_get_info()
        feeder.advise(2, epoch_permutation(SAMPLES, 1, 2))
        if total - free > total * 0.5:
            assert feeder.prefetcher.depth == 0
        else:
            assert feeder.prefetcher.depth > 0
    finally:
        feeder.close()


def test_uploads_go_through_pinned_host_memory(dataset):
    feeder = feeder_for(dataset, vram_pool=False)
    try:
        host = dataset.get_batch(torch.arange(BATCH))
        with torch.cuda.stream(feeder.side):
            uploaded = feeder._upload(host)
        torch.cuda.current_stream().wait_stream(feeder.side)
        assert all(torch.equal(u.cpu(), h) for u, h in zip(uploaded, host, strict=True))
        stats = getattr(torch.cuda, "host_memory_stats", None)
        if stats is not None:
            assert stats().get("allocations.current", stats().get("num_host_alloc", 1)) >= 1
    finally:
        feeder.close()


def test_device_pool_serves_hits_on_the_device(dataset):
    feeder = feeder_for(dataset, vram_pool=True)
    try:
        run_chunk(feeder, dataset, 0)
        assert feeder.pool is None  # decided after calibration
        run_chunk(feeder, dataset, 1)  # the advice decides the pool; this epoch's uploads fill it
        assert feeder.pool is not None and len(feeder.pool) == SAMPLES
        before = feeder.stats.totals["hits_vram"]
        run_chunk(feeder, dataset, 2)
        assert feeder.stats.totals["hits_vram"] - before == SAMPLES  # every row gathered on the device
    finally:
        feeder.close()


def test_device_pool_switch(dataset):
    feeder = feeder_for(dataset, vram_pool=False)
    try:
        for epoch in range(3):
            run_chunk(feeder, dataset, epoch)
        assert feeder.pool is None and feeder.stats.totals["hits_vram"] == 0
    finally:
        feeder.close()
