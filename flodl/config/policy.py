"""Facts a policy implies, asked by the run and by `plan=true` alike; pure (no torch)."""

from __future__ import annotations

from flodl.config.schema import FlodlConfig


def easgd_alpha_of(cfg: FlodlConfig) -> float | None:
    """EASGD blends only under async: the value can never reach a cadence or sync worker."""
    return cfg.easgd_alpha if cfg.policy == "async" else None


def averages_parameters(cfg: FlodlConfig) -> bool:
    """Local SGD machinery: cadence and async. Sync is DDP on every backend (the mean gradient each step)."""
    return cfg.policy != "sync"


def collective_backend(backend: str, device_type: str) -> str:
    """The process group's backend: NCCL for backend=nccl on GPUs; gloo on CPU (where NCCL does not exist)."""
    return "nccl" if backend == "nccl" and device_type == "cuda" else "gloo"


def compile_mode_for(cfg: FlodlConfig, device_type: str, world_size: int) -> str | None:
    """torch.compile's mode for the run (None: compile=false). compile_mode=auto takes the fastest mode that
    is safe here: CUDA graphs (reduce-overhead) on a GPU (measured on one H200: ResNet-20 2.0x and GPT-nano
    2.8x eager, a GPT-2-small as fast as default), but sync over NCCL with several ranks, not measured yet."""
    if not cfg.compile:
        return None
    if cfg.compile_mode != "auto":
        return cfg.compile_mode
    if device_type != "cuda":
        return "default"
    if cfg.policy == "sync" and collective_backend(cfg.backend, device_type) == "nccl" and world_size > 1:
        return "default"
    return "reduce-overhead"


def hosts_apart(cfg: FlodlConfig) -> bool:
    """Whether the run's host is a process apart from the ranks: under survive, any rank may die."""
    return cfg.fault_tolerance == "survive"


def heartbeat_timeout_of(cfg: FlodlConfig) -> float:
    """How long a silent rank counts as alive: as set, or 10 s under survive (exits are seen at once there;
    the timeout is for a frozen rank) and 60 s otherwise (a restart of the whole job is the remedy)."""
    if cfg.heartbeat_timeout_s is not None:
        return cfg.heartbeat_timeout_s
    return 10.0 if cfg.fault_tolerance == "survive" else 60.0


def step_samples(cfg: FlodlConfig) -> int:
    """Samples per rank per optimizer step: the batch the coordinator plans in (ElChe, windows, metrics and
    the LR clock count optimizer steps); a worker trains it as `grad_accum` micro-batches of batch_size."""
    return cfg.batch_size * cfg.grad_accum


def step_words(cfg: FlodlConfig) -> str:
    """A rank's optimizer step in words: `32`, or `8 x grad_accum 4` when micro-batches make it up."""
    return f"{cfg.batch_size}" + (f" x grad_accum {cfg.grad_accum}" if cfg.grad_accum > 1 else "")


def guarded(cfg: FlodlConfig) -> bool:
    """Whether a divergence guard reads the rounds (sync has none to guard)."""
    return cfg.divergence_guard != "none" and cfg.policy != "sync"


# The keys that turn checkpoints on (any of them).
CHECKPOINT_KEYS = "checkpoint_every, checkpoint_every_steps or checkpoint_every_s"


def checkpoints_on(cfg: FlodlConfig) -> bool:
    return any(
        v is not None for v in (cfg.checkpoint_every, cfg.checkpoint_every_steps, cfg.checkpoint_every_s)
    )


def checkpoint_epochs(cfg: FlodlConfig) -> frozenset[int]:
    """The epochs after which a checkpoint is taken: every `checkpoint_every` epochs, and the last one
    whenever checkpoints are on (by epochs, steps or time)."""
    if not checkpoints_on(cfg):
        return frozenset()
    every = cfg.checkpoint_every
    return frozenset(
        e for e in range(cfg.epochs) if e == cfg.epochs - 1 or (every is not None and (e + 1) % every == 0)
    )


def saves_on_stop(cfg: FlodlConfig) -> bool:
    """Whether a stop signal saves a checkpoint before the ranks stop: checkpoints on and a grace budget."""
    return checkpoints_on(cfg) and cfg.stop_grace_s > 0


def writes_in_background(cfg: FlodlConfig) -> bool:
    """Whether checkpoint parts are written in the background (the fixed world only)."""
    return cfg.checkpoint_background and cfg.fault_tolerance == "none"


def writes_in_a_process(cfg: FlodlConfig, device_type: str) -> bool:
    """Whether a rank's parts in the background are written by a process of its own (auto: on a GPU, whose
    launch-bound training thread a writer thread would slow; flodl/worker/part_writer.py), not a thread."""
    if cfg.checkpoint_writer == "auto":
        return device_type == "cuda"
    return cfg.checkpoint_writer == "process"
