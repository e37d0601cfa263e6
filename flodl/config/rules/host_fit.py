"""What this host can run: its devices, the launcher that started it, the precision, the disk tier."""

from __future__ import annotations

from collections.abc import Iterator

from flodl.config.host import GIB, HostFacts, stage_dir_of
from flodl.config.rules.problem import problem
from flodl.config.schema import FlodlConfig

# precision=fp8: float8 tensor-core matmuls from this CUDA compute capability on (Ada 8.9, Hopper 9.0).
FP8_CAPABILITY = (8, 9)


def host_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    uses_gpus = cfg.device != "cpu" and host.gpus > 0
    yield from _device_problems(cfg, host, uses_gpus)
    yield from _launcher_problems(cfg, host)
    for name in ("slow_rank", "nan_rank", "hang_rank", "kill_rank"):
        rank: int | None = getattr(cfg.simulate, name)
        # A job of no ranks is refused as such (launch.nproc_per_node), not once per simulated rank.
        if rank is not None and host.world_size >= 1 and not 0 <= rank < host.world_size:
            yield problem(f"simulate.{name}", rank, f"must be a rank of this job, 0..{host.world_size - 1}")
    if cfg.precision == "fp16" and not uses_gpus:
        yield problem(
            "precision",
            "fp16",
            f"fp16 autocast with a GradScaler needs CUDA (device={cfg.device}, {host.gpus} GPU(s) visible); "
            "use precision=bf16 on CPU",
        )
    if cfg.precision == "fp8":
        yield from _fp8_problems(uses_gpus, host)
    yield from _disk_problems(cfg, host)


def _device_problems(cfg: FlodlConfig, host: HostFacts, uses_gpus: bool) -> Iterator[str]:
    if cfg.device == "cuda" and host.gpus == 0:
        yield problem("device", cfg.device, "no CUDA device is visible on this host")
    if cfg.backend == "nccl" and uses_gpus and host.ranks_per_node > host.gpus:
        yield problem(
            "backend",
            cfg.backend,
            f"NCCL needs one GPU per rank, but this host runs {host.ranks_per_node} ranks on "
            f"{host.gpus} visible GPU(s); set backend=cpu to share the GPUs round-robin (gloo), lower the "
            "ranks per node, or set device=cpu",
        )
    if cfg.launch.start_method == "fork" and host.gpus > 0:
        # Even with device=cpu: a forked rank inherits the launcher's CUDA driver state, and torch's
        # optimizers ask CUDA at their first step (seen on 2x H200: "CUDA error: initialization error").
        yield problem(
            "launch.start_method",
            "fork",
            "CUDA cannot be used in forked ranks, and this host has a GPU; use spawn or forkserver",
        )


def _launcher_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    if not host.under_torchrun:
        return
    if cfg.launch.nproc_per_node not in (1, host.ranks_per_node):
        yield problem(
            "launch.nproc_per_node",
            cfg.launch.nproc_per_node,
            f"torchrun already started {host.ranks_per_node} rank(s) on this node; leave it at 1 and use "
            "torchrun's --nproc_per_node",
        )
    # A rank started apart under survive is restarted by its own command (flodl/launcher/apart.py).
    if cfg.launch.max_restarts and (host.elastic_agent or cfg.fault_tolerance != "survive"):
        yield problem(
            "launch.max_restarts",
            cfg.launch.max_restarts,
            "under torchrun use its own --max-restarts (flodl restarts a rank started apart, without "
            "torchrun, under fault_tolerance=survive)",
        )


def _fp8_problems(uses_gpus: bool, host: HostFacts) -> Iterator[str]:
    """float8 matmuls need torch's torch._scaled_mm and GPUs of compute capability 8.9+ (Ada, Hopper)."""
    capability = host.gpu_capability
    if not uses_gpus:
        why = "runs on the GPU"
    elif not host.float8_matmul:
        why = "needs a torch with float8 matmuls (torch._scaled_mm); upgrade torch"
    elif capability is None or capability < FP8_CAPABILITY:
        why = f"needs GPUs of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+ (H100, H200, L40S)"
        why += f", and this host's lowest is {capability[0]}.{capability[1]}" if capability else ""
    else:
        return
    yield problem("precision", "fp8", f"float8 training {why}; use precision=bf16")


def _disk_problems(cfg: FlodlConfig, host: HostFacts) -> Iterator[str]:
    if cfg.disk_stage_gb <= 0:
        return
    stage_dir = stage_dir_of(cfg.disk_stage_dir)
    if host.stage_dir_free_bytes is None:
        yield problem(
            "disk_stage_dir", stage_dir, "is not an existing directory; create it or point elsewhere"
        )
        return
    needed = cfg.disk_stage_gb * GIB * host.ranks_per_node
    if needed > host.stage_dir_free_bytes:
        yield problem(
            "disk_stage_gb",
            cfg.disk_stage_gb,
            f"{host.ranks_per_node} rank(s) x {cfg.disk_stage_gb} GiB exceeds the "
            f"{host.stage_dir_free_bytes / GIB:.1f} GiB free in {stage_dir}",
        )
