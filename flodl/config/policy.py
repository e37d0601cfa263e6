"""Facts a policy implies, asked by the run and by `plan=true` alike; pure (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from flodl.config.schema import FlodlConfig


@dataclass(frozen=True)
class PolicyFacts:
    """What the run's policy implies, resolved once from the config (`of`) and handed to whoever builds by it:
    nothing below asks the policy's name again."""

    # sync, cadence or async: what the lines and the checkpoints name.
    name: str
    # Local SGD machinery (cadence and async): each rank steps alone and rounds average the parameters.
    # Sync is DDP on every backend (the mean gradient each step).
    averages_parameters: bool
    # EASGD's blend of each rank toward the consensus (async only); None: a rank adopts the consensus.
    easgd_alpha: float | None
    # Rounds run on backend=cpu's host averager (a pinned host snapshot reduced over gloo on a background
    # thread; a sharded group's: a snapshot of the rank's shard, over its shard index's gloo group). Under
    # fault_tolerance=survive a sharded group's rounds run inline on the training thread on every backend.
    rounds_on_host: bool
    # A rank trains on while its round is in flight and adopts the consensus later (async with its rounds on
    # the host).
    trains_during_round: bool
    # Windows and rounds run across epoch boundaries, with no barrier between epochs, and a rank may overshoot
    # its count while a round is in flight (async).
    crosses_epochs: bool
    # A divergence guard reads the rounds (sync has none to guard).
    guarded: bool

    @classmethod
    def of(cls, cfg: FlodlConfig) -> PolicyFacts:
        is_async = cfg.policy == "async"
        averages = cfg.policy != "sync"
        surviving_groups = cfg.shard_group > 1 and cfg.fault_tolerance == "survive"
        on_host = averages and cfg.backend == "cpu" and not surviving_groups
        return cls(
            name=cfg.policy,
            averages_parameters=averages,
            easgd_alpha=cfg.easgd_alpha if is_async else None,
            rounds_on_host=on_host,
            trains_during_round=is_async and on_host,
            crosses_epochs=is_async,
            guarded=averages and cfg.divergence_guard != "none",
        )

    @property
    def blends(self) -> bool:
        """Whether a rank blends toward the consensus (EASGD) instead of adopting it."""
        return self.easgd_alpha is not None


def collective_backend(backend: str, device_type: str) -> str:
    """The process group's backend: NCCL for backend=nccl on GPUs; gloo on CPU (where NCCL does not exist)."""
    return "nccl" if backend == "nccl" and device_type == "cuda" else "gloo"


# torch.compile modes that capture CUDA graphs (torch._inductor.list_mode_options(): "triton.cudagraphs").
GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


def compile_mode_for(cfg: FlodlConfig, device_type: str, world_size: int) -> str | None:
    """torch.compile's mode for the run (None: compile=false). compile_mode=auto takes the fastest mode that
    is safe here: CUDA graphs (reduce-overhead) on a GPU, never slower than default there
    (bench/results/2026-12-01-compile-modes-1x-NVIDIA-H200.md), but not sync over NCCL with several ranks
    nor a model sharded in groups (FSDP2's gathers), not measured there yet."""
    if not cfg.compile:
        return None
    if cfg.compile_mode != "auto":
        return cfg.compile_mode
    if device_type != "cuda" or cfg.shard_group > 1:
        return "default"
    if cfg.policy == "sync" and collective_backend(cfg.backend, device_type) == "nccl" and world_size > 1:
        return "default"
    return "reduce-overhead"


def hosts_apart(cfg: FlodlConfig) -> bool:
    """Whether the run's host is a process apart from the ranks: under survive, any rank may die."""
    return cfg.fault_tolerance == "survive"


def rank_capacity(cfg: FlodlConfig, world_size: int) -> int:
    """The most ranks the job holds at once (seats 0..capacity-1): the `world_size` it starts with, and under
    survive up to launch.max_ranks with the ones that join it later."""
    return world_size if cfg.launch.max_ranks is None else max(cfg.launch.max_ranks, world_size)


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


# The keys that turn checkpoints on (any of them).
CHECKPOINT_KEYS = "checkpoint_every, checkpoint_every_steps or checkpoint_every_s"


def checkpoints_on(cfg: FlodlConfig) -> bool:
    return bool(checkpoint_keys_set(cfg))


def checkpoint_keys_set(cfg: FlodlConfig) -> list[str]:
    """The keys of CHECKPOINT_KEYS that `cfg` sets (null on all of them: checkpoints off)."""
    keys = {
        "checkpoint_every": cfg.checkpoint_every,
        "checkpoint_every_steps": cfg.checkpoint_every_steps,
        "checkpoint_every_s": cfg.checkpoint_every_s,
    }
    return [key for key, value in keys.items() if value is not None]


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
    """Whether checkpoint parts are written in the background (the fixed world of full replicas only: a
    sharded model's are written at the boundary by collectives of every rank)."""
    return cfg.checkpoint_background and cfg.fault_tolerance == "none" and cfg.shard_group == 1


def writes_in_a_process(cfg: FlodlConfig, device_type: str) -> bool:
    """Whether a rank's parts in the background are written by a process of its own (auto: on a GPU, whose
    launch-bound training thread a writer thread would slow; flodl/worker/part_writer.py), not a thread."""
    if cfg.checkpoint_writer == "auto":
        return device_type == "cuda"
    return cfg.checkpoint_writer == "process"
