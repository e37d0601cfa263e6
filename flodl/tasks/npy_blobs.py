"""A task whose training data lives on disk as memory-mapped `.npy` files: Gaussian blobs.

Generated once (deterministically from its parameters) into a folder under this user's private temp dir,
so it can be as large as wanted without a download; with a small `ram_max_usage` it exercises the disk
stage tier. The eval split is a separate folder drawn from the same class centres.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from flodl.config.host import user_temp_dir
from flodl.data.npy import NpyFolderDataSet, write_npy_folder


def npy_blobs_dataset(
    split: str,
    samples: int = 20000,
    features: int = 64,
    classes: int = 10,
    seed: int = 0,
    folder: str | None = None,
    read_mb_s: float | None = None,
) -> NpyFolderDataSet:
    """The train or test split (test: a fifth of `samples`), generated on first use."""
    if split not in ("train", "test"):
        raise ValueError(f"npy_blobs_dataset: split must be 'train' or 'test', got {split!r}")
    root = (
        Path(folder) if folder else user_temp_dir()
    ) / f"flodl-npy-blobs-{samples}x{features}-c{classes}-s{seed}"
    if not (root / "test").is_dir():
        _generate(root, samples, features, classes, seed)
    return NpyFolderDataSet(root / split, read_mb_s=read_mb_s)


def _generate(root: Path, samples: int, features: int, classes: int, seed: int) -> None:
    """Write both splits into a private folder, then rename it into place: ranks generating at once
    never see a half-written dataset (the loser of the rename discards its copy)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 0.5, size=(classes, features)).astype(np.float32)
    staging = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    for split, count in (("train", samples), ("test", max(samples // 5, 1))):
        labels = rng.integers(0, classes, size=count)
        inputs = centres[labels] + rng.normal(0.0, 1.0, size=(count, features)).astype(np.float32)
        write_npy_folder(staging / split, {"0_inputs": inputs.astype(np.float32), "1_labels": labels})
    try:
        os.rename(staging, root)
    except OSError:
        if not (root / "test").is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)
