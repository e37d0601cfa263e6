"""Host work per training step: the ops flodl's sync worker dispatches per step against the plain torch
loop of bench/plain_torch.py, on one process, any device.

    python bench/step_ops.py --task resnet20 -- task.optimizer.lr=0.01   # CPU is enough: same op counts
    python bench/step_ops.py --task gpt_nano --device cuda -- task.train_data.samples=4096

Each op a step dispatches is one the host has to issue, so on models whose steps are many small kernels
(ResNet-20: ~580 per step) every extra op is launch time the GPU may wait for. An epoch of n steps and one
of 2n are counted; the difference over n is the per-step count, so per-epoch work (the one loss read, the
NaN check) drops out. Ops that read a value back to the host (`_local_scalar_dense`, behind `.item()`,
`float()`, `.tolist()`) are listed on their own: flodl must add none per step (torch's own optimizers may
read their CPU step counters, in both loops alike). `--time-steps N` also times both loops: on a small model
on the CPU the difference is the host time flodl's loop adds outside the ops.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # plain_torch

from flodl.averaging.wire import FP32  # noqa: E402
from flodl.config.host import RankEnv  # noqa: E402
from flodl.config.layout import Layout  # noqa: E402
from flodl.config.schema import register_configs, to_config  # noqa: E402
from flodl.job.settings import stepper_settings, task_settings, worker_settings  # noqa: E402
from flodl.launcher.run_dir import register_resolvers  # noqa: E402
from flodl.links.messages import EpochSlice, StartEpoch  # noqa: E402
from flodl.worker.base import RankLink  # noqa: E402
from flodl.worker.stepper import Stepper  # noqa: E402
from flodl.worker.sync import SyncWorker  # noqa: E402
from flodl.worker.task_setup import build_task  # noqa: E402

HOST_READS = ("aten._local_scalar_dense.default",)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def counted(run: Callable[[int], None], steps: int) -> collections.Counter[str]:
    counter = OpCounter()
    with counter:
        run(steps)
    return counter.ops


def per_step(run: Callable[[int], None], steps: int) -> dict[str, float]:
    """Ops per step: (ops of 2n steps - ops of n steps) / n; `run(k)` trains k steps after a warm-up."""
    run(2)  # lazy state (optimizer moments, caches) is created outside the counts
    once, twice = counted(run, steps), counted(run, 2 * steps)
    return {op: (twice[op] - once[op]) / steps for op in set(once) | set(twice) if twice[op] != once[op]}


def flodl_run(task: str, overrides: list[str], device: torch.device) -> Callable[[int], None]:
    """`run(k)`: one sync-worker epoch of k steps, exactly as a 1-process run trains it."""
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(
            config_name="config",
            overrides=[
                f"task={task}",
                f"device={device.type}",
                "logger=console",
                "logger.log_every=0",
                *overrides,
            ],
        )
    cfg = to_config(raw)
    parts = build_task(task_settings(cfg), device, 1)
    stepper = Stepper(stepper_settings(cfg, RankEnv(0, 1, 0, 1), device.type), parts, device, parts.model)
    link = RankLink(0, 1, None, None)  # type: ignore[arg-type]
    layout = Layout(1, stepper.step_samples)  # one rank, laid out as it steps
    worker = SyncWorker(stepper, link, worker_settings(cfg), wire=FP32, checkpointer=None, layout=layout)
    epochs = iter(range(1_000_000))

    def run(steps: int) -> None:
        if steps * cfg.batch_size > stepper.total_picks:
            raise SystemExit(
                f"step_ops: {steps} steps need more than the {stepper.total_picks} samples of an epoch"
            )
        epoch = next(epochs) % 2
        worker.train_epoch(StartEpoch(epoch, [EpochSlice(epoch, 0, steps * cfg.batch_size)]))

    return run


def plain_run(task: str, overrides: list[str], device: torch.device) -> Callable[[int], None]:
    """`run(k)`: k steps of bench/plain_torch.py's loop (one process)."""
    from plain_torch import PlainLoop, load_task

    return PlainLoop(load_task(task, overrides), device, seed=0).train


def compare(task: str, overrides: list[str], device: torch.device, steps: int) -> dict[str, dict[str, float]]:
    return {
        "plain": per_step(plain_run(task, overrides, device), steps),
        "flodl": per_step(flodl_run(task, overrides, device), steps),
    }


def wall_ms_per_step(run: Callable[[int], None], steps: int, device: torch.device, repeats: int = 7) -> float:
    """The fastest of `repeats` runs of `steps` steps, per step (the device drained at both ends)."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run(steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best / steps * 1000


def extra_host_reads(counts: dict[str, dict[str, float]]) -> float:
    return sum(counts["flodl"].get(op, 0) - counts["plain"].get(op, 0) for op in HOST_READS)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="digits")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--time-steps",
        type=int,
        default=0,
        help="also time both loops over this many steps (one epoch's worth)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the task (after --)")
    args = parser.parse_args()
    counts = compare(args.task, args.overrides, torch.device(args.device), args.steps)
    plain, flodl = counts["plain"], counts["flodl"]
    totals = f"plain torch {sum(plain.values()):.1f}, flodl {sum(flodl.values()):.1f}"
    print(f"ops per step, task={args.task}: {totals}")
    for op in sorted(set(plain) | set(flodl), key=lambda o: flodl.get(o, 0) - plain.get(o, 0), reverse=True):
        extra = flodl.get(op, 0) - plain.get(op, 0)
        if extra:
            print(f"  {extra:+6.2f}  {op}")
    print(f"host reads per step that flodl adds: {extra_host_reads(counts):g}")
    if args.time_steps:
        device = torch.device(args.device)
        times = {
            name: wall_ms_per_step(make(args.task, args.overrides, device), args.time_steps, device)
            for name, make in (("plain", plain_run), ("flodl", flodl_run))
        }
        print(
            f"wall per step (best of 7 x {args.time_steps} steps): plain torch {times['plain']:.3f} ms, "
            f"flodl {times['flodl']:.3f} ms, flodl / plain {times['flodl'] / times['plain']:.3f}"
        )


if __name__ == "__main__":
    main()
