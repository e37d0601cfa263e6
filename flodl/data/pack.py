"""The disk tier: one append-only pack file of raw samples per process, with an in-memory index.

File `flodl-stage-<host>-<pid>-<seq>.pack` in the stage dir, so co-hosted ranks share the folder (and hosts
a shared one). A record is a 16-byte header (payload length, crc32 of the payload, sample index) and the
payload: the tensor count, per tensor (dtype code, ndim, shape), the sample's tree spec as JSON
(flodl/data/sample.py: where each tensor, number and string sits in its lists, tuples and dicts; no pickle),
then each tensor's bytes 16-byte aligned (read back as views, no copy). A BatchDataSet's sample is the list
of its fields' rows.
Samples are admitted until the byte budget is full, never evicted. A record failing its checksum is
dropped (the caller reads the source again); a write error turns the tier off with one warning. The file
is removed at exit (also in spawned ranks) and files of dead processes are removed at the next start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import multiprocessing.util
import os
import re
import socket
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flodl.data.sample import flatten, unflatten

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIQ")  # payload bytes, crc32(payload), sample
_FIELD = struct.Struct("<BB")  # dtype code, ndim
_ALIGN = 16
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_NAME = re.compile(r"^flodl-stage-(.+)-(\d+)-(\d+)\.pack$")
# A stage dir may be shared by hosts: a pack file is judged stale only by the host that wrote it.
_HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())
_SEQ = itertools.count()
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
# Upper bound of a record's bytes besides the tensors' own (header, specs, alignment) for 8 fields.
RECORD_OVERHEAD = 384


def encode(sample: int, value: Any) -> bytes:
    """One record of a sample's value: header + payload, padded to a multiple of 16 bytes (pure)."""
    spec, rows = flatten(value)
    meta = bytearray(struct.pack("<I", len(rows)))
    for t in rows:
        meta += _FIELD.pack(_CODES[t.dtype], t.dim()) + struct.pack(f"<{t.dim()}q", *t.shape)
    tree = json.dumps(spec, separators=(",", ":")).encode()
    meta += struct.pack("<I", len(tree)) + tree
    parts = [bytes(meta)]
    size = len(meta)
    for t in rows:
        pad = -(_HEADER.size + size) % _ALIGN
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        parts += [b"\0" * pad, data]
        size += pad + len(data)
    parts.append(b"\0" * (-(_HEADER.size + size) % _ALIGN))
    payload = b"".join(parts)
    return _HEADER.pack(len(payload), zlib.crc32(payload), sample) + payload


def intact(record: memoryview, sample: int) -> bool:
    """Whether a record read back whole is the sample's and passes its checksum."""
    if len(record) < _HEADER.size:
        return False
    length, crc, stored = _HEADER.unpack_from(record, 0)
    payload = record[_HEADER.size :]
    return stored == sample and length == len(payload) and zlib.crc32(payload) == crc


Layout = tuple[list[tuple[torch.dtype, tuple[int, ...], int, int]], int, slice]


def layout(record: memoryview) -> Layout:
    """Per tensor (dtype, shape, byte offset in the record, bytes), where the specs end, the tree spec's
    bytes."""
    (count,) = struct.unpack_from("<I", record, _HEADER.size)
    at, specs = _HEADER.size + 4, []
    for _ in range(count):
        code, ndim = _FIELD.unpack_from(record, at)
        specs.append((_DTYPES[code], struct.unpack_from(f"<{ndim}q", record, at + _FIELD.size)))
        at += _FIELD.size + 8 * ndim
    (tree_bytes,) = struct.unpack_from("<I", record, at)
    tree = slice(at + 4, at + 4 + tree_bytes)
    at = tree.stop
    meta_end, fields = at, []
    for dtype, shape in specs:
        at += -at % _ALIGN
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        fields.append((dtype, shape, at, nbytes))
        at += nbytes
    return fields, meta_end, tree


def decode(record: bytearray, sample: int) -> Any | None:
    """The value of one record (its tensors are views into `record`), or None when it is not intact."""
    view = memoryview(record)
    if not intact(view, sample):
        return None
    fields, _, tree = layout(view)
    leaves = [
        torch.frombuffer(record, dtype=torch.uint8, offset=at, count=n).view(dtype).reshape(shape)
        for dtype, shape, at, n in fields
    ]
    return unflatten(json.loads(bytes(view[tree])), leaves)


def decode_stacked(buffer: bytearray, length: int, count: int) -> list[Tensor]:
    """`count` intact records of one layout, `length` bytes each, back to back: the stacked fields."""
    fields, _, _ = layout(memoryview(buffer)[:length])
    table = torch.frombuffer(buffer, dtype=torch.uint8).view(count, length)
    return [table[:, at : at + n].view(dtype).reshape(count, *shape) for dtype, shape, at, n in fields]


def filesystem_of(path: str, mounts: str) -> str | None:
    """The filesystem type of the mount holding `path`, from /proc/mounts text (pure)."""
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def remove_stale(folder: Path, alive: Callable[[int], bool] | None = None) -> list[Path]:
    """Remove this host's pack files whose process is gone (left by a killed run); returns what was
    removed. Another host's files are never touched: its pids mean nothing here."""
    import psutil

    is_alive = alive or psutil.pid_exists
    removed = []
    for path in folder.glob("flodl-stage-*.pack"):
        match = _NAME.match(path.name)
        if match is None or match.group(1) != _HOST:
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or is_alive(pid):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


class _Handle:
    """The open file; closing removes it. Held apart from PackFile so the exit finalizer keeps no cycle."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        os.close(fd)
        with contextlib.suppress(OSError):
            self.path.unlink()


class PackFile:
    def __init__(self, folder: str | Path, budget_bytes: int) -> None:
        self.folder = Path(folder)
        self.budget = budget_bytes
        self.used = 0
        self.enabled = True
        self.corrupt = 0
        self._first_corrupt = -1
        self._index: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._handle: _Handle | None = None
        self.path = self.folder / f"flodl-stage-{_HOST}-{os.getpid()}-{next(_SEQ)}.pack"
        try:
            removed = remove_stale(self.folder)
            if removed:
                log.info("disk stage: removed %d pack file(s) of dead processes in %s", len(removed), folder)
            self._handle = _Handle(self.path)
        except OSError as err:
            self._off(f"cannot create a pack file in {self.folder}: {err}")
            return
        # Runs at garbage collection, at interpreter exit, and at the exit of a multiprocessing child
        # (where atexit handlers do not run).
        multiprocessing.util.Finalize(self, self._handle.close, exitpriority=10)
        self._warn_if_ram_backed()

    def __contains__(self, sample: int) -> bool:
        return sample in self._index

    def record_span(self, sample: int) -> tuple[int, int] | None:
        """(offset, length) of the sample's record in the file."""
        return self._index.get(sample)

    def room(self) -> int:
        return max(self.budget - self.used, 0) if self.enabled else 0

    def samples(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def put(self, sample: int, value: Any) -> bool:
        """Append the sample unless it is held or the budget is full; True when it is held after the call."""
        if not self.enabled:
            return False
        if sample in self._index:
            return True
        record = encode(sample, value)
        with self._lock:
            if not self.enabled or self.used + len(record) > self.budget:
                if self.used == 0 and self.enabled:
                    self._off(f"disk_stage budget ({self.budget} bytes) is smaller than one sample")
                return False
            offset = self.used
            try:
                _write_all(self._fd(), record, offset)
            except OSError as err:
                self._off(f"write to {self.path} failed: {err}")
                return False
            self.used += len(record)
            self._index[sample] = (offset, len(record))
            return True

    def get(self, sample: int) -> Any | None:
        """The sample's value, or None when absent or corrupt (a corrupt record is dropped from the index)."""
        span = self._index.get(sample)
        if span is None or not self.enabled:
            return None
        offset, length = span
        record = bytearray(length)
        try:
            got = os.preadv(self._fd(), [record], offset)
        except (OSError, TypeError):
            got = -1
        value = decode(record, sample) if got == length else None
        if value is None:
            self._drop([sample])
        return value

    def _drop(self, samples: list[int]) -> None:
        """Forget records that failed their checksum: the caller reads the source again."""
        with self._lock:
            for sample in samples:
                if self._index.pop(sample, None) is not None:
                    self.corrupt += 1
                    if self.corrupt == 1:
                        self._first_corrupt = sample
                    # A corrupted pack: one line per power of ten with the count, not one per record.
                    if _is_power_of_ten(self.corrupt):
                        log.warning(
                            "disk stage: %d record(s) failed their checksum so far (the first: record of "
                            "sample %d failed its checksum); each is read again from the source",
                            self.corrupt,
                            self._first_corrupt,
                        )

    def read_batch(self, samples: list[int]) -> tuple[list[Tensor], list[int]] | None:
        """Samples held on disk, read as one stacked batch when their records share one layout (the usual
        case): (the fields of the intact ones, in order; the positions that failed their checksum). None
        when the records differ in size (read them one by one with `get`)."""
        spans = [span for s in samples if (span := self._index.get(s)) is not None]
        lengths = {span[1] for span in spans}
        if len(lengths) != 1 or len(spans) < len(samples) or not self.enabled:
            return None
        length = lengths.pop()
        buffer = bytearray(length * len(samples))
        view = memoryview(buffer)
        fd = self._fd()

        def read(i: int) -> bool:
            record = view[i * length : (i + 1) * length]
            try:
                return os.preadv(fd, [record], spans[i][0]) == length and intact(record, samples[i])
            except OSError:
                return False

        def read_share(share: range) -> list[bool]:
            return [read(i) for i in share]

        # Several reads in flight (preadv and crc32 release the GIL): an SSD needs queue depth for throughput.
        # One task per reader thread, not per record: fewer hand-offs through the interpreter.
        shares = [range(k, len(samples), READ_THREADS) for k in range(min(READ_THREADS, len(samples)))]
        oks = [False] * len(samples)
        for share, results in zip(shares, _readers().map(read_share, shares), strict=True):
            for i, ok in zip(share, results, strict=True):
                oks[i] = ok
        good = [i for i, ok in enumerate(oks) if ok]
        bad = [i for i, ok in enumerate(oks) if not ok]
        if bad:
            self._drop([samples[i] for i in bad])
        if not good:
            return [], bad
        first = good[0] * length
        meta = view[first + _HEADER.size : first + layout(view[first : first + length])[1]]
        if any(view[i * length + _HEADER.size : i * length + _HEADER.size + len(meta)] != meta for i in good):
            return None  # same size, different shapes
        if len(good) < len(samples):  # close the gaps so the good records sit back to back
            buffer = bytearray(b"".join(view[i * length : (i + 1) * length] for i in good))
        return decode_stacked(buffer, length, len(good)), bad

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def _fd(self) -> int:
        fd = self._handle.fd if self._handle else None
        if fd is None:
            raise OSError("the pack file is closed")
        return fd

    def _off(self, why: str) -> None:
        """Turn the tier off for the rest of the run: one warning, the file removed."""
        self.enabled = False
        self._index.clear()
        log.warning("disk stage tier off: %s; training goes on without it", why)
        if self._handle is not None:
            self._handle.close()

    def _warn_if_ram_backed(self) -> None:
        try:
            kind = filesystem_of(os.path.realpath(self.folder), Path("/proc/mounts").read_text())
        except OSError:
            return
        if kind in RAM_FILESYSTEMS:
            log.warning(
                "disk stage dir %s is on %s: the 'disk' tier lives in RAM; point disk_stage_dir at a "
                "local disk",
                self.folder,
                kind,
            )


def _is_power_of_ten(n: int) -> bool:
    return n > 0 and 10 ** (len(str(n)) - 1) == n


_READERS: ThreadPoolExecutor | None = None
READ_THREADS = 8


def _readers() -> ThreadPoolExecutor:
    global _READERS
    if _READERS is None:
        _READERS = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="flodl-pack-read")
    return _READERS


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
