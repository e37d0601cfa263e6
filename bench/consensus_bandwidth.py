"""Bus bandwidth of one consensus round against a plain all-reduce of the same bytes, in one run.

    torchrun --standalone --nproc_per_node=2 bench/consensus_bandwidth.py
    torchrun --standalone --nproc_per_node=2 bench/consensus_bandwidth.py --profile 10M   # + where it goes

For each model size it times, on the same ranks and tensors: a plain NCCL all-reduce of the flat
parameters; a device-backend round with the pre-reduce copy and divergence triple the guard reads
(pipelined in chunks as flodl runs it, and in one piece for comparison) and without them (lean); a
bf16-wire round; and the cpu backend's round trip (snapshot, gloo reduce, staged consensus).
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
from torch import Tensor, nn

from flodl.averaging.consensus import DeviceAverager, HostAverager

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


def factor_paths(flat: Tensor, device: torch.device) -> dict[str, float]:
    """Bare collectives on one flat tensor, for the three ways a weighted round can get its factor:
    host: all-reduce the totals, read them, PreMulSum with a host scalar (what flodl runs);
    device: divide the factor out on the device, PreMulSum reads it from device memory (no host read);
    folded: the totals ride as the last elements of the one all-reduce (each rank scales by its own mass,
    known locally), then one pass divides by the summed mass (no host read, no second collective)."""
    mass, steps = 4.0, 4.0
    own = torch.tensor([mass, 1.0, steps], dtype=torch.float64, device=device)

    def host() -> None:
        totals = own.clone()
        dist.all_reduce(totals)
        factor = mass / totals.tolist()[0]
        dist.all_reduce(flat, op=dist._make_nccl_premul_sum(factor))

    def on_device() -> None:
        totals = own.clone()
        dist.all_reduce(totals)
        factor = (own[:1] / totals[:1]).float()
        dist.all_reduce(flat, op=dist._make_nccl_premul_sum(factor))

    folded_flat = torch.empty(flat.numel() + 3, device=device)
    tail = torch.tensor([1.0, 1.0 / mass, steps / mass], device=device)

    def folded() -> None:
        folded_flat[-3:].copy_(tail)
        dist.all_reduce(folded_flat, op=dist._make_nccl_premul_sum(mass))
        folded_flat[:-3].div_(folded_flat[-3])

    return {"host": timed(host, device), "device": timed(on_device, device), "folded": timed(folded, device)}


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

        full = timed(one_round(DeviceAverager(model_of(width, layers, device), 1.0, device)), device)
        whole_averager = DeviceAverager(model_of(width, layers, device), 1.0, device)
        whole_averager.reducer.chunks = 1
        whole = timed(one_round(whole_averager), device)
        lean_model = model_of(width, layers, device)
        lean = timed(one_round(DeviceAverager(lean_model, 1.0, device, keeps_own=False)), device)
        bf16_model = model_of(width, layers, device)
        bf16 = timed(one_round(DeviceAverager(bf16_model, 1.0, device, bf16_wire=True)), device)
        # Seconds per round over gloo: a few rounds tell its round trip.
        host = HostAverager(model_of(width, layers, device), 1.0, device, gloo)
        host_s = timed(one_round(host), device, warmup=1, iters=5)
        paths = factor_paths(flat, device)
        if args.profile == name:
            guarded = one_round(DeviceAverager(model_of(width, layers, device), 1.0, device))
            profiles.append(profile_round(guarded, f"{name} guarded"))
            profiles.append(
                profile_round(lambda flat=flat: dist.all_reduce(flat), f"{name} plain all-reduce")
            )
        rows.append((name, numel, nbytes, plain, full, whole, lean, bf16, host_s, paths))
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
        "- bus bandwidth = fp32 parameter bytes x 2(W-1)/W / median time of 20 rounds (after 5 warm-up)",
        "",
        "| model | params | plain all-reduce GB/s | round (guarded) GB/s | ratio | guarded, one piece GB/s "
        "| ratio | round (lean) GB/s | ratio | bf16 wire ms | cpu backend round trip ms (median of 5) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, numel, nbytes, plain, full, whole, lean, bf16, host_s, _ in rows:
        gbs = [nbytes * bus / t / 1e9 for t in (plain, full, whole, lean)]
        cells = " | ".join(f"{g:.0f} | {g / gbs[0]:.2f}" for g in gbs[1:])
        times = f"{bf16 * 1e3:.2f} | {host_s * 1e3:.1f}"
        lines.append(f"| {name} | {numel / 1e6:.1f}M | {gbs[0]:.0f} | {cells} | {times} |")
    lines += [
        "",
        "guarded: the default cadence/async round (pre-reduce copy + divergence triple for the guard), "
        "reduced in chunks with the guard's work on one chunk overlapping the next chunk's transfer; one "
        "piece: the same without chunks; lean: `no_divergence_guard=true` without EASGD (the two "
        "all-reduces only).",
        "",
        "Factor paths, bare collectives on the same tensor (ms, and plain all-reduce time / path time):",
        "",
        "| model | plain ms | host read | device factor | folded totals |",
        "|---|---|---|---|---|",
    ]
    for name, _, _, plain, *_, paths in rows:
        cells = " | ".join(
            f"{paths[k] * 1e3:.3f} ({plain / paths[k]:.2f})" for k in ("host", "device", "folded")
        )
        lines.append(f"| {name} | {plain * 1e3:.3f} | {cells} |")
    lines += ["", *profiles]
    text = "\n".join(lines) + "\n"
    print(text)
    tag = f"{world}x-{torch.cuda.get_device_name(0)}".replace(" ", "-")
    out = Path(__file__).resolve().parent / "results" / f"{dt.date.today()}-consensus-bandwidth-{tag}.md"
    with out.open("a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
