"""Pure pieces of the data plane: budgets, cgroup parsing, Belady staging, view keys, pack records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flodl.config.host import parse_cgroup_available
from flodl.data.augment import ViewKey, gaussian_jitter, view_keys
from flodl.data.memory import POOL_HEADROOM_BYTES, POOL_MIN_BYTES, pool_budget, prefetch_depth, ram_budget
from flodl.data.pack import decode, encode, filesystem_of
from flodl.data.stager import plan_staging

MIB = 1 << 20
GIB = 1 << 30


def test_ram_budget_is_a_capped_fraction_split_among_co_hosted_ranks():
    assert ram_budget(available=1000, held=0, max_usage=0.5) == 500
    # What the tier already holds counts as available: the budget does not shrink as the cache fills.
    assert ram_budget(available=600, held=400, max_usage=0.5) == 500
    assert ram_budget(available=1000, held=0, max_usage=0.5, ranks_on_host=4) == 125
    assert ram_budget(available=1000, held=0, max_usage=1.0) == 900  # never above 90%
    assert ram_budget(available=1000, held=0, max_usage=0.0) == 0


@pytest.mark.parametrize(
    ("total", "used", "usage", "reserve", "batch", "cap", "depth"),
    [
        (80 * GIB, 10 * GIB, 0.9, 2 * GIB, 1 * GIB, 512, 60),  # (72 - 10 - 2) / 1
        (80 * GIB, 10 * GIB, 0.9, 2 * GIB, 1 * GIB, 7, 7),  # capped at the chunk's batches
        (80 * GIB, 10 * GIB, 0.9, 0, 1024, 10**9, 512),  # capped at 512
        (80 * GIB, 75 * GIB, 0.9, 0, 1024, 512, 0),  # over budget already
        (80 * GIB, 10 * GIB, 0.9, 62 * GIB, 1 * GIB, 512, 0),  # the activations take the rest
        (80 * GIB, 0, 0.9, 0, 0, 512, 0),  # batch size unknown yet
    ],
)
def test_prefetch_depth_formula(total, used, usage, reserve, batch, cap, depth):
    assert prefetch_depth(total, used, usage, reserve, batch, cap) == depth


def test_pool_budget_leaves_the_prefetch_queue_and_headroom():
    free = 4 * GIB
    assert pool_budget(free, depth=4, batch_bytes=MIB) == free - 4 * MIB - POOL_HEADROOM_BYTES
    assert pool_budget(free, depth=100, batch_bytes=MIB) == free - 16 * MIB - POOL_HEADROOM_BYTES
    assert pool_budget(POOL_HEADROOM_BYTES + POOL_MIN_BYTES - 1, 0, MIB) == 0  # dormant under one slab


def write(folder: Path, **files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def test_cgroup_v2_limit_minus_usage_plus_reclaimable_cache(tmp_path: Path):
    write(
        tmp_path / "job",
        memory__max=str(GIB),
        memory__current=str(256 * MIB),
        memory__stat=f"anon 1000\ninactive_file {64 * MIB}\nactive_file 5\n",
    )
    assert parse_cgroup_available(tmp_path, "/job") == GIB - 256 * MIB + 64 * MIB


def test_cgroup_v2_without_limit(tmp_path: Path):
    write(tmp_path, memory__max="max\n", memory__current="12345\n")
    assert parse_cgroup_available(tmp_path, "/") is None


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path):
    v1 = write(tmp_path / "memory", memory__limit_in_bytes=str(2 * GIB), memory__usage_in_bytes=str(GIB))
    (v1 / "memory.stat").write_text(f"cache 7\ntotal_inactive_file {MIB}\n")
    assert parse_cgroup_available(tmp_path, "/") == GIB + MIB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert parse_cgroup_available(tmp_path, "/") is None


def test_cgroup_usage_above_limit_and_missing_files(tmp_path: Path):
    write(tmp_path / "a", memory__max="100", memory__current="150")
    assert parse_cgroup_available(tmp_path, "/a") == 0
    assert parse_cgroup_available(tmp_path / "nothing", "/") is None


def staging(upcoming, in_ram=(), on_disk=(), ram_free=0, disk_free=0):
    arr = lambda xs: np.asarray(list(xs), dtype=np.int64)  # noqa: E731
    return plan_staging(arr(upcoming), arr(in_ram), arr(on_disk), ram_free, disk_free)


def test_staging_fills_ram_then_disk_in_next_use_order():
    plan = staging([5, 3, 5, 9, 1, 7], ram_free=2, disk_free=2)
    assert plan.to_ram == [5, 3]
    assert plan.to_disk == [9, 1]  # 7 is needed last and nothing has room: the walk stops
    assert plan.evict == []
    assert not plan.complete
    assert staging([5, 3, 5], ram_free=1, disk_free=1).complete


def test_staging_skips_staged_samples():
    plan = staging([1, 2, 3, 4], in_ram=[1], on_disk=[2], ram_free=5)
    assert plan.to_ram == [3, 4]


def test_belady_evicts_the_farthest_next_use_first():
    # Residents: 10 is never used again, 11 is used last, 12 second; candidates 1 and 2 come first.
    plan = staging([1, 12, 2, 11, 3], in_ram=[11, 12, 10], ram_free=0)
    assert plan.evict == [10, 11]  # never-again first, then the farthest
    assert plan.demote == [11]  # 11 is read again: it moves to disk; 10 is dropped
    assert plan.to_ram == [1, 2]
    # 3 is used after 12, the only resident left: 12 stays; 3 has no room anywhere.
    assert 12 not in plan.evict and 3 not in plan.to_ram


def test_belady_never_evicts_for_a_sample_needed_later_than_every_resident():
    plan = staging([7, 8, 9], in_ram=[7, 8], ram_free=0, disk_free=1)
    assert plan.evict == []
    assert plan.to_disk == [9]


def test_staging_with_empty_plan():
    plan = staging([], in_ram=[1, 2], ram_free=3, disk_free=3)
    assert (plan.to_ram, plan.to_disk, plan.evict) == ([], [], [])


def test_view_keys_map_picks_to_samples_and_views():
    keys = view_keys(torch.tensor([0, 5, 7]), augment=3, epoch=2, seed=9)
    assert keys == [ViewKey(0, 0, 2, 9), ViewKey(1, 2, 2, 9), ViewKey(2, 1, 2, 9)]


def test_view_key_seeds_are_deterministic_and_distinct():
    keys = [ViewKey(s, v, e, 42) for s in range(20) for v in range(3) for e in range(3)]
    seeds = [k.rng_seed() for k in keys]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [ViewKey(*k).rng_seed() for k in keys]
    assert all(0 <= s < 2**63 for s in seeds)


def test_gaussian_jitter_depends_on_the_key_only():
    rows = [torch.zeros(3, 4), torch.arange(3)]
    keys = [ViewKey(0, 0, 0, 1), ViewKey(0, 1, 0, 1), ViewKey(0, 0, 0, 1)]
    out = gaussian_jitter(rows, keys, std=1.0)
    assert torch.equal(out[0][0], out[0][2])  # same key, same view
    assert not torch.equal(out[0][0], out[0][1])  # another view differs
    assert torch.equal(out[1], rows[1])  # other fields untouched
    again = gaussian_jitter([torch.zeros(1, 4)], [keys[1]], std=1.0)
    assert torch.equal(again[0][0], out[0][1])  # independent of the batch it is in


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
def test_pack_record_round_trip(dtype: torch.dtype):
    rows = [torch.arange(12).reshape(3, 4).to(dtype), torch.tensor(7), torch.ones(5, dtype=torch.float64)]
    record = bytearray(encode(3, rows))
    assert len(record) % 16 == 0
    back = decode(record, 3)
    assert back is not None
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(rows, back, strict=True))
    assert decode(record, 4) is None  # another sample's record
    record[-20] ^= 0xFF
    assert decode(record, 3) is None  # checksum


def test_filesystem_of_picks_the_deepest_mount():
    mounts = "/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n"
    assert filesystem_of("/dev/shm/x", mounts) == "tmpfs"
    assert filesystem_of("/tmpfoo", mounts) == "ext4"
    assert filesystem_of("/tmp", mounts) == "tmpfs"
    assert filesystem_of("/home/a", mounts) == "ext4"
