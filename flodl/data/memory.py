"""Memory budgets of the data plane: what RAM and VRAM the tiers may use; pure (tested exhaustively).

The available RAM they split comes from the host probe (flodl/config/host.py's `available_ram`).
"""

from __future__ import annotations

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
