"""Checkpoints on disk: atomic files, complete-or-invisible checkpoint dirs, a `latest` pointer.

A checkpoint is a dir `checkpoints/epoch-NNNNNN/` (NNNNNN: the epochs it holds, so the checkpoint after epoch
3 as lines count, metrics.jsonl's epoch 2, is `epoch-000003`), or, taken inside an epoch (by steps or time),
`checkpoints/epoch-NNNNNN-sample-SSSSSSSSS/` (SSSSSSSSS samples into epoch NNNNNN as lines count), holding
`model.pt` (the consensus, float32; a run of sharded groups writes it in shards instead, with the rest of its
sharded state: flodl/checkpoints/sharded.py), one `rank{r}.pt` per rank (optimizer, scheduler, RNG, counters)
that was a member at the checkpoint round (every rank unless one was cut), `coordinator.pt` (epoch, ElChe,
guard, planner; inside an epoch, what its record holds so far) and, written last, `manifest.json` with every
file's size and CRC32 and the ranks whose parts it holds. Ranks write their parts into `<dir>.partial/`; rank
0 commits by writing the manifest and renaming the dir, then points `latest` at it. A `.partial` dir a run
left (a stop past its budget, a crash) is swept by the next run in the dir, fresh or resumed. The manifest
also records the run that wrote it (flodl/checkpoints/identity.py) and its place: the 0-based epoch, and the
samples into it (null: after it). A dir without a valid manifest (a crash mid-write, a truncated file) is
never loaded. Everything is loaded with `weights_only=True`."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import os
import re
import shutil
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from flodl.checkpoints.sharded import SHARDED_DIR, holds_sharded_model, sharded_files, whole_model
from flodl.counting import shown_epoch

MODEL_FILE = "model.pt"
COORDINATOR_FILE = "coordinator.pt"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
_DIR_PATTERN = re.compile(r"^epoch-(\d+)(?:-sample-(\d+))?$")

log = logging.getLogger("flodl")


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Temp file, fsync, rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def atomic_write_bytes(data: bytes, path: Path) -> None:
    _atomic_write(path, lambda f: f.write(data))


def atomic_save(obj: object, path: Path, zip_crc: bool = True) -> None:
    """torch.save straight into the temp file (no copy of the bytes in memory first). Not `zip_crc`: without
    torch's checksum of each record (it loads the same)."""
    if zip_crc:
        _atomic_write(path, lambda f: torch.save(obj, f))
    else:  # torch's config.patch leaves a ContextVar set in the context it runs in, each call (a long-lived
        # writer thread kept ~220 B per save for good): it runs in a copy of the context, dropped after it.
        contextvars.copy_context().run(_save_without_zip_crc, obj, path)


def write_part_file(obj: object, path: Path) -> None:
    """A checkpoint's file. The manifest holds each file's CRC-32 (`CheckpointDir.commit`): torch's own per
    record would be a second pass over the part beside training (gpt_nano on one H200: 15.7% of a round per
    round with it, 4.8% without, two runs)."""
    atomic_save(obj, path, zip_crc=False)


def _save_without_zip_crc(obj: object, path: Path) -> None:
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6 always writes it
        patch: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        patch = config.patch({"save.compute_crc32": False})  # type: ignore[attr-defined]  # installed at import
    with patch:
        _atomic_write(path, lambda f: torch.save(obj, f))


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as CPU tensors, loadable with weights_only=True."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}


def evaluated_model_path(run_dir: Path, epoch: int) -> Path:
    """Where rank 0 writes the parameters it evaluated for `epoch`, for a callback that keeps them."""
    return run_dir / "evaluated" / f"epoch-{epoch:06d}.pt"


@dataclass(frozen=True)
class Point:
    """Where in the run a checkpoint is taken: after the 0-based `epoch` whole (`into` None), or `into`
    samples (picks of its permutation) into it, at a step (sync) or round (local SGD) boundary inside it."""

    epoch: int
    into: int | None = None

    @property
    def order(self) -> tuple[int, float]:
        """Later checkpoints sort after earlier ones: inside an epoch before its end."""
        return (self.epoch, math.inf if self.into is None else self.into)

    @property
    def next_epoch(self) -> int:
        """The epoch a run resumed here trains first (the same epoch, from `into`, inside one)."""
        return self.epoch + 1 if self.into is None else self.epoch

    @property
    def last_whole_epoch(self) -> int:
        """The last epoch it holds whole (-1: none); its record is the last metrics.jsonl keeps on resume."""
        return self.epoch if self.into is None else self.epoch - 1

    def words(self) -> str:
        if self.into is None:
            return f"after epoch {shown_epoch(self.epoch)}"
        return f"epoch {shown_epoch(self.epoch)}, {self.into} samples into it"


def dir_name(point: Point) -> str:
    """The checkpoint dir's name, counting epochs as lines do (flodl/counting.py)."""
    name = f"epoch-{shown_epoch(point.epoch):06d}"
    return name if point.into is None else f"{name}-sample-{point.into:09d}"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: taken after `epoch` (training resumes at epoch + 1), or `into` samples into
    it (training resumes there)."""

    path: Path
    epoch: int
    world_size: int
    # The run that wrote it: its uid and the config that matters for resuming (None: an older flodl's).
    run: dict[str, Any] | None = None
    # The ranks whose parts it holds (None: every rank's, as a manifest without `ranks` says).
    ranks: tuple[int, ...] | None = None
    into: int | None = None

    @classmethod
    def from_manifest(cls, path: Path) -> Checkpoint:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        ranks = manifest.get("ranks")
        into = manifest.get("into")
        return cls(
            path,
            int(manifest["epoch"]),
            int(manifest["world_size"]),
            manifest.get("run"),
            None if ranks is None else tuple(ranks),
            None if into is None else int(into),
        )

    @property
    def point(self) -> Point:
        return Point(self.epoch, self.into)

    @property
    def part_ranks(self) -> tuple[int, ...]:
        """The ranks whose parts it holds, in order: the members at its checkpoint round."""
        return tuple(range(self.world_size)) if self.ranks is None else self.ranks

    def load(self, name: str) -> Any:
        return torch.load(self.path / name, map_location="cpu", weights_only=True)

    @property
    def sharded(self) -> bool:
        """Whether a run of sharded groups wrote it (its model and optimizer state in shards)."""
        return (self.path / SHARDED_DIR).is_dir()

    def model(self) -> dict[str, torch.Tensor]:
        """The consensus model, whole, as CPU tensors (read from its shards where it was written so)."""
        if (self.path / MODEL_FILE).is_file():
            return self.load(MODEL_FILE)
        return whole_model(self.path / SHARDED_DIR)


class CheckpointDir:
    """The checkpoints of one run, under `<root>/checkpoints`."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root = root / "checkpoints"
        self.keep = keep

    def partial(self, point: Point) -> Path:
        path = self.root / f"{dir_name(point)}.partial"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_part(self, point: Point, name: str, obj: object) -> None:
        """One rank's part (or the model, or the coordinator's), into the point's uncommitted dir."""
        write_part_file(obj, self.partial(point) / name)

    def commit(
        self,
        point: Point,
        world_size: int,
        run: dict[str, Any] | None = None,
        ranks: Collection[int] | None = None,
    ) -> Checkpoint:
        """Seal the point's dir (every part must be there: the parts of `ranks`, None: of every rank), make
        it `latest`, drop the oldest."""
        partial = self.partial(point)
        members = tuple(sorted(range(world_size) if ranks is None else ranks))
        sharded = sharded_files(partial)  # a sharded run's model lies there, not in model.pt
        model = [] if holds_sharded_model(sharded) else [MODEL_FILE]
        expected = [*model, COORDINATOR_FILE, *(rank_file(r) for r in members)]
        missing = [name for name in expected if not (partial / name).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {partial}: parts missing: {', '.join(missing)}")
        files = {name: _fingerprint(partial / name) for name in [*expected, *sharded]}
        manifest = {
            "epoch": point.epoch,
            "into": point.into,
            "world_size": world_size,
            "run": run,
            "ranks": list(members),
            "files": files,
        }
        atomic_write_bytes(json.dumps(manifest, indent=1).encode(), partial / MANIFEST_FILE)
        final = self.root / dir_name(point)
        if final.exists():  # a resumed run re-reached this point: the new one wins
            shutil.rmtree(final)
        partial.rename(final)
        _fsync_dir(self.root)
        atomic_write_bytes(final.name.encode(), self.root / LATEST_FILE)
        self._prune()
        return Checkpoint(final, point.epoch, world_size, run, members, point.into)

    def sweep_partial(self) -> list[Path]:
        """Remove every uncommitted `<dir>.partial/` (a stop or a crash left it: a run that starts, fresh or
        resumed, writes none of them yet); the dirs removed."""
        if not self.root.is_dir():
            return []
        swept = [p for p in self.root.iterdir() if p.is_dir() and p.name.endswith(".partial")]
        for path in swept:
            shutil.rmtree(path, ignore_errors=True)
        return swept

    def mark(self, name: str) -> None:
        """Leave an empty file `name` in the dir (the run's host, for each rank to look for in its own view of
        the dir: flodl/job/shared_dir.py)."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / name).touch()

    def marked(self, name: str) -> bool:
        """Whether this view of the dir holds the file `name` (a name never looked up before here: a network
        file system's cache of names it did not find has no entry for it)."""
        return (self.root / name).is_file()

    def unmark(self, name: str) -> None:
        """The file `name` removed, and the dir with it if that left it empty (a run that failed before its
        first checkpoint leaves no history for the next start to move aside)."""
        (self.root / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint whose manifest and files check out; damaged ones are skipped with a
        warning (the `latest` pointer is only a hint: a checkpoint dir is trusted on its manifest)."""
        for path in sorted(self._committed(), key=_point_of, reverse=True):
            problem = verify(path)
            if problem is None:
                return Checkpoint.from_manifest(path)
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None

    def _committed(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and _DIR_PATTERN.match(p.name)]

    def _prune(self) -> None:
        for path in sorted(self._committed(), key=_point_of)[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def _point_of(path: Path) -> tuple[int, float]:
    """A checkpoint dir's place in the run, from its name (the same order as `Point.order`)."""
    match = _DIR_PATTERN.match(path.name)
    assert match is not None
    into = match.group(2)
    return (int(match.group(1)), math.inf if into is None else int(into))


def _fingerprint(path: Path) -> dict[str, int]:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": path.stat().st_size, "crc32": crc}


def verify(path: Path) -> str | None:
    """Why the checkpoint dir at `path` cannot be trusted, or None when every file matches its manifest."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        ranks = manifest.get("ranks")
        members = range(int(manifest["world_size"])) if ranks is None else ranks
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"no readable {MANIFEST_FILE} ({err})"
    listed = manifest.get("files") or {}
    # A manifest vouches only for what it lists: every part a resume loads must be there.
    model = [] if holds_sharded_model(listed) else [MODEL_FILE]
    for name in (*model, COORDINATOR_FILE, *(rank_file(r) for r in members)):
        if name not in listed:
            return f"{MANIFEST_FILE} does not list {name} (an incomplete checkpoint)"
    for name, expected in listed.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if _fingerprint(path / name) != expected:
            return f"{name} does not match its manifest (truncated or corrupted)"
    return None


def resolve_resume(resume: str, checkpoints: CheckpointDir) -> Checkpoint | None:
    """The checkpoint `resume` names: `auto` (this run's newest, if any), `never`, or a checkpoint dir or a
    checkpoints/ dir of another run."""
    if resume == "never":
        return None
    if resume == "auto":
        return checkpoints.latest()
    path = Path(resume)
    if _DIR_PATTERN.match(path.name):
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"resume={resume}: {problem}")
        return Checkpoint.from_manifest(path)
    found = CheckpointDir(path.parent if path.name == "checkpoints" else path, keep=1).latest()
    if found is None:
        raise CheckpointError(f"resume={resume}: no complete checkpoint there")
    return found
