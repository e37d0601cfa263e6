"""GPU slot packing for sweeps (`python train.py -m hydra/launcher=slots ...`): its config and pure choice.

The launcher itself lives in `hydra_plugins/flodl_slots` (Hydra only loads launchers from that namespace).
"""

from __future__ import annotations

from dataclasses import dataclass

# The override that tells a job the slots launcher started (a single run to Hydra) which sweep it belongs to.
GROUP_KEY = "logger.group"


@dataclass
class SlotLauncherConf:
    _target_: str = "hydra_plugins.flodl_slots.SlotLauncher"
    # Jobs at a time on a host without GPUs (with GPUs, the free GPUs decide).
    max_parallel: int = 2


def gpu_slots(free: list[int], wanted: int) -> list[int] | None:
    """The lowest `wanted` free GPU indices, or None when there are not enough (pure)."""
    return sorted(free)[:wanted] if len(free) >= wanted else None
