"""The plain PyTorch baseline: a hand-written training loop on one of flodl's task configs.

    python bench/plain_torch.py --task gpt_nano --seconds 3 --out one.json                 # 1 GPU
    python bench/plain_torch.py --task resnet20 --seconds 3 --compile --out one.json       # compiled
    torchrun --standalone --nproc_per_node=2 bench/plain_torch.py --task gpt_nano --steps 200 --out ddp.json

Same model, data, loss, optimizer, LR schedule and micro-batches per step (`grad_accum`) as flodl builds
from `conf/task/<task>.yaml` (the config is only read here; flodl's runtime is not used), wrapped in
DistributedDataParallel when started by torchrun (`no_sync` for all but the last micro-batch). Timing with
CUDA events around the measured steps, warm-up excluded; the loss is read back once, at the end. Rank 0
writes {samples_per_s, step_ms, steps, world, loss} to --out (a sample: one window of `batch_size`; a step
takes `batch_size x grad_accum` of them per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[1]
PROBE_STEPS = 30  # timed after warm-up to size a --seconds run


def load_task(name: str, overrides: list[str]) -> Any:
    """conf/task/<name>.yaml (top-level keys: batch_size, task, ...) with dotted overrides applied."""
    cfg = OmegaConf.merge(
        OmegaConf.load(REPO / "conf" / "task" / f"{name}.yaml"), OmegaConf.from_dotlist(overrides)
    )
    OmegaConf.resolve(cfg)
    return cfg


def direct_callable(fn: Any) -> Any:
    """The function a config partial binds, called directly as a plain torch loop would (Hydra 1.3.8
    wraps `_partial_: true` targets in a partial that re-runs its target policy on every call)."""
    if isinstance(fn, functools.partial):
        return functools.partial(fn.func, *fn.args, **fn.keywords)
    return fn


class PlainLoop:
    """Plain torch's training loop, the baseline every benchmark compares with (bench/step_ops.py counts
    its ops). Each rank takes its own batches of a shared per-epoch permutation, as a DistributedSampler
    would; `wrap` turns the model into what trains (DDP for several ranks)."""

    def __init__(
        self,
        cfg: Any,
        device: torch.device,
        seed: int,
        world: int = 1,
        rank: int = 0,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        graphs: bool = False,
    ) -> None:
        """`graphs`: the model is compiled in a mode that captures CUDA graphs."""
        self.batch_size = int(cfg.batch_size)
        self.grad_accum = int(cfg.get("grad_accum", 1))
        self.graphs = graphs
        self.device, self.seed, self.world, self.rank = device, seed, world, rank
        torch.manual_seed(seed)
        model = instantiate(cfg.task.model).to(device)
        self.optimizer = instantiate(cfg.task.optimizer)(model.parameters())
        scheduler = cfg.task.get("scheduler")
        self.scheduler = instantiate(scheduler)(self.optimizer) if scheduler else None
        self.loss_fn = direct_callable(instantiate(cfg.task.loss))
        self.data = instantiate(cfg.task.train_data)
        if (
            graphs
        ):  # gradients in tensors of the parameters' own, zeroed in place (a replay overwrites its outputs)
            for param in model.parameters():
                param.grad = torch.zeros_like(param)
        self.train_module = wrap(model) if wrap is not None else model
        self.train_module.train()
        self.batches_per_epoch = len(self.data) // (self.batch_size * world)
        self.no_sync = getattr(self.train_module, "no_sync", None)
        if self.batches_per_epoch == 0:
            raise SystemExit(
                f"plain_torch: {len(self.data)} samples hold no batch of {self.batch_size} x {world} ranks"
            )
        self.order: dict[int, torch.Tensor] = {}
        self.loss_sum = torch.zeros((), device=device)
        self.step = 0

    def batch_at(self, step: int) -> list[torch.Tensor]:
        epoch, b = divmod(step, self.batches_per_epoch)
        if epoch not in self.order:
            self.order.clear()
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self.order[epoch] = torch.randperm(len(self.data), generator=generator)
        start = (b * self.world + self.rank) * self.batch_size
        picks = self.order[epoch][start : start + self.batch_size]
        return [t.to(self.device, non_blocking=True) for t in self.data.get_batch(picks)]

    def train(self, steps: int) -> None:
        """`steps` optimizer steps of `grad_accum` micro-batches each."""
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=not self.graphs)
            for micro in range(self.grad_accum):
                if self.graphs:  # CUDA graphs: each micro-batch a new replay (gradients are added in place)
                    torch.compiler.cudagraph_mark_step_begin()
                last = micro == self.grad_accum - 1
                with contextlib.nullcontext() if last or self.no_sync is None else self.no_sync():
                    loss = self.loss_fn(self.train_module, self.batch_at(self.step))
                    (loss / self.grad_accum).backward()
                self.loss_sum += loss.detach() / self.grad_accum
                self.step += 1
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()


class Clock:
    """Elapsed seconds between start() and stop(): CUDA events on a GPU (no host sync in between)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000
        return time.perf_counter() - self.t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", required=True, help="a config name under conf/task")
    parser.add_argument("--override", action="append", default=[], help="dotted key=value, repeatable")
    parser.add_argument("--steps", type=int, default=100, help="measured steps per rank")
    parser.add_argument("--seconds", type=float, default=None, help="1 process only: measure about this long")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--bf16-hook", action="store_true", help="DDP gradients as bf16 (torch's comm hook)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (in the warm-up)")
    parser.add_argument("--compile-mode", default="default", help="torch.compile's mode (with --compile)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")

    cfg = load_task(args.task, args.override)

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        if world == 1:
            return torch.compile(model, mode=args.compile_mode) if args.compile else model
        ddp = DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        if args.bf16_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # torch's bf16 hook is NCCL-only; gloo (CPU smoke runs) takes the fp16 one, the same code path.
            hook = (
                default_hooks.bf16_compress_hook
                if device.type == "cuda"
                else default_hooks.fp16_compress_hook
            )
            ddp.register_comm_hook(dist.group.WORLD, hook)
        return torch.compile(ddp, mode=args.compile_mode) if args.compile else ddp

    graphs = args.compile and args.compile_mode in ("reduce-overhead", "max-autotune")
    loop = PlainLoop(cfg, device, args.seed, world, rank, wrap, graphs)
    clock = Clock(device)
    loop.train(args.warmup)
    steps = args.steps
    if args.seconds is not None:
        if world > 1:
            raise SystemExit("plain_torch: --seconds needs a single process (ranks must agree on the steps)")
        clock.start()
        loop.train(PROBE_STEPS)
        steps = max(PROBE_STEPS, round(args.seconds * PROBE_STEPS / clock.stop()))
    if world > 1:
        dist.barrier()
    clock.start()
    loop.train(steps)
    seconds = clock.stop()
    mean_loss = float(loop.loss_sum) * loop.grad_accum / loop.step
    if rank == 0:
        result = {
            "samples_per_s": steps * loop.grad_accum * loop.batch_size * world / seconds,
            "step_ms": seconds / steps * 1000,
            "steps": steps,
            "world": world,
            "loss": mean_loss,
        }
        args.out.write_text(json.dumps(result))
    if world > 1:
        # DDP (its reducer, a comm hook's pending futures) holds the gloo group: dropped first, the group's
        # threads are joined here, not while the interpreter exits (where gloo ranks sometimes aborted,
        # "terminate called without an active exception", once in about five runs on a loaded machine).
        del loop
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
