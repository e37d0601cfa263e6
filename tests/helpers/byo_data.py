"""Bring-your-own-data fixtures the ranks of an end-to-end test import: map-style datasets that augment in
`__getitem__` and log every read, dict samples, a custom collate, and the points as a stream.

Every read appends `index value` to `<log>/reads-<pid>.txt` (one file per process: DataLoader workers
included), so a test counts how often each sample was read and whether two reads gave different bytes.
"""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset

DIM = 8


def _points(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """Two separable blobs of `n` points."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.randn(n, DIM, generator=g) * 0.5 + (y.float() * 2 - 1).unsqueeze(1)
    return x, y


class NoisyPoints(Dataset):
    """Random augmentation in `__getitem__` (fresh noise from the global RNG on every read)."""

    def __init__(
        self, n: int = 192, log: str | None = None, dicts: bool = False, seed: int = 0, noise: float = 0.1
    ) -> None:
        """`noise`: its scale (0: the same sample on every read, whichever rank's RNG reads it)."""
        self.x, self.y = _points(n, seed)
        self.log = Path(log) if log else None
        self.dicts = dicts
        self.noise = noise

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        x = self.x[i] + self.noise * torch.randn(DIM)
        if self.log is not None:
            self.log.mkdir(parents=True, exist_ok=True)
            with open(self.log / f"reads-{os.getpid()}.txt", "a") as f:
                f.write(f"{i} {float(x.sum()):.9f}\n")
        if self.dicts:
            return {"x": x, "y": int(self.y[i]), "name": f"s{i}", "meta": {"weight": 1.0}}
        return x, self.y[i]


def reads(log: Path) -> list[dict[int, list[str]]]:
    """Per process that read (a rank, or a DataLoader worker), every logged read per sample index."""
    out = []
    for path in sorted(log.glob("reads-*.txt")):
        mine: dict[int, list[str]] = {}
        for line in path.read_text().splitlines():
            index, value = line.split()
            mine.setdefault(int(index), []).append(value)
        out.append(mine)
    return out


def dict_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A custom collate: stacked inputs, labels, the names kept as a list of strings."""
    return {
        "x": torch.stack([s["x"] for s in samples]),
        "y": torch.tensor([s["y"] for s in samples]),
        "names": [s["name"] for s in samples],
        "weight": torch.tensor([s["meta"]["weight"] for s in samples]),
    }


def _check(batch: dict[str, Any]) -> None:
    # What a DataLoader with dict_collate would give, on the model's device.
    assert isinstance(batch, dict) and isinstance(batch["names"], list), type(batch)
    assert all(isinstance(n, str) for n in batch["names"]), batch["names"]


def dict_loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    _check(batch)
    losses = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    return (losses * batch["weight"]).mean()


def dict_sums(model: nn.Module, batch: dict[str, Any]) -> dict[str, Tensor]:
    _check(batch)
    logits = model(batch["x"])
    return {"accuracy": (logits.argmax(dim=1) == batch["y"]).sum()}


def linear() -> nn.Module:
    return nn.Linear(DIM, 2)


class DrawingPoints(NoisyPoints):
    """Each read draws from torch's, numpy's and Python's generators; the sample carries a digest of those
    draws alone (not of the sample), so two reads share a digest only if they drew the same numbers."""

    def __getitem__(self, i: int) -> Any:
        noise = torch.randn(DIM)
        draws = (noise.tolist(), float(np.random.rand()), random.random())
        return self.x[i] + 0.1 * noise, self.y[i], zlib.crc32(repr(draws).encode())


def drawn_loss(model: nn.Module, batch: Any) -> Tensor:
    """Cross entropy; appends the draw digests of each trained batch to `rank<RANK>.txt` in
    $FLODL_TEST_DRAW_DIR, in order (an environment variable: the task's config is the run's identity)."""
    x, y, digests = batch
    if not torch.is_grad_enabled():  # the FLOPs count's pass (metrics/flops.py): no training step
        return F.cross_entropy(model(x), y)
    with open(Path(os.environ["FLODL_TEST_DRAW_DIR"]) / f"rank{os.environ['RANK']}.txt", "a") as f:
        f.write("".join(f"{d}\n" for d in digests.tolist()))
    return F.cross_entropy(model(x), y)


class PointStream(IterableDataset):
    """The points as a stream (an IterableDataset): item i is (x_i + noise from torch's generator, y_i, i), in
    order; `drawn_loss` logs the ids a rank trained."""

    def __init__(self, n: int = 192, seed: int = 0, ids: list[int] | None = None) -> None:
        self.x, self.y = _points(n, seed)
        self.ids = ids if ids is not None else list(range(n))

    def __iter__(self) -> Any:
        for i in self.ids:
            yield self.x[i] + 0.1 * torch.randn(DIM), self.y[i], i


class ShardedPointStream(PointStream):
    """Declares `shard(num_shards, index)`, as HF's IterableDataset does: shard k holds every num_shards-th
    id from k."""

    def shard(self, num_shards: int, index: int) -> PointStream:
        return PointStream(len(self.y), ids=self.ids[index::num_shards])


def write_point_shards(folder: Path, n: int, shards: int) -> None:
    """The points as `shards` webdataset tar files in `folder` (written with its ShardWriter): sample i is
    `x.npy`, `y.cls` and `id.cls`, in order, `n // shards` a shard."""
    import webdataset as wds

    x, y = _points(n, 0)
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "points-%06d.tar"), maxcount=n // shards, verbose=0) as sink:
        for i in range(n):
            sink.write({"__key__": f"p{i:06d}", "x.npy": x[i].numpy(), "y.cls": int(y[i]), "id.cls": i})


def point_webdataset(folder: str) -> Any:
    """The shards of `write_point_shards` as webdataset's users read them on several ranks: split among the
    ranks by its documented `nodesplitter=wds.split_by_node` (and among DataLoader workers by its default
    workersplitter), decoded to (x, y, id) tuples."""
    import webdataset as wds

    urls = sorted(str(p) for p in Path(folder).glob("*.tar"))
    assert urls, f"no shards in {folder}"
    dataset = wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=False)
    return dataset.decode().to_tuple("x.npy", "y.cls", "id.cls")
