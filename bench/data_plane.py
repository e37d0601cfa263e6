"""Data plane benchmark: a source slower than training and larger than the RAM budget.

The source is a memory-mapped `.npy` folder throttled to `--read-mb-s`; the RAM tier gets `--ram-mb`, the
disk tier `--disk-gb`. Training is stood in for by a fixed `--step-ms` per batch (a sleep: like a GPU step,
it leaves the Python interpreter free for the data threads); on a GPU the batch is also touched on the
device. Reported, side by side in one run:

- per epoch: data-starve time (how long `load` kept the step waiting) over step time, and which tier served
  the rows. Goal: with the disk tier warm (epoch 2 on), starve <= 2% of step time.
- the disk tier's read throughput (every staged sample read back in training order, batch by batch, page
  cache dropped first) over a plain sequential read of the same pack file (page cache dropped too).
  Goal: >= 0.8.

    python bench/data_plane.py                 # defaults: 256 MiB of 64 KiB samples, source at 100 MB/s
    python bench/data_plane.py --quick         # a small CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import environment_lines, results_path, write_report

from flodl.config.host import available_ram
from flodl.config.schema import FlodlConfig
from flodl.data.feeder import BatchFeeder
from flodl.data.npy import NpyFolderDataSet, write_npy_folder
from flodl.data.pack import PackFile
from flodl.data.partition import epoch_permutation
from flodl.job.settings import data_plane_settings

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--sample-kb", type=int, default=64)
    parser.add_argument("--read-mb-s", type=float, default=100.0, help="source throttle")
    parser.add_argument("--ram-mb", type=float, default=64.0, help="RAM tier budget")
    parser.add_argument("--disk-gb", type=float, default=1.0, help="disk tier budget")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--vram-pool",
        action="store_true",
        help="keep the device pool (default: off, so a GPU run measures the disk tier)",
    )
    parser.add_argument("--dir", default=None, help="where the source and the pack file go (default: temp)")
    parser.add_argument("--quick", action="store_true", help="small CPU smoke run (no report file)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.sample_kb, args.epochs, args.step_ms, args.ram_mb = 512, 8, 3, 2.0, 1.0
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        report = run(args, Path(work))
    if args.quick:
        print(report)
    else:
        write_report(results_path(RESULTS, "data-plane"), report)


def run(args: argparse.Namespace, work: Path) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    width = args.sample_kb * 1024 // 4
    rng = np.random.default_rng(0)
    source = write_npy_folder(
        work / "source",
        {"x": rng.standard_normal((args.samples, width), dtype=np.float32), "y": np.arange(args.samples)},
    )
    dataset = NpyFolderDataSet(source, read_mb_s=args.read_mb_s)
    cfg = FlodlConfig(
        batch_size=args.batch,
        seed=0,
        ram_max_usage=args.ram_mb * MB / available_ram(),
        disk_stage_gb=args.disk_gb,
        disk_stage_dir=str(work),
        vram_pool=args.vram_pool,
    )
    feeder = BatchFeeder(data_plane_settings(cfg, ranks_on_host=1), dataset, device)
    data_mb = args.samples * (width * 4 + 8) / MB
    lines = [
        "## data plane: slow source larger than the RAM budget",
        "",
        *environment_lines(cpu=device.type == "cpu"),
        f"- source: {args.samples} samples x {args.sample_kb} KiB = {data_mb:.0f} MB, throttled to "
        f"{args.read_mb_s:.0f} MB/s; RAM tier {args.ram_mb:.0f} MB, disk tier {args.disk_gb:g} GB in {work}",
        f"- batch {args.batch}, step {args.step_ms:g} ms (stand-in compute), device {device}, "
        f"device pool {'on' if args.vram_pool else 'off'}",
        "",
        "| epoch | step s | starve s | starve / step | VRAM hits | RAM hits | disk hits | source reads "
        "| stage reads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    warm_ratios = []
    for epoch in range(args.epochs):
        before = dict(feeder.stats.totals)
        steps = train_epoch(feeder, epoch, len(dataset), args.batch, args.step_ms / 1000, device)
        delta = {k: feeder.stats.totals[k] - before[k] for k in before}
        step_s = steps * args.step_ms / 1000
        ratio = delta["starve_ms"] / 1000 / step_s
        if epoch >= 1:
            warm_ratios.append(ratio)
        lines.append(
            f"| {epoch + 1} | {step_s:.2f} | {delta['starve_ms'] / 1000:.3f} | {ratio:.1%} | "
            f"{delta['hits_vram']:.0f} | {delta['hits_ram']:.0f} | {delta['hits_disk']:.0f} | "
            f"{delta['source_reads']:.0f} | {delta['stage_reads']:.0f} |"
        )
    pack = feeder.tiers.pack if feeder.tiers is not None else None
    tier_mb_s, seq_mb_s = read_throughputs(pack, args.batch) if pack is not None else (0.0, 0.0)
    worst = max(warm_ratios, default=float("nan"))
    ratio = tier_mb_s / seq_mb_s if seq_mb_s else float("nan")
    lines += [
        "",
        f"- warm epochs (2 on): worst starve / step = **{worst:.2%}** "
        f"(goal <= 2%: {'met' if worst <= 0.02 else 'NOT met'})",
        f"- disk tier read, shuffled, batch by batch: {tier_mb_s:.0f} MB/s; plain sequential read of the "
        f"same file: {seq_mb_s:.0f} MB/s; ratio **{ratio:.2f}** "
        f"(goal >= 0.8: {'met' if ratio >= 0.8 else 'NOT met'})",
        "",
    ]
    feeder.close()
    return "\n".join(lines)


def train_epoch(
    feeder: BatchFeeder, epoch: int, samples: int, batch: int, step_s: float, device: torch.device
) -> int:
    picks = epoch_permutation(samples, 0, epoch)
    feeder.advise(epoch, picks)
    steps = len(picks) // batch
    for b in range(steps):
        rows = feeder.load(picks[b * batch : (b + 1) * batch], epoch)
        if device.type == "cuda":
            rows[0].sum()  # the step reads its batch on the compute stream
        time.sleep(step_s)
    return steps


def read_throughputs(pack: PackFile, batch: int) -> tuple[float, float]:
    """MB/s of the disk tier (batches of staged samples in a shuffled order) and of a sequential read."""
    samples = pack.samples()
    order = np.random.default_rng(1).permutation(len(samples))
    drop_cache(pack.path)
    started, nbytes = time.perf_counter(), 0
    for start in range(0, len(order), batch):
        got = pack.read_batch([samples[i] for i in order[start : start + batch]])
        assert got is not None and not got[1], "records unreadable"
        nbytes += sum(f.numel() * f.element_size() for f in got[0])
    tier = nbytes / (time.perf_counter() - started) / MB
    drop_cache(pack.path)
    started, nbytes = time.perf_counter(), 0
    with open(pack.path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            nbytes += len(chunk)
    return tier, nbytes / (time.perf_counter() - started) / MB


def drop_cache(path: Path) -> None:
    """Evict the file from the page cache (clean pages; no root needed), so reads hit the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
