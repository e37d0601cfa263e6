"""Structured configs: the typed schema every Hydra composition is checked against.

Every field of the original flodl `WorkerConfig` (and the ElChe / run knobs that reach it) is a
top-level key, so `python train.py gamma=0.5 disk_stage_gb=8` works. Defaults are the original's.
Groups (`policy`, `backend`, `task`, `logger`, `launch`) live in `conf/` and are typed by the
dataclasses below. `register_configs()` must run before Hydra composes: the command and `flodl.conf` call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

POLICIES = ("sync", "cadence", "async")
BACKENDS = ("nccl", "cpu")
DEVICES = ("auto", "cpu", "cuda")
GUARDS = ("none", "trend", "msf")
OUTERS = ("avg", "slowmo", "diloco")
QUANTIZED_WIRES = ("int8", "int4")
ON_NONFINITE = ("error", "skip")
FAULT_TOLERANCE = ("none", "survive")
CHECKPOINT_WRITERS = ("auto", "thread", "process")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# Who splits a stream among its readers (flodl/data/stream_split.py).
STREAM_SPLITS = ("auto", "flodl", "dataset", "ranks", "workers")
# torch.compile's modes (torch._inductor.list_mode_options()).
COMPILE_MODES = ("auto", "default", "lite", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TaskConfig:
    """What to train. Each entry is a Hydra `_target_` config, so users bring their own."""

    # A name for the task, kept with the run's config (each task's yaml sets its own).
    name: str = MISSING
    # nn.Module, built identically on every rank (seeded) before DDP broadcasts rank 0's copy.
    model: Any = MISSING
    # A BatchDataSet or any torch map-style Dataset (samples: tensors, numbers, strings in lists, dicts).
    train_data: Any = MISSING
    # Held-out data for the eval stream; null disables eval.
    eval_data: Any = None
    # Callable (model, batch) -> scalar mean loss tensor. Use `_partial_: true`. The batch: a BatchDataSet's
    # list[Tensor], or what collate_fn made of a map-style Dataset's samples; on the rank's device.
    loss: Any = MISSING
    # Callable (model, batch) -> dict[name, tensor sum over the batch]; reported as mean per sample.
    eval_fn: Any = None
    # Partial optimizer: called with the model's parameters.
    optimizer: Any = MISSING
    # Optional partial LR scheduler: called with the optimizer, stepped once per optimizer step.
    scheduler: Any = None
    # Optional partial callable (batch, keys: list[ViewKey]) -> batch, applied to every training batch after
    # the caches: makes the `augment` views differ. A key is (sample, view, epoch, seed) and
    # `key.generator()` its own RNG, so views are identical across runs and ranks.
    transform: Any = None
    # Map-style Datasets: builds a batch from a list of samples (null: torch's default_collate). A function
    # needs `_partial_: true`.
    collate_fn: Any = None
    # Whether the training data's reads are deterministic, so the RAM tier, disk pack and device pool may
    # keep them. null: BatchDataSets are (their contract), map-style Datasets are not (read afresh every
    # epoch: augmentation in __getitem__ stays random). true: cache a map-style Dataset (augment in
    # transform); false: read a BatchDataSet afresh too.
    cacheable: bool | None = None
    # A stream (train_data an IterableDataset): what it splits among its readers itself, so flodl splits
    # the rest and nothing twice. auto: what flodl sees (webdataset's split_by_node / split_by_worker stages,
    # HF's split_dataset_by_node and its split among DataLoader workers; any other stream splits nothing).
    # flodl: nothing (flodl asks shard(world_size, rank) when the dataset has it, else keeps every R-th
    # item). dataset: among the ranks and a rank's DataLoader workers. ranks: among the ranks only (it
    # reads RANK/WORLD_SIZE or torch.distributed). workers: among a rank's workers only (get_worker_info()).
    stream_split: str = "auto"


@dataclass
class LoggerConfig:
    # console: a progress bar and epoch lines on rank 0, plus metrics.jsonl in the run dir (always).
    # wandb: the same, and the metric and eval streams as one W&B run per job.
    name: str = "console"
    # Live training metrics every this many steps per rank (0: per epoch only).
    log_every: int = 50
    # W&B (logger=wandb). null defers to W&B: its environment (WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY,
    # WANDB_RUN_GROUP, WANDB_NAME, WANDB_JOB_TYPE, WANDB_TAGS, WANDB_NOTES, WANDB_DIR, ...) or its default.
    # online, offline (`wandb sync` later) or disabled.
    mode: str | None = None
    # The W&B project (null and no WANDB_PROJECT: W&B's default, "uncategorized").
    project: str | None = None
    # The W&B user or team the run belongs to (null and no WANDB_ENTITY: the API key's default).
    entity: str | None = None
    # The W&B group (null and no WANDB_RUN_GROUP: the sweep's stamp under multirun, else the run's). The slots
    # launcher sets it to its sweep's for each job it starts.
    group: str | None = None
    # The W&B run name (`name` is the logger's own); null and no WANDB_NAME: the overrides the sweep varies
    # (or the run dir's name).
    run_name: str | None = None
    # W&B tags (null and no WANDB_TAGS: none).
    tags: list[str] | None = None
    # null and no WANDB_JOB_TYPE: the policy.
    job_type: str | None = None
    # The W&B run's notes (null and no WANDB_NOTES: none).
    notes: str | None = None
    # W&B failing to start stops the run before it trains; false: warn once and train without W&B.
    required: bool = True


@dataclass
class LaunchConfig:
    # Ranks this invocation starts itself through torch's elastic launcher (ignored under torchrun,
    # where torchrun's own --nproc_per_node decides and this must be left at 1 or match it).
    nproc_per_node: int = 1
    # How self-launched ranks start: spawn (safe default), fork (faster start, CPU only) or forkserver.
    start_method: str = "spawn"
    # Seconds a rank waits for the rendezvous and for control messages before it reports a stall.
    timeout_s: float = 300.0
    # Restarts of self-launched ranks after a death: the whole group, from the last checkpoint; under survive
    # each rank alone, and a rank started apart by its own command. Under torchrun: its --max-restarts.
    max_restarts: int = 0
    # fault_tolerance=survive with restarts left: keep a rank's process started ahead, its imports done, so
    # that a restarted rank starts in a fraction of a second (spawn, forkserver; a forked one needs none).
    # It holds torch's import in host memory (a few hundred MB) while it waits.
    spare: bool = True
    # fault_tolerance=survive: the most ranks the job holds at once; ranks past the ones it starts with join
    # it while it trains (`flodl-join <run dir>`, on this host or another). null: the ranks it starts with.
    max_ranks: int | None = None


@dataclass
class SimulateConfig:
    """Make one rank slower on purpose, to watch cadence and async adapt on identical hardware."""

    # The rank to slow down (null: none).
    slow_rank: int | None = None
    # That rank's steps take this many times their real duration (it sleeps after real work).
    factor: float = 1.0
    # Make the loss of rank `nan_rank` at its step `nan_at_step` (1-based) NaN: checks on_nonfinite.
    nan_at_step: int | None = None
    # The rank whose loss becomes NaN at nan_at_step.
    nan_rank: int = 0
    # Freeze rank `hang_rank` (SIGSTOP: every thread stops) at its step `hang_at_step`: checks the
    # heartbeat timeout. The frozen process is left for the launcher to kill.
    hang_at_step: int | None = None
    # The rank frozen at hang_at_step.
    hang_rank: int = 0
    # Kill rank `kill_rank` (SIGKILL) at its step `kill_at_step`, or, with kill_in=round, as it enters the
    # first averaging round after that step (kill_in=start: as the ranks form their first averaging group,
    # survive only): checks fault_tolerance=survive. A restarted rank runs clean.
    kill_at_step: int | None = None
    # The rank killed at kill_at_step.
    kill_rank: int = 0
    # Where the kill lands: window (at the step), round (entering the next averaging round) or start.
    kill_in: str = "window"


@dataclass
class DebugConfig:
    """Switches for A/B measurements and checks (recorded and agreed across ranks like every key)."""

    # false: no RAM or disk tier and no stager thread; batches are read from the source.
    stager: bool = True
    # false: no tiers, stager, prefetch or device pool; each batch is read and copied in the step's thread,
    # as a plain loop would (the baseline for the whole data plane).
    data_plane: bool = True
    # Read a few training samples twice at start and refuse a dataset whose bytes differ (augment belongs in
    # task.transform).
    check_purity: bool = False


@dataclass
class FlodlConfig:
    # --- policy and backend (set through the config groups of the same name) ---
    # When ranks average: sync (DDP, every step), cadence (local SGD, ElChe-balanced windows) or async
    # (local SGD, no epoch barrier, EASGD blend); the group also sets that policy's defaults.
    policy: str = "sync"
    # How a local-SGD round runs: nccl (on the device; gloo without a GPU) or cpu (a host snapshot, gloo on a
    # background thread). Sync is DDP on either. cpu's process groups are gloo, so ranks may share a GPU; with
    # shard_group > 1 a round per shard index runs on that thread too (inline under fault_tolerance=survive).
    backend: str = "nccl"
    # auto: one CUDA device per rank when CUDA is available, else CPU.
    device: str = "auto"

    # Validate and print what the run would do (world, model size, bytes per round, budgets), start nothing.
    plan: bool = False

    # --- training loop ---
    # Model init (the same on every rank), the epoch shuffle, each rank's and each batch's random streams.
    seed: int = 42
    # Epochs to train.
    epochs: int = 10
    # A stream's epoch (task.train_data an IterableDataset: required there, refused for a map-style
    # Dataset): optimizer steps per rank per epoch, so an epoch holds steps_per_epoch x world_size steps of
    # every rank's samples under every policy. Under sync each rank steps this many; under cadence/async the
    # epoch's steps are handed out by speed, so a fast rank steps more. Each rank reads its own shard.
    steps_per_epoch: int | None = None
    # Samples per rank per micro-batch.
    batch_size: int = 32
    # Views per sample: an epoch's pick space is len(dataset) x augment; task.transform makes them differ.
    augment: int = 1
    # Clip each rank's gradient norm before each optimizer step (fp16: of the unscaled gradients; null: off).
    max_grad_norm: float | None = None
    # Micro-batches of batch_size per optimizer step (the global batch is world x grad_accum x batch_size).
    grad_accum: int = 1
    # Autocast of the forward pass: fp32 (off), bf16, or fp16 with a GradScaler (CUDA only); fp8: bf16 with
    # the model's linear layers multiplying in float8, scaled by the maxima of the step before (a GPU of
    # compute capability 8.9+: H100/H200, L40S). Parameters, optimizer state, the consensus and checkpoints
    # stay float32.
    precision: str = "fp32"
    # torch.compile the training module (DDP under sync); compile_mode is torch.compile's `mode`, or auto:
    # reduce-overhead (CUDA graphs) on a GPU, where it measured fastest (never slower than default), except
    # sync over NCCL with several ranks and a model sharded in groups (not measured there yet: default);
    # default on the CPU.
    compile: bool = False
    # torch.compile's mode when compile=true (auto: as above).
    compile_mode: str = "auto"
    # One device's dense bf16 peak in TFLOPS, for MFU (null: flodl's table of known GPUs; MFU is not known
    # on a device it lacks, the CPU included).
    peak_tflops: float | None = None
    # The learning rate is scaled by 1 + (world_size - 1) x this ratio (0: not scaled).
    lr_scale_ratio: float = 1.0
    # policy=sync, when the world changes (a checkpoint resumed on another number of ranks, a survive cut):
    # keep the global batch by gradient accumulation, each global step holding the samples it would have,
    # so the learning rate and the trajectory stay the run's (a resume where it does not divide is refused;
    # a cut where it does not divide follows the world). false: the global batch follows the world and the
    # learning rate is scaled by lr_scale_ratio (docs/checkpoints-and-faults.md, docs/survive.md).
    keep_global_batch: bool = False
    # Evaluate after every this many epochs and after the last (0: no eval).
    eval_every: int = 1
    # What a sweep's job returns to its sweeper (Optuna, Ax, Nevergrad: set its direction to match), read
    # from metrics.jsonl: the last recorded value of `loss` (the training loss) or `eval/<name>` (an eval_fn
    # metric, e.g. eval/accuracy). null: eval/loss, or loss when the run does not evaluate.
    objective: str | None = None

    # --- averaging ---
    # Local SGD: rank k weighs n_k ** gamma in the consensus (n_k: its steps since the last round; 0: equal
    # weight among the ranks that moved).
    gamma: float = 1.0
    # What crosses the wire is bf16 (half the bytes); the consensus, checkpoints and model.pt stay float32.
    bf16_wire: bool = False
    # Local SGD: what a rank sends is its change since the last global parameters plus its error feedback,
    # quantized in blocks of 512 with a float32 scale each: int8 (3.97x fewer bytes than float32) or int4
    # (7.88x); null: not quantized. See docs/policies.md. Not with bf16_wire, not under sync.
    quantized_wire: str | None = None
    # Async: each rank blends the consensus in, W += easgd_alpha x (avg - W), in (0, 1] (null: the policy's
    # default, 0.5 under async; cadence adopts the consensus).
    easgd_alpha: float | None = None
    # Outer optimizer on the averaged parameters (cadence / async): avg (none), slowmo, diloco.
    outer: str = "avg"
    # null: the outer optimizer's default (slowmo 1.0 / 0.9, diloco 0.7 / 0.9).
    outer_lr: float | None = None
    # The outer optimizer's momentum, in [0, 1) (null: its default; DiLoCo needs > 0).
    outer_momentum: float | None = None
    # Clear the inner optimizer's state after each outer step (null: diloco yes, as flodl's original; slowmo
    # no). The DiLoCo paper keeps it; see docs/policies.md for what each measured.
    outer_reset_inner: bool | None = None
    # Cadence: each round's communication runs while the next window trains, and its result is applied one
    # window late, keeping what the rank trained since it sent: parameters = consensus + (parameters - what
    # it sent) (with an outer optimizer, its new global in place of the consensus). Evals run on the
    # consensus; the last round of the run and of each checkpoint segment waits, exact. Needs backend=cpu
    # (the round's thread; on a GPU too). See docs/policies.md.
    overlap_rounds: bool = False

    # --- sharded groups ---
    # Ranks per sharded group: the job's ranks form world_size / shard_group groups of consecutive ranks
    # (whole groups on each host), and inside each group the model, its gradients and optimizer state are
    # sharded with FSDP2 (each rank holds about 1/shard_group of them). 1: every rank a full replica. Under
    # policy=sync (HSDP: one process on the global batch), cadence or async (a round per shard index), with
    # fault_tolerance=none; checkpoints (every policy) hold each rank's shard of the model and of the
    # optimizer state (each group's own under cadence and async), resumed on any world and shard_group; see
    # docs/sharded-groups.md.
    shard_group: int = 1

    # --- ElChe cadence balancer (cadence / async) ---
    # Batches the slowest rank trains per window at the start (faster ranks proportionally more).
    anchor: int = 10
    # The floor of the anchor's tuning (null: anchor).
    min_anchor: int | None = None
    # The ceiling of the anchor's growth.
    max_anchor: int = 1000
    # The share of a window averaging may cost; above it the anchor grows (committed on a stable guard).
    overhead_target: float = 0.05
    # The most a rank's batch count may move at one re-balance beyond the anchor's own move (0: every rank
    # trains the anchor, lockstep; null: no limit).
    max_batch_diff: int | None = None
    # Async: batches a rank may train past its count while it waits for the round (null: the policy's).
    max_overshoot: int | None = None
    # The trend guard's bound on the worst rank's divergence from the consensus (null: 0.05, 0.3 with EASGD).
    divergence_threshold: float | None = None
    # trend: 3 rises above divergence_threshold suppress growth; msf: the divergence growth rate; none: off.
    divergence_guard: str = "trend"
    # Fixed per-rank shares of each epoch instead of ElChe's (not implemented yet: refused before any rank).
    partition_ratios: list[float] | None = None

    # --- data plane ---
    # Keep samples resident on the GPU when VRAM remains after the prefetch queue (only misses are uploaded).
    vram_pool: bool = True
    # The share of total VRAM the data plane may plan with (prefetch depth and pool), in [0.5, 0.99].
    vram_max_usage: float = 0.90
    # The share of available RAM (a container's limit counts) the RAM tier may hold, split among a host's
    # ranks, in [0, 0.9] (0: no RAM tier).
    ram_max_usage: float = 0.50
    # The RAM tier (false: samples are staged to disk only).
    sample_cache: bool = True
    # The local-disk stage tier per rank, in GiB (0: off; it must fit in disk_stage_dir's free space).
    disk_stage_gb: float = 0.0
    # Where the disk tier lives (null: <tmp>/flodl-<uid>/).
    disk_stage_dir: str | None = None
    # torch DataLoader knobs for a map-style Dataset read afresh (see task.cacheable), or a stream (each
    # worker reads its own shard).
    num_workers: int = 0
    # Batches each DataLoader worker reads ahead (null: torch's 2; needs num_workers > 0).
    prefetch_factor: int | None = None
    # Unlike torch's default: the workers otherwise restart for every slice a rank is handed.
    persistent_workers: bool = True
    # Pin host batches (CUDA only) so their upload is asynchronous.
    pin_memory: bool = True

    # --- persistence ---
    # Checkpoint every this many epochs and after the last one (null: not by epochs; with no checkpoint_every*
    # key set, checkpoints are off: a stop or a crash then loses the run). On by default, so that a stopped,
    # preempted or crashed run resumes (docs/checkpoints-and-faults.md says what it costs).
    checkpoint_every: int | None = 1
    # Also checkpoint inside epochs, every this many global steps (one step of every rank, as sync counts
    # them), at the next step (sync) or round (cadence, async) boundary; and after the last epoch.
    checkpoint_every_steps: int | None = None
    # Also checkpoint this many seconds after the last one: at the next round boundary (cadence, async), or
    # at a step the ranks agree on a few seconds ahead (sync; fault_tolerance=none); and after the last epoch.
    checkpoint_every_s: float | None = None
    # Complete checkpoints kept; older ones are removed once a newer one is committed.
    checkpoint_keep: int = 2
    # Where checkpoints/ goes (null: the run dir).
    save_path: str | None = None
    # Write checkpoint parts in the background from a copy in host memory taken at the boundary, so training
    # goes on while they are written (under fault_tolerance=survive parts are written at the boundary: a
    # member cut mid-write must not hold up the others' checkpoint).
    checkpoint_background: bool = True
    # Who writes them in the background: auto (a process of the rank's own on a GPU, where a writer thread
    # would slow the training thread's kernel launches; a thread on CPU), thread or process (at idle priority,
    # started before training: on CPU it repays its torch import only with frequent checkpoints).
    checkpoint_writer: str = "auto"
    # A stop signal (SIGTERM from a scheduler, Ctrl-C) first saves a checkpoint at the next step (sync) or
    # round (cadence, async) boundary, within this many seconds, then stops; past it, or 0, the ranks stop at
    # once and the last checkpoint is named. Needs checkpoints on.
    stop_grace_s: float = 20.0
    # auto: continue from this run's newest complete checkpoint, if there is one (what a torchrun or
    # launch.max_restarts restart does); never: start fresh; or the path of a checkpoint dir or run dir.
    resume: str = "auto"

    # --- faults ---
    # A rank not heard from for this long is hung (ranks beat every eighth of it, 0.1 s to 1 s): the job
    # stops, or under survive it is cut. null: 60 s, or 10 s under survive (a rank that exits is cut at once
    # there: its supervisor says so; only a frozen one waits out the timeout).
    heartbeat_timeout_s: float | None = None
    # A non-finite loss: error (stop, naming rank and step) or skip (cadence/async: the rank's window
    # gets no weight in the next average and it restarts from the consensus).
    on_nonfinite: str = "error"
    # none: a rank's death ends the job (a launcher restart resumes from the last checkpoint); survive
    # (under every policy): the others cut it out and train on, and a restarted rank is admitted back.
    fault_tolerance: str = "none"
    # survive: fewer ranks left than this ends the run (its last consensus saved) with an error.
    min_ranks: int = 1

    # --- callbacks ---
    # Objects (Hydra `_target_` configs) whose hooks rank 0 calls during the run (flodl/callbacks.py).
    callbacks: list[Any] = field(default_factory=list)

    task: TaskConfig = field(default_factory=TaskConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def register_configs() -> None:
    """Register the schema and flodl's sweeper config. Idempotent."""
    from flodl.config.sweep import FlodlSweeperConf

    ConfigStore.instance().store(name="flodl_schema", node=schema_node())
    ConfigStore.instance().store(group="hydra/sweeper", name="flodl", node=FlodlSweeperConf, provider="flodl")


def schema_node() -> DictConfig:
    """The schema; the task's required `_target_` entries (model, train_data, loss, optimizer) take new keys.

    Hydra closes the whole composed config (struct mode), so `task.model.dropout=0.1` would be refused for
    an argument the task's yaml leaves at its default. An entry's own flag wins over the one it inherits; the
    task and every other node stay closed. The optional entries (null by default) stay plain: a null node
    with a flag of its own could not take `+task.collate_fn._target_=...`; `+` adds their arguments.
    """
    node = OmegaConf.structured(FlodlConfig)
    for name, kind in get_type_hints(TaskConfig).items():
        if kind is Any and OmegaConf.is_missing(node.task, name):
            node.task[name] = DictConfig(MISSING, flags={"struct": False})
    return node


def to_config(data: Any) -> FlodlConfig:
    """A typed FlodlConfig object from a DictConfig or plain dict (as shipped to spawned ranks)."""
    merged = OmegaConf.merge(OmegaConf.structured(FlodlConfig), data)
    typed = OmegaConf.to_object(merged)
    assert isinstance(typed, FlodlConfig)  # a structured config's object is its dataclass
    return typed
