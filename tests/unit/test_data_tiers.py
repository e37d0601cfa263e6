"""The staging tiers and the feeder on real files: the same batches as the source, whatever tier serves."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from flodl.config.schema import FlodlConfig, TaskConfig
from flodl.data.augment import gaussian_jitter
from flodl.data.dataset import TensorDataSet, check_purity
from flodl.data.feeder import BatchFeeder, DataPlaneSettings, StagingBudgets, staging_budgets
from flodl.data.npy import NpyFolderDataSet, write_npy_folder
from flodl.data.pack import PackFile
from flodl.data.partition import epoch_permutation
from flodl.job.settings import data_plane_settings, task_settings
from flodl.worker.task_setup import build_task

CPU = torch.device("cpu")
SAMPLES = 600
BATCH = 32
SAMPLE_BYTES = 16 * 4 + 8  # float32[16] + int64


@pytest.fixture(scope="module")
def npy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(0)
    return write_npy_folder(
        tmp_path_factory.mktemp("npy") / "data",
        {"x": rng.normal(size=(SAMPLES, 16)).astype(np.float32), "y": np.arange(SAMPLES)},
    )


def config(stager: bool = True, data_plane: bool = True, **changes: object) -> DataPlaneSettings:
    """A one-rank run's data plane settings for these keys (`stager`, `data_plane`: the debug.* switches)."""
    cfg = FlodlConfig(batch_size=BATCH, seed=3)
    cfg.debug.stager, cfg.debug.data_plane = stager, data_plane
    for key, value in changes.items():
        setattr(cfg, key, value)
    return data_plane_settings(cfg, ranks_on_host=1)


def ram_fraction_for(samples: int) -> float:
    """ram_max_usage giving a RAM tier of about `samples` samples on this machine."""
    from flodl.config.host import available_ram

    return samples * SAMPLE_BYTES / available_ram()


def epochs_of(feeder: BatchFeeder, epochs: int, total: int, augment: int = 1) -> list[list[torch.Tensor]]:
    """Advise and load every batch of `epochs` epochs, like a one-rank worker."""
    batches = []
    for epoch in range(epochs):
        picks = epoch_permutation(total * augment, 3, epoch)
        feeder.advise(epoch, picks)
        for b in range(len(picks) // BATCH):
            batches.append(feeder.load(picks[b * BATCH : (b + 1) * BATCH], epoch))
    return batches


def reference(dataset: NpyFolderDataSet, epochs: int) -> list[list[torch.Tensor]]:
    out = []
    for epoch in range(epochs):
        picks = epoch_permutation(len(dataset), 3, epoch)
        out += [dataset.get_batch(picks[b * BATCH : (b + 1) * BATCH]) for b in range(len(picks) // BATCH)]
    return out


def assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_data_larger_than_the_ram_budget_spills_to_disk_and_batches_are_unchanged(npy_folder, tmp_path):
    dataset = NpyFolderDataSet(npy_folder)
    cfg = config(ram_max_usage=ram_fraction_for(50), disk_stage_gb=1.0, disk_stage_dir=str(tmp_path))
    feeder = BatchFeeder(cfg, dataset, CPU)
    try:
        assert feeder.tiers is not None and feeder.tiers.ram is not None
        assert feeder.tiers.ram.budget < SAMPLES * SAMPLE_BYTES  # the data does not fit the RAM tier
        assert_same(epochs_of(feeder, 3, SAMPLES), reference(dataset, 3))
        totals = feeder.stats.totals
        assert totals["hits_disk"] > 0 and totals["bytes_disk"] > 0
        assert totals["hits_ram"] > 0
        pack = feeder.tiers.pack
        assert pack is not None and pack.path.exists()
        assert len(pack.samples()) > SAMPLES // 2
    finally:
        feeder.close()
    assert not list(tmp_path.glob("*.pack"))


def test_flipped_bytes_in_a_pack_record_are_detected_and_the_batch_is_still_right(
    npy_folder, tmp_path, caplog
):
    dataset = NpyFolderDataSet(npy_folder)
    pack = PackFile(tmp_path, 1 << 20)
    samples = torch.arange(BATCH)
    for s, (x, y) in enumerate(zip(*dataset.get_batch(samples), strict=True)):
        assert pack.put(s, [x, y])
    offset, length = pack.record_span(5)
    with open(pack.path, "r+b") as f:
        f.seek(offset + length - 12)
        f.write(b"\xde\xad\xbe\xef")
    assert pack.get(6) is not None and pack.get(5) is None  # detected, dropped
    offset, length = pack.record_span(9)
    with open(pack.path, "r+b") as f:
        f.seek(offset + 20)
        f.write(b"\xff\xff")
    from flodl.data.tiers import FeedStats, TieredSource

    tiers = TieredSource(dataset, None, pack, FeedStats())
    with caplog.at_level(logging.WARNING):
        got = tiers.fetch(samples)
    assert all(torch.equal(a, b) for a, b in zip(got, dataset.get_batch(samples), strict=True))
    assert pack.corrupt == 2
    assert "record of sample 5 failed its checksum" in caplog.text  # the first, in the summary line
    assert tiers.stats.totals["source_reads"] == 2  # 5 and 9, read again
    assert 9 in pack.samples()  # and re-admitted
    pack.close()
    assert not pack.path.exists()


def test_a_corrupted_pack_prints_a_bounded_number_of_warnings(npy_folder, tmp_path, caplog):
    """Every record corrupt (17,987 WARNING lines seen once): the count and the first example, a few lines."""
    dataset = NpyFolderDataSet(npy_folder)
    pack = PackFile(tmp_path, 1 << 20)
    rows = list(zip(*dataset.get_batch(torch.arange(BATCH)), strict=True))
    with caplog.at_level(logging.WARNING):
        for _ in range(40):  # every record put and corrupted again: 40 x BATCH checksum failures
            for s, (x, y) in enumerate(rows):
                assert pack.put(s, [x, y])
            for s in range(BATCH):
                offset, length = pack.record_span(s)
                with open(pack.path, "r+b") as f:
                    f.seek(offset + length - 12)
                    f.write(b"\xde\xad\xbe\xef")
                assert pack.get(s) is None
    failures = 40 * BATCH
    assert pack.corrupt == failures
    lines = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
    assert 1 <= len(lines) <= len(str(failures)), lines  # one per power of ten
    assert "the first: record of sample 0 failed its checksum" in lines[0]
    assert lines[-1].startswith(f"disk stage: {10 ** (len(str(failures)) - 1)} record(s)")
    pack.close()


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_unwritable_stage_dir_turns_the_disk_tier_off_with_one_warning(npy_folder, tmp_path, caplog):
    dataset = NpyFolderDataSet(npy_folder)
    if os.geteuid() == 0:
        unwritable = "/proc"  # even root cannot create files there
    else:
        unwritable = str(tmp_path / "ro")
        os.mkdir(unwritable, 0o500)
    cfg = config(ram_max_usage=0.0, disk_stage_gb=1.0, disk_stage_dir=unwritable)
    with caplog.at_level(logging.WARNING):
        feeder = BatchFeeder(cfg, dataset, CPU)
        assert_same(epochs_of(feeder, 2, SAMPLES), reference(dataset, 2))
        feeder.close()
    assert len(warnings_of(caplog, "disk stage tier off")) == 1


def test_budgets_smaller_than_one_sample_warn_once_and_training_goes_on(npy_folder, tmp_path, caplog):
    dataset = NpyFolderDataSet(npy_folder)
    tiny = config(ram_max_usage=ram_fraction_for(0.5), disk_stage_gb=50 / 2**30, disk_stage_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        feeder = BatchFeeder(tiny, dataset, CPU)
        assert_same(epochs_of(feeder, 2, SAMPLES), reference(dataset, 2))
        feeder.close()
    assert len(warnings_of(caplog, "smaller than one sample")) == 2  # RAM once, disk once
    assert feeder.stats.totals["hits_ram"] == feeder.stats.totals["hits_disk"] == 0


def test_stager_switch_removes_the_tiers(npy_folder, tmp_path):
    dataset = NpyFolderDataSet(npy_folder)
    feeder = BatchFeeder(config(stager=False, disk_stage_gb=1.0, disk_stage_dir=str(tmp_path)), dataset, CPU)
    assert feeder.active and feeder.tiers is None and feeder.stager is None
    assert_same(epochs_of(feeder, 1, SAMPLES), reference(dataset, 1))
    assert feeder.stats.totals["source_reads"] == SAMPLES // BATCH * BATCH
    assert not list(tmp_path.glob("*.pack"))
    feeder.close()


def test_data_plane_switch_reads_each_batch_in_the_step(npy_folder, tmp_path):
    dataset = NpyFolderDataSet(npy_folder)
    feeder = BatchFeeder(
        config(data_plane=False, disk_stage_gb=1.0, disk_stage_dir=str(tmp_path)), dataset, CPU
    )
    assert not feeder.active and feeder.tiers is None and feeder.stager is None and feeder.prefetcher is None
    assert_same(epochs_of(feeder, 1, SAMPLES), reference(dataset, 1))
    assert not list(tmp_path.glob("*.pack"))
    feeder.close()


def test_a_batch_dataset_declared_uncacheable_is_read_from_its_source_every_epoch(npy_folder, tmp_path):
    dataset = NpyFolderDataSet(npy_folder)
    cfg = config(disk_stage_gb=1.0, disk_stage_dir=str(tmp_path))
    feeder = BatchFeeder(cfg, dataset, CPU, cacheable=False)
    assert feeder.tiers is None and feeder.stager is None
    assert_same(epochs_of(feeder, 2, SAMPLES), reference(dataset, 2))
    assert feeder.stats.totals["source_reads"] == 2 * (SAMPLES // BATCH * BATCH)
    assert not list(tmp_path.glob("*.pack"))
    feeder.close()


def test_staging_budgets_follow_the_switches_and_split_the_host_ram():
    settings = dataclasses.replace(config(ram_max_usage=0.5, disk_stage_gb=2.0), ranks_on_host=4)
    assert staging_budgets(settings, available=8 << 30) == StagingBudgets(
        1 << 30, 2 << 30
    )  # 50% of 8 GiB over 4 ranks
    assert (
        staging_budgets(dataclasses.replace(settings, ram_max_usage=1.0), 8 << 30).ram
        == int(0.9 * (8 << 30)) // 4
    )
    assert staging_budgets(dataclasses.replace(settings, sample_cache=False), 8 << 30) == StagingBudgets(
        None, 2 << 30
    )
    assert staging_budgets(dataclasses.replace(settings, disk_stage_bytes=0), 8 << 30).disk is None
    for off in ({"stager": False}, {"data_plane": False}):
        assert staging_budgets(dataclasses.replace(settings, **off), 8 << 30) == StagingBudgets(None, None)


def test_resident_data_bypasses_the_plane(npy_folder):
    dataset = NpyFolderDataSet(npy_folder)
    resident = TensorDataSet(*dataset.get_batch(torch.arange(SAMPLES)))
    feeder = BatchFeeder(config(), resident, CPU)
    assert not feeder.active and feeder.tiers is None and feeder.prefetcher is None
    assert_same(epochs_of(feeder, 1, SAMPLES), reference(dataset, 1))


def test_unadvised_and_skipped_batches_are_served_exactly(npy_folder):
    dataset = NpyFolderDataSet(npy_folder)
    feeder = BatchFeeder(config(), dataset, CPU)
    picks = epoch_permutation(SAMPLES, 3, 0)
    feeder.advise(0, picks)
    order = [0, 1, 4, 2, 5, 6]  # 2 and 3 skipped, then 2 asked for after all (no longer planned)
    for b in order:
        batch = feeder.load(picks[b * BATCH : (b + 1) * BATCH], 0)
        assert torch.equal(batch[1], torch.as_tensor(picks[b * BATCH : (b + 1) * BATCH]))
    stray = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(feeder.load(stray, 0)[1], stray)
    feeder.close()


def test_augment_views_are_deterministic_across_runs_ranks_and_tiers(npy_folder, tmp_path):
    dataset = NpyFolderDataSet(npy_folder)
    cfg = config(
        augment=2, ram_max_usage=ram_fraction_for(40), disk_stage_gb=1.0, disk_stage_dir=str(tmp_path)
    )
    total = SAMPLES * 2
    whole = BatchFeeder(cfg, dataset, CPU, transform=gaussian_jitter)
    picks = epoch_permutation(total, cfg.seed, 1)
    whole.advise(1, picks)
    one_rank = torch.cat([whole.load(picks[b * BATCH : (b + 1) * BATCH], 1)[0] for b in range(4)])
    whole.close()
    # Two ranks of another run, each with its own slice, the stager off on one of them.
    half = 2 * BATCH
    rank0 = BatchFeeder(cfg, dataset, CPU, transform=gaussian_jitter)
    rank0.advise(1, picks[:half])
    rank1 = BatchFeeder(dataclasses.replace(cfg, stager=False), dataset, CPU, transform=gaussian_jitter)
    rank1.advise(1, picks[half : 2 * half])
    two_ranks = torch.cat(
        [rank0.load(picks[b * BATCH : (b + 1) * BATCH], 1)[0] for b in range(2)]
        + [rank1.load(picks[half + b * BATCH : half + (b + 1) * BATCH], 1)[0] for b in range(2)]
    )
    rank0.close()
    rank1.close()
    assert torch.equal(one_rank, two_ranks)
    raw = dataset.get_batch(picks[: 4 * BATCH] // 2)[0]
    assert not torch.equal(one_rank, raw)  # the transform did something
    assert torch.allclose(one_rank, raw, atol=0.5)


class NoisyData(TensorDataSet):
    """Augments inside get_batch: breaks the purity contract."""

    def get_batch(self, indices: torch.Tensor) -> list[torch.Tensor]:
        return [f.index_select(0, indices) + torch.rand(1) for f in self.fields]


def noisy_data() -> NoisyData:
    return NoisyData(torch.zeros(8, 2))


def test_purity_check_catches_a_dataset_that_augments_inside_get_batch(npy_folder):
    check_purity(NpyFolderDataSet(npy_folder), "task.train_data")  # pure: passes
    with pytest.raises(ValueError, match="two reads of samples"):
        check_purity(noisy_data(), "task.train_data")


def test_debug_check_purity_runs_the_check_when_the_task_is_built():
    task = {
        "model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1},
        "train_data": {"_target_": f"{__name__}.noisy_data"},
        "loss": {"_target_": "flodl.tasks.classification.cross_entropy_loss", "_partial_": True},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
    }
    cfg = FlodlConfig(task=TaskConfig(name="noisy", **task))
    assert build_task(task_settings(cfg), CPU, world_size=1).train_data is not None  # off by default
    cfg.debug.check_purity = True
    with pytest.raises(ValueError, match=r"task\.train_data: two reads of samples"):
        build_task(task_settings(cfg), CPU, world_size=1)
