"""Memory budgets of the data plane: what RAM and VRAM the tiers may use.

The arithmetic is pure (tested exhaustively); the probes read psutil, the cgroup files and the CUDA
allocator. Available RAM honours a container's cgroup limit (v2 `memory.max`, v1
`memory.limit_in_bytes`): psutil alone reports the host's memory, and caches sized from it OOM-kill
containers (deeplake#2987).
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# v1 reports "no limit" as a huge page-aligned number; anything above this is no limit.
_UNLIMITED = 1 << 60
# Hard ceiling on the RAM fraction, whatever ram_max_usage says: the kernel and the model need the rest.
RAM_FRACTION_CAP = 0.90
PREFETCH_DEPTH_CAP = 512
# Left free on the device beside the pool: allocator fragmentation and the kernels' workspaces.
POOL_HEADROOM_BYTES = 512 << 20
# The pool is only worth its bookkeeping from this size on (the original's 64 MiB slab).
POOL_MIN_BYTES = 64 << 20


def ram_budget(available: int, held: int, max_usage: float, ranks_on_host: int = 1) -> int:
    """Bytes this rank's RAM tier may hold: `min(max_usage, 0.9) x (available + held)`, split equally
    among the ranks of the host. `held` (what the tier holds already) counts as available: the budget must
    not shrink because the cache itself filled memory."""
    fraction = min(max(max_usage, 0.0), RAM_FRACTION_CAP)
    return int(fraction * max(available + held, 0)) // max(ranks_on_host, 1)


def prefetch_depth(
    total: int, used: int, max_usage: float, activation_reserve: int, batch_bytes: int, cap: int
) -> int:
    """Batches the device prefetch may hold: `(total·max_usage - used - activation_reserve) / batch_bytes`,
    at most `cap` (and PREFETCH_DEPTH_CAP); 0 when the budget is spent."""
    budget = int(total * max_usage) - used - activation_reserve
    if budget <= 0 or batch_bytes <= 0:
        return 0
    return max(0, min(budget // batch_bytes, cap, PREFETCH_DEPTH_CAP))


def pool_budget(free: int, depth: int, batch_bytes: int) -> int:
    """Device bytes the sample pool may take once the prefetch is sized: what is free, less the prefetch
    queue (at most 16 batches are counted) and a fixed headroom; 0 when under the pool's minimum."""
    budget = free - min(depth, 16) * batch_bytes - POOL_HEADROOM_BYTES
    return budget if budget >= POOL_MIN_BYTES else 0


def parse_cgroup_available(root: Path, own_path: str = "/") -> int | None:
    """Bytes left under this process's cgroup memory limit (limit - usage + reclaimable page cache), or None
    without a limit. `root` is the cgroup mount, `own_path` the process's group from /proc/self/cgroup."""
    candidates = [
        # v2 (unified): memory.max in the process's own group, or at the mount root inside a container.
        (root / own_path.lstrip("/"), "memory.max", "memory.current", "inactive_file"),
        (root, "memory.max", "memory.current", "inactive_file"),
        # v1: the memory controller's own hierarchy.
        (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ]
    for folder, limit_file, usage_file, reclaimable in candidates:
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is None or usage is None:
            continue
        if limit >= _UNLIMITED:
            return None
        return max(limit - usage + _stat_value(folder / "memory.stat", reclaimable), 0)
    return None


def available_ram(root: Path = CGROUP_ROOT) -> int:
    """Available RAM: psutil's MemAvailable, lowered to the cgroup's headroom when a limit is set."""
    import psutil

    available = int(psutil.virtual_memory().available)
    limited = parse_cgroup_available(root, _own_cgroup_v2_path())
    return available if limited is None else min(available, limited)


def _own_cgroup_v2_path() -> str:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:] or "/"
    except OSError:
        pass
    return "/"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
