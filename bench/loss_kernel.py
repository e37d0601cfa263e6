"""The chunked loss's softmax pass alone, on one GPU: inductor's kernel (flodl's today) against a Triton
kernel that reads each row of logits from memory once (issue 43: gpt2_124m's bf16 MFU).

    python bench/loss_kernel.py              # gpt2_124m's chunk, 16,384 x 50,304 bf16; 5 interleaved passes
    python bench/loss_kernel.py --block 4096,8192 --warps 8,16
    TRITON_INTERPRET=1 python bench/loss_kernel.py --smoke    # a tiny chunk on the CPU, Triton's interpreter

The pass takes a chunk's logits (rows, vocabulary) and each row's target, and makes the rows' cross-entropy
and its gradient, softmax - one-hot, in the logits' dtype: `_loss_and_grad` in flodl/tasks/chunked_ce.py,
which torch.compile fuses. On one H200 it took 7.7 ms of gpt2_124m's 119 ms step (2026-12-04's profile),
where one read of the logits and one write of the gradient, 13.2 GB a step, take about 2.8 ms at the
memory's 4.8 TB/s.

`triton` arms: one program a row. The first loop keeps the row's running maximum and sum of exponentials,
block by block; the second reads the row again (from the L2 cache: a row is 100 KB, a wave of rows a few
tens of MB) and writes the gradient. Each arm is a (block, warps) pair. A probe: the kernel moves into
flodl/tasks/ if it pays. Every arm's loss and gradient are checked against the compiled one's first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton
import triton.language as tl

from bench.benchlib import REPO, environment_lines, results_path, write_report
from flodl.tasks.chunked_ce import _loss_and_grad


@triton.jit
def _softmax_rows(
    logits, targets, grad, losses, cols, logits_stride, grad_stride, BLOCK: tl.constexpr
) -> None:
    row = tl.program_id(0).to(tl.int64)
    source = logits + row * logits_stride
    offsets = tl.arange(0, BLOCK)
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, cols, BLOCK):
        x = tl.load(source + start + offsets, mask=start + offsets < cols, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, 0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
        top = new_top
    norm = top + tl.log(total)
    target = tl.load(targets + row)
    tl.store(losses + row, norm - tl.load(source + target).to(tl.float32))
    for start in range(0, cols, BLOCK):
        ids = start + offsets
        x = tl.load(source + ids, mask=ids < cols, other=0.0).to(tl.float32)
        g = tl.exp(x - norm) - (ids == target).to(tl.float32)
        tl.store(grad + row * grad_stride + ids, g.to(grad.dtype.element_ty), mask=ids < cols)


@torch.library.triton_op("flodl_bench::softmax_rows", mutates_args=())
def softmax_rows(
    logits: torch.Tensor, targets: torch.Tensor, block: int, warps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy (float32) and softmax - one-hot in the logits' dtype: an op torch.compile
    keeps whole, the kernel in its graph."""
    rows, cols = logits.shape
    grad = torch.empty_like(logits)
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    torch.library.wrap_triton(_softmax_rows)[(rows,)](
        logits, targets, grad, losses, cols, logits.stride(0), grad.stride(0), BLOCK=block, num_warps=warps
    )
    return losses, grad


def triton_loss_and_grad(
    logits: torch.Tensor, targets: torch.Tensor, block: int, warps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's summed cross-entropy (float32) and softmax - one-hot in the logits' dtype, as
    `_loss_and_grad` makes them."""
    losses, grad = softmax_rows(logits, targets, block, warps)
    return losses.sum(), grad


def check(logits: torch.Tensor, targets: torch.Tensor, block: int, warps: int) -> None:
    """The Triton pass against the plain one in float32: the loss (a sum over the rows, in another order, of
    other exponentials) to 1e-4, the gradient to its bf16 rounding."""
    want_loss, want_grad = _loss_and_grad(logits, targets, torch.float32)
    loss, grad = triton_loss_and_grad(logits, targets, block, warps)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(grad.float(), want_grad, rtol=1e-2, atol=1e-2 * float(want_grad.abs().max()))


def time_ms(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds a call, CUDA events around `repeat` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16384, help="a chunk's tokens (gpt2_124m's loss_chunk)")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--block", default="2048,4096,8192")
    parser.add_argument("--warps", default="8,16")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls timed per arm and pass")
    parser.add_argument("--smoke", action="store_true", help="a tiny chunk on the CPU (Triton's interpreter)")
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    arms = [(int(b), int(w)) for b in args.block.split(",") for w in args.warps.split(",")]
    device = torch.device("cpu" if args.smoke else "cuda")
    rows, vocab = (40, 200) if args.smoke else (args.rows, args.vocab)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device, torch.bfloat16)
    targets = torch.randint(vocab, (rows,), generator=gen).to(device)
    for block, warps in arms:
        check(logits, targets, min(block, 64) if args.smoke else block, warps)
    print(f"every arm's loss and gradient match the plain pass's ({len(arms)} arms)", flush=True)
    if args.smoke:
        return
    compiled = torch.compile(_loss_and_grad)
    calls = {"inductor (flodl today)": lambda: compiled(logits, targets, torch.bfloat16)}
    for block, warps in arms:
        calls[f"triton, block {block}, {warps} warps"] = lambda b=block, w=warps: triton_loss_and_grad(
            logits, targets, b, w
        )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for done in range(args.passes):
        for name, fn in calls.items():
            times[name].append(time_ms(fn, args.calls))
        print(f"pass {done + 1}: " + ", ".join(f"{n} {t[-1]:.3f} ms" for n, t in times.items()), flush=True)
    moved = 2 * logits.numel() * logits.element_size()  # one read of the logits, one write of the gradient
    base = statistics.median(times["inductor (flodl today)"])
    lines = [
        f"## The chunked loss's softmax pass, {rows} x {vocab} bf16 (bench/loss_kernel.py, "
        f"{args.passes} interleaved passes of {args.calls} calls)",
        "",
        *environment_lines(),
        "",
        "| arm | ms (median) | each pass | vs inductor | GB/s (one read, one write) |",
        "|---|---|---|---|---|",
    ]
    for name, each in times.items():
        ms = statistics.median(each)
        lines.append(
            f"| {name} | {ms:.3f} | {' / '.join(f'{t:.3f}' for t in each)} | {base / ms:.2f}x | "
            f"{moved / ms / 1e6:.0f} |"
        )
    write_report(results_path(args.results_dir, "loss-kernel"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
