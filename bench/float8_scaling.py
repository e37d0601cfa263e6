"""float8 recipes on GPT-2-124M's model, one process on one GPU: the step's time under each, side by side.

    python bench/float8_scaling.py                       # every variant, 3 interleaved passes
    python bench/float8_scaling.py --variants bf16,fp8 --repeat 2 --profile fp8
    python bench/float8_scaling.py --smoke               # a tiny model on CPU: checks the pipeline

Variants (flodl/worker/float8.py): `bf16` (autocast, no float8); `head` (only the tied output layer's matmuls
in float8, inside the chunked loss: task.model.float8_blocks=false); `fp8` (head, and every block linear:
precision=fp8); `fp8-mlp` (as fp8, the attention's linears left in bf16); `fp8-wgrad` (as fp8, the output
layer's weight gradient in float8 too: `HeadWeightGradInFloat8`, a probe). A variant's name with `+rows` (e.g.
`bf16+rows`): the chunked loss's softmax pass is bench/loss_kernel.py's Triton kernel (a probe). Until
2026-12-05 a `dynamic` variant scaled the block linears by their operands' current maxima (an extra pass over
each before its cast): 0.97x bf16 where delayed scaling, today's recipe, measured 1.12x. The model is
task=gpt2_124m's (12 x 768, context 1024, vocabulary 50,304, tied, no biases, loss in chunks of 16,384),
torch.compile'd (--mode), fused AdamW, bf16 autocast, 64 x 1024 uniform random tokens (one batch, every step);
--model gpt2_small: its byte vocabulary, whole logits (no head variant). Each run compiles and warms up
(--warmup steps), then times --steps steps with CUDA events. With --repeat N every variant runs N times,
interleaved, and its median counts. MFU: 6N + 12·L·d·T per token over the bf16 dense peak (989 TFLOPS on
H100/H200 SXM), float8 too.
--profile VARIANT: one more step of that variant under torch.profiler, its kernels' time by kind.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.benchlib import REPO, environment_lines, results_path, write_report
from flodl.tasks import chunked_ce
from flodl.tasks.gpt import GPT
from flodl.worker.float8 import E4M3, FLOAT8_MULTIPLE, _column_major, _to_float8, convert_to_float8

VARIANTS = ("bf16", "head", "fp8", "fp8-mlp", "fp8-wgrad")
BF16_PEAK_FLOPS = 989e12
SHAPES = {
    "gpt2_124m": {
        "layers": 12,
        "dim": 768,
        "heads": 12,
        "context": 1024,
        "vocab": 50304,
        "loss_chunk": 16384,
    },
    "gpt2_small": {"layers": 12, "dim": 768, "heads": 12, "context": 1024, "vocab": 256, "loss_chunk": 0},
    "smoke": {"layers": 1, "dim": 64, "heads": 2, "context": 32, "vocab": 256, "loss_chunk": 32},
}


@dataclass
class Measured:
    variant: str
    step_ms: float
    samples_s: float
    mfu: float
    loss: float
    peak_gb: float
    compile_s: float


def build(variant: str, shape: dict[str, int], device: torch.device) -> GPT:
    variant = variant.partition("+")[0]  # the recipe; its suffix patches the loss (`patched`)
    torch.manual_seed(0)
    model = GPT(**shape, amp=False, bias=False, float8_blocks=variant != "head").to(device)
    if variant == "fp8-mlp":
        for block in model.blocks:
            for linear in (block.attn.qkv, block.attn.proj):
                linear.__dict__["float8"] = False
    if variant != "bf16":
        convert_to_float8(model)
    return model


class HeadWeightGradInFloat8(chunked_ce._Float8Head):
    """fp8-wgrad's output layer: its weight gradient in float8 too, the last large bf16 matmul of fp8's step
    (a third of the head's FLOPs). The softmax gradient e5m2 at its fixed scale, transposed (the tokens are
    the contraction: torch._scaled_mm wants them along the rows of the first operand), times the hidden
    states e4m3 as columns. A chunk whose token count is no multiple of 16 (a batch's last) multiplies in
    the work dtype. A probe: it moves into flodl/tasks/chunked_ce.py if it pays."""

    def grads(self, h: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g8 = self.cast_grad(grad)
        if h.shape[0] % FLOAT8_MULTIPLE:
            return self.grad_hidden(g8), grad.t() @ h
        h8, h_inv = _to_float8(h, E4M3)
        grad_weight = torch._scaled_mm(
            g8.t().contiguous(),
            _column_major(h8),
            scale_a=self.grad_inv,
            scale_b=h_inv,
            out_dtype=torch.float32,
        )
        return self.grad_hidden(g8), grad_weight


@contextlib.contextmanager
def patched(variant: str, args: argparse.Namespace) -> Iterator[None]:
    """What `variant` puts in place of flodl's own while it runs: fp8-wgrad's float8 head, and with `+rows`
    bench/loss_kernel.py's Triton pass for the chunked loss's softmax (imported only then: needs Triton)."""
    with contextlib.ExitStack() as stack:
        if variant.partition("+")[0] == "fp8-wgrad":
            stack.enter_context(mock.patch.object(chunked_ce, "_Float8Head", HeadWeightGradInFloat8))
        if variant.endswith("+rows"):
            from bench.loss_kernel import triton_loss_and_grad

            def rows_pass(
                logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
                assert dtype == logits.dtype, "the Triton pass makes the gradient in the logits' dtype"
                return triton_loss_and_grad(logits, targets, args.rows_block, args.rows_warps)

            stack.enter_context(mock.patch.object(chunked_ce, "_loss_and_grad", rows_pass))
        yield


def run(variant: str, shape: dict[str, int], args: argparse.Namespace, device: torch.device) -> Measured:
    model = build(variant, shape, device)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=fused)
    step_fn = torch.compile(model, mode=args.mode) if not args.eager else model
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(shape["vocab"], (args.batch, shape["context"] + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    began = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    sync(device)
    compile_s = time.perf_counter() - began
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if device.type == "cuda":
        end.record()
        end.synchronize()
        step_ms = start.elapsed_time(end) / args.steps
        peak_gb = torch.cuda.max_memory_allocated() / 1e9
    else:
        step_ms = (time.perf_counter() - began) * 1000 / args.steps
        peak_gb = 0.0
    flops = model.train_flops([inputs])
    if args.profile == variant:
        profile(step, device)
    return Measured(
        variant,
        step_ms,
        args.batch / (step_ms / 1000),
        flops / (step_ms / 1000) / BF16_PEAK_FLOPS,
        float(loss),
        peak_gb,
        compile_s,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# Kernel names by kind, first match wins: inductor's triton kernels first, as they are named after every op
# they fuse (a cast feeding a matmul names `_scaled_mm`); then cuBLAS / CUTLASS matmuls, cuDNN / flash
# attention.
KINDS = (
    ("fused", ("triton_",)),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "scaled_mm")),
    ("attention", ("fmha", "flash", "cudnn", "attention")),
    ("optimizer", ("adam",)),
)


def profile(step: object, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        step()  # type: ignore[operator]
        sync(device)
    by_kind: dict[str, float] = {}
    rows = []
    for event in prof.key_averages():
        us = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1000
        rows.append((us / 1000, event.count, event.key[:100]))
    print("profile, ms by kind:", {k: round(v, 2) for k, v in sorted(by_kind.items())})
    for ms, count, name in sorted(rows, reverse=True)[:40]:
        print(f"  {ms:8.2f} ms  x{count:<4d} {name}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--mode", default="default", help="torch.compile's mode")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--profile", default="", help="a variant to profile one step of")
    parser.add_argument("--rows-block", type=int, default=4096, help="+rows: the Triton pass's block")
    parser.add_argument("--rows-warps", type=int, default=16, help="+rows: the Triton pass's warps")
    parser.add_argument("--model", default="gpt2_124m", choices=sorted(set(SHAPES) - {"smoke"}))
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU")
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(v for v in variants if v.removesuffix("+rows") not in VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}, each also +rows")
    if any(v.endswith("+rows") for v in variants) and not SHAPES[args.model]["loss_chunk"]:
        parser.error(f"--variants: +rows patches the chunked loss, which {args.model} does not use")
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = SHAPES["smoke" if args.smoke else args.model]
    if args.smoke:
        args.batch, args.steps, args.warmup = 4, 2, 1
    runs: dict[str, list[Measured]] = {v: [] for v in variants}
    for repeat in range(args.repeat):
        for variant in variants:
            torch._dynamo.reset()
            with patched(variant, args):
                measured = run(variant, shape, args, device)
            runs[variant].append(measured)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            print(f"pass {repeat + 1} {variant}: {measured}; {graphs} graph(s)", flush=True)
    report(runs, args)


def _median_run(measured: list[Measured]) -> Measured:
    """The run whose speed is the median (of an even count, the faster middle one): a run that happened."""
    return sorted(measured, key=lambda m: m.samples_s)[len(measured) // 2]


def report(runs: dict[str, list[Measured]], args: argparse.Namespace) -> None:
    base = _median_run(runs.get("bf16", runs[next(iter(runs))])).samples_s
    lines = [
        f"## float8 recipes on {'a tiny' if args.smoke else args.model + chr(39) + 's'} model "
        f"(bench/float8_scaling.py, {args.repeat} interleaved passes)",
        "",
        *environment_lines(cpu=args.smoke),
        f"- torch.compile mode {args.mode if not args.eager else '(eager)'}, batch {args.batch}, "
        f"{args.steps} timed steps after {args.warmup}",
        "",
        "| variant | samples/s (median) | each pass | vs bf16 | MFU (bf16 peak) | step ms | loss | peak GB "
        "| warm-up s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, measured in runs.items():
        median = _median_run(measured)
        each = " / ".join(f"{m.samples_s:.1f}" for m in measured)
        lines.append(
            f"| {variant} | {median.samples_s:.1f} | {each} | {median.samples_s / base:.3f} | "
            f"{median.mfu:.1%} | {median.step_ms:.1f} | {median.loss:.4f} | {median.peak_gb:.1f} | "
            f"{median.compile_s:.0f} |"
        )
    write_report(results_path(args.results_dir, "float8-scaling", cpu=args.smoke), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
