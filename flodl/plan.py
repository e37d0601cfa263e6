"""`python train.py plan=true ...`: validate, then print what the run would do — and start nothing.

The model is built on the meta device (no memory, no weights) only to count its parameters.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import psutil
import torch
from hydra.utils import instantiate

from flodl.config.host import HostFacts, stage_dir_of
from flodl.config.rules import GIB
from flodl.config.schema import FlodlConfig


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ModelSize:
    params: int
    param_bytes: int
    # What the parameters weigh on the wire as bf16 (float32 ones halve).
    bf16_bytes: int
    float32_buffer_bytes: int


def model_size(cfg: FlodlConfig) -> ModelSize:
    """The task's model measured on the meta device: no memory, no weights."""
    with torch.device("meta"):
        model = instantiate(cfg.task.model)
    params = [p for p in model.parameters() if p.requires_grad]
    return ModelSize(
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        bf16_bytes=sum(p.numel() * (2 if p.dtype == torch.float32 else p.element_size()) for p in params),
        float32_buffer_bytes=sum(
            b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.float32
        ),
    )


def describe(cfg: FlodlConfig, host: HostFacts) -> str:
    size = model_size(cfg)
    numel, param_bytes, buffer_bytes, bf16 = (
        size.params,
        size.param_bytes,
        size.float32_buffer_bytes,
        size.bf16_bytes,
    )
    world = host.world_size
    uses_gpu = cfg.device != "cpu" and host.gpus > 0
    devices = (
        ", ".join(torch.cuda.get_device_name(i) for i in range(min(host.gpus, host.ranks_per_node)))
        if uses_gpu
        else "CPU"
    )
    backend = "nccl" if uses_gpu and cfg.backend == "nccl" else "gloo"
    unit = "step (DDP gradients)" if cfg.policy == "sync" and cfg.backend == "nccl" else "averaging round"
    avail = psutil.virtual_memory().available
    stage_dir = stage_dir_of(cfg)
    free_disk = shutil.disk_usage(stage_dir).free if os.path.isdir(stage_dir) else 0
    lines = [
        "flodl plan (nothing was started)",
        f"  ranks           {world} in all, {host.ranks_per_node} on this host; devices: {devices}; "
        f"collectives: {backend}",
        f"  model           {numel:,} parameters, {human_bytes(param_bytes)} "
        f"(+{human_bytes(buffer_bytes)} float32 buffers)",
        f"  on the wire     {human_bytes(param_bytes + buffer_bytes)} per rank per {unit}, "
        f"{human_bytes(bf16 + buffer_bytes)} with bf16_wire" + (" (on)" if cfg.bf16_wire else " (off)"),
        f"  RAM budget      {cfg.ram_max_usage:.0%} of {avail / GIB:.1f} GiB available = "
        f"{cfg.ram_max_usage * avail / GIB:.1f} GiB (the data stager is not in this version)",
        f"  disk budget     {cfg.disk_stage_gb:g} GiB x {host.ranks_per_node} rank(s) in {stage_dir} "
        f"({free_disk / GIB:.1f} GiB free)",
        f"  VRAM budget     {cfg.vram_max_usage:.0%} of each GPU's memory for the data plane"
        + ("" if uses_gpu else " (no GPU in use)"),
        f"  policy          {cfg.policy} on backend={cfg.backend}, batch {cfg.batch_size}/rank "
        f"(global {cfg.batch_size * world}), {cfg.epochs} epochs, seed {cfg.seed}",
    ]
    if cfg.policy != "sync":
        lines.append(
            f"  local SGD       gamma={cfg.gamma} easgd_alpha={cfg.easgd_alpha} outer={cfg.outer} "
            f"anchor={cfg.anchor} (min {cfg.min_anchor or cfg.anchor}, max {cfg.max_anchor}) "
            f"overhead_target={cfg.overhead_target} max_batch_diff={cfg.max_batch_diff} "
            f"max_overshoot={cfg.max_overshoot or 'auto 3-15'} guard={cfg.divergence_guard}"
            + (f"({cfg.divergence_threshold or 'auto'})" if cfg.divergence_guard == "trend" else "")
        )
    return "\n".join(lines)
