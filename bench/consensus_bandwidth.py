"""Bus bandwidth of one consensus round against a plain all-reduce of the same bytes, in one run.

    torchrun --standalone --nproc_per_node=2 bench/consensus_bandwidth.py
    torchrun --standalone --nproc_per_node=2 bench/consensus_bandwidth.py --profile 10M   # + where it goes

For each model size it times, on the same ranks and tensors: a plain NCCL all-reduce of the flat
parameters; a device-backend round as flodl runs it, with the pre-reduce copy and divergence the
guard reads (guarded) and without them (lean), each also dispatched op by op instead of replayed from a
CUDA graph (eager) and with its totals sent first (the float64 all-reduce read on the host before the
payload); a bf16-wire round; and the cpu backend's round trip (snapshot, gloo reduce, staged consensus).
Bus bandwidth = bytes x 2(W-1)/W / time. Rank 0 prints a table and appends it to bench/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from flodl.averaging.consensus import DeviceAverager, HostAverager
from flodl.averaging.wire import BF16

SIZES = {"10M": (1448, 5), "120M": (3872, 8)}  # (width, layers) of a bias-free Linear stack
WARMUP, ITERS = 5, 20


def model_of(width: int, layers: int, device: torch.device) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)


def timed(fn: Callable[[], None], device: torch.device, warmup: int = WARMUP, iters: int = ITERS) -> float:
    """Median seconds of `fn` over `iters` runs, each fenced by device synchronisation."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def one_round(averager: DeviceAverager | HostAverager) -> Callable[[], None]:
    def run() -> None:
        averager.begin(steps=4)
        averager.finish()
        averager.adopt(None, None)

    return run


def profile_round(run: Callable[[], None], label: str) -> str:
    """torch profiler table of a few rounds: which kernels and host calls a round's time goes to."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUP):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=48)
    return f"Profile of {ITERS} rounds: {label}\n\n```\n{table}\n```\n"


def device_averager(width: int, layers: int, device: torch.device, **tuning: object) -> DeviceAverager:
    """A DeviceAverager; `keeps_own=False` makes it lean, the rest tunes its Reducer."""
    keeps_own = bool(tuning.pop("keeps_own", True))
    averager = DeviceAverager(model_of(width, layers, device), 1.0, device, keeps_own=keeps_own)
    for key, value in tuning.items():
        setattr(averager.reducer, key, value)
    return averager


def measure(averager: DeviceAverager, how: Callable[[Callable[[], None]], object]) -> object:
    """`how(one round)`, then free what the averager holds for the process group."""
    try:
        return how(one_round(averager))
    finally:
        averager.release()


VARIANTS = {  # column -> DeviceAverager tuning
    "guarded": {},
    "guarded, eager": {"capture_after": None},
    "guarded, totals first": {"weights_on_device": False},
    "lean": {"keeps_own": False},
    "lean, eager": {"keeps_own": False, "capture_after": None},
    "lean, totals first": {"keeps_own": False, "weights_on_device": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=tuple(SIZES), help="also profile this size's guarded round")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    gloo = dist.new_group(backend="gloo")
    world = dist.get_world_size()
    bus = 2 * (world - 1) / world
    rows, profiles = [], []
    for name, (width, layers) in SIZES.items():
        numel = width * width * layers
        nbytes = numel * 4
        flat = torch.randn(numel, device=device)
        plain = timed(lambda flat=flat: dist.all_reduce(flat), device)

        rounds = {
            label: measure(
                device_averager(width, layers, device, **dict(tuning)), lambda run: timed(run, device)
            )
            for label, tuning in VARIANTS.items()
        }
        bf16_model = model_of(width, layers, device)
        bf16 = timed(one_round(DeviceAverager(bf16_model, 1.0, device, wire=BF16)), device)
        # Seconds per round over gloo: a few rounds tell its round trip.
        host = HostAverager(model_of(width, layers, device), 1.0, device, gloo)
        host_s = timed(one_round(host), device, warmup=1, iters=5)
        if args.profile == name:
            for label in ("guarded", "lean", "lean, totals first"):
                profiles.append(
                    measure(
                        device_averager(width, layers, device, **dict(VARIANTS[label])),
                        lambda run, title=f"{name} {label}": profile_round(run, title),
                    )
                )
            profiles.append(
                profile_round(lambda flat=flat: dist.all_reduce(flat), f"{name} plain all-reduce")
            )
        rows.append((name, numel, nbytes, plain, rounds, bf16, host_s))
        del flat
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        report(rows, world, bus, profiles)
    dist.destroy_process_group()


def report(rows: list[tuple], world: int, bus: float, profiles: list[str]) -> None:
    lines = [
        f"# Consensus round bandwidth — {dt.date.today()}",
        "",
        f"- hardware: {world}x {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
        f"- bus bandwidth = fp32 parameter bytes x 2(W-1)/W / median time of {ITERS} rounds (after {WARMUP} "
        "warm-up); each round's ratio is its bus bandwidth over the plain all-reduce's",
        "",
        "| model | params | plain all-reduce GB/s | "
        + " | ".join(f"{label} GB/s (ratio)" for label in VARIANTS)
        + " | bf16 wire ms | cpu backend round trip ms (median of 5) |",
        "|---|---|---|" + "---|" * (len(VARIANTS) + 2),
    ]
    for name, numel, nbytes, plain, rounds, bf16, host_s in rows:
        plain_gbs = nbytes * bus / plain / 1e9
        cells = " | ".join(f"{nbytes * bus / t / 1e9:.0f} ({plain / t:.2f})" for t in rounds.values())
        times = f"{bf16 * 1e3:.2f} | {host_s * 1e3:.1f}"
        lines.append(f"| {name} | {numel / 1e6:.1f}M | {plain_gbs:.0f} | {cells} | {times} |")
    lines += [
        "",
        "guarded: the default cadence/async round (pre-reduce copy + divergence for the guard; over "
        "128 MiB in chunks of at least 64 MiB, the guard's work on one chunk overlapping the next chunk's "
        "transfer); lean: `divergence_guard=none` without EASGD. Under 128 MiB a round gets its weights "
        "on the device (no host read before the payload) and, after 2 eager rounds, is replayed as one CUDA "
        "graph (eager: never captured). Totals first: the round's float64 totals all-reduced and read on "
        "the host before the payload (what flodl does for larger models, the cpu backend, bf16_wire and "
        "exact rounds).",
        "",
        *profiles,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    tag = f"{world}x-{torch.cuda.get_device_name(0)}".replace(" ", "-")
    out = Path(__file__).resolve().parent / "results" / f"{dt.date.today()}-consensus-bandwidth-{tag}.md"
    with out.open("a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
