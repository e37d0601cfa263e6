"""flodl against plain PyTorch, side by side in one run: one command per (model, link) scenario.

    python bench/gpu_suite.py --model gpt_nano                       # NVLink as is
    python bench/gpu_suite.py --model resnet20
    python bench/gpu_suite.py --model gpt_85m --link slow            # NCCL's network transport (~hosts)
    python bench/gpu_suite.py --model gpt_large --quick
    python bench/gpu_suite.py --model resnet20 --repeat 3            # medians of 3 interleaved passes
    python bench/gpu_suite.py --model gpt_nano --cpu-smoke           # tiny model, gloo, a few seconds per arm

Arms: plain torch on 1 GPU and as DDP on 2 (also with torch's bf16 compress hook), both from
bench/plain_torch.py; flodl on 1 GPU; flodl sync / cadence / async on 2 GPUs, with and without bf16_wire
and with rank 1 slowed 1.5x (simulate.slow_rank=1 simulate.factor=1.5). Every arm is its own subprocess
with a timeout; a failed arm is reported as such and the others still run.

The plain 1-GPU arm runs first and sizes everything else: flodl's epochs are made about --epoch-s long
(the synthetic dataset's size sets an epoch's length) and the plain DDP arms about 2 s. flodl's throughput
counts the epochs after the first (start-up, warm-up, ElChe calibration); plain torch's counts the steps
after its 20 warm-up steps, timed with CUDA events. On the slow link the slowed-rank arms are left out
unless --arms names them.

On a shared GPU host throughput moves by up to 10-15% from one run to the next (clocks, neighbours), more
than several of the goals' margins. `--repeat N` measures the chosen arms N times, interleaved (every arm
once per pass), and reports each arm's median run with the range of all N.

Prints the arms and a table of ratios with each goal of issue 9 marked met or missed, and appends both to
bench/results/<date>-suite-<model>-<link>-<hardware>.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchlib import (
    REPO,
    SLOW_LINK_ENV,
    TINY_GPT,
    environment_lines,
    results_path,
    run_child,
    run_flodl,
    steady_throughput,
    write_report,
)

POLICIES = ("sync", "cadence", "async")
GPT_MODELS = ("gpt_nano", "gpt_85m", "gpt_large")
SLOW_FACTOR = 1.5
# Tiny sizes for --cpu-smoke: the same code paths in seconds on a CPU.
SMOKE_OVERRIDES = {
    "gpt": [
        *TINY_GPT,
        "batch_size=4",
    ],
    "resnet20": ["task.model.width=4", "task.model.blocks=1", "batch_size=8"],
}
SMOKE_ARMS = ("torch-1", "torch-ddp-bf16", "flodl-1", "sync", "cadence-bf16", "async-slow")
# --quick: shorter epochs, and of the bf16 arms only flodl sync's (each arm costs ~15 s of start-up).
QUICK_SKIPS = ("torch-ddp-bf16", "cadence-bf16", "async-bf16")


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    nproc: int
    policy: str | None  # None: plain torch
    bf16: bool = False
    slowed: bool = False


ARMS = (
    Arm("torch-1", "plain torch, 1 GPU", 1, None),
    Arm("torch-ddp", "plain torch DDP, 2 GPUs", 2, None),
    Arm("torch-ddp-bf16", "plain torch DDP + bf16 compress hook", 2, None, bf16=True),
    Arm("flodl-1", "flodl, 1 GPU", 1, "sync"),
    *(Arm(p, f"flodl {p}", 2, p) for p in POLICIES),
    *(Arm(f"{p}-bf16", f"flodl {p} + bf16_wire", 2, p, bf16=True) for p in POLICIES),
    *(Arm(f"{p}-slow", f"flodl {p}, rank 1 slowed {SLOW_FACTOR}x", 2, p, slowed=True) for p in POLICIES),
)
ARM_KEYS = tuple(a.key for a in ARMS)


@dataclass
class Settings:
    model: str
    link: str
    cpu: bool
    steps: int | None  # flodl steps per epoch per rank (None: sized from the 1-GPU arm)
    epochs: int  # measured flodl epochs, after `skip` more
    skip: int
    epoch_s: float
    plain_s: float
    plain_warmup: int
    timeout: float
    overrides: list[str]
    # Where each flodl arm's run dir (metrics, logs; no model files) is copied (None: not kept).
    keep_runs: Path | None = None
    # Passes over the chosen arms; with more than one, each arm's median run counts.
    repeat: int = 1

    @property
    def env(self) -> dict[str, str]:
        return dict(SLOW_LINK_ENV) if self.link == "slow" else {}


@dataclass
class Measured:
    samples_per_s: float
    batch_share: float | None = None  # rank 0's share of the batches (flodl 2-GPU arms)
    rounds_per_epoch: float | None = None
    # Every run's throughput, when the arm ran more than once (the plain 1-GPU arm: first and last, and
    # once per pass with --repeat).
    runs: tuple[float, ...] = ()


def batch_size_of(settings: Settings) -> int:
    from plain_torch import load_task

    return int(load_task(settings.model, settings.overrides).batch_size)


def run_plain(arm: Arm, settings: Settings, work: Path, seconds: float | None, steps: int) -> dict | None:
    out = work / f"{arm.key}.json"
    script = str(REPO / "bench" / "plain_torch.py")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={arm.nproc}",
    ]
    args = [*(torchrun if arm.nproc > 1 else [sys.executable]), script]
    args += ["--task", settings.model, "--device", "cpu" if settings.cpu else "cuda", "--out", str(out)]
    args += ["--warmup", str(settings.plain_warmup), "--steps", str(steps)]
    args += [f"--override={o}" for o in settings.overrides]
    if seconds is not None:
        args += ["--seconds", str(seconds)]
    if arm.bf16:
        args.append("--bf16-hook")
    outcome = run_child(args, work, settings.timeout, settings.env)
    if not outcome.ok or not out.exists():
        print(f"FAILED {arm.key}: {' '.join(args)}\n{outcome.out[-8000:]}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def run_plain_arm(arm: Arm, settings: Settings, work: Path, plain_steps: int = 0) -> dict | None:
    """A plain torch arm: the 1-GPU baseline measures about `settings.plain_s`, DDP `plain_steps` steps."""
    if arm.nproc == 1:
        return run_plain(arm, settings, work, seconds=settings.plain_s, steps=0)
    return run_plain(arm, settings, work, seconds=None, steps=plain_steps)


def run_flodl_arm(
    arm: Arm, settings: Settings, work: Path, steps: int, batch_size: int, run_name: str
) -> Measured | None:
    assert arm.policy is not None
    overrides = [
        f"task={settings.model}",
        f"policy={arm.policy}",
        f"launch.nproc_per_node={arm.nproc}",
        f"epochs={settings.skip + settings.epochs}",
        f"task.train_data.samples={steps * batch_size * arm.nproc}",
        f"bf16_wire={str(arm.bf16).lower()}",
        *settings.overrides,
    ]
    if arm.slowed:
        overrides += ["simulate.slow_rank=1", f"simulate.factor={SLOW_FACTOR}"]
    if settings.cpu:
        overrides += ["device=cpu", "launch.start_method=fork"]
    run_dir = work / run_name
    records = run_flodl(overrides, run_dir, settings.timeout, settings.env)
    if records is None:
        return None
    if settings.keep_runs is not None:
        shutil.copytree(run_dir, settings.keep_runs / run_name, ignore=shutil.ignore_patterns("*.pt"))
    steady = records[settings.skip :] or records[-1:]
    measured = Measured(steady_throughput(records, settings.skip, overlapping=arm.policy == "async"))
    if arm.nproc > 1:
        mine = sum(r["per_rank"][0]["batches"] for r in steady)
        measured.batch_share = mine / max(1, sum(p["batches"] for r in steady for p in r["per_rank"]))
        measured.rounds_per_epoch = sum(r["rounds"] for r in steady) / len(steady)
    return measured


def announce(key: str, samples_per_s: float) -> None:
    """Each run as it ends: a suite stopped by a time limit still leaves what it measured."""
    print(f"gpu_suite: {key}: {samples_per_s:,.1f} samples/s", flush=True)


def combine(runs: list[Measured], baseline: bool) -> Measured:
    """One arm's result from its runs: the median run (a real run, not an average of two), or for the
    1-GPU baseline measured only first and last, the faster (the stricter baseline)."""
    ordered = sorted(runs, key=lambda m: m.samples_per_s)
    chosen = ordered[-1] if baseline and len(runs) == 2 else ordered[len(ordered) // 2]  # upper median
    if len(runs) > 1:
        chosen.runs = tuple(m.samples_per_s for m in runs)
    return chosen


def run_arms(settings: Settings, chosen: list[str], work: Path) -> tuple[dict[str, Measured], int]:
    """Every chosen arm, `settings.repeat` passes (the 1-GPU plain arm always, first: it sizes the others,
    and once more at the end); flodl steps per epoch."""
    batch_size = batch_size_of(settings)
    base = run_plain_arm(ARMS[0], settings, work)
    if base is None and settings.steps is None:
        raise SystemExit("gpu_suite: the plain 1-GPU arm failed, so nothing can be sized (see above)")
    step_s = base["step_ms"] / 1000 if base else None
    runs: dict[str, list[Measured]] = {a.key: [] for a in ARMS}
    if base:
        runs["torch-1"].append(Measured(base["samples_per_s"]))
    steps = settings.steps or max(10, round(settings.epoch_s / step_s))
    plain_steps = max(20, round(settings.plain_s / step_s)) if step_s else steps
    print(f"gpu_suite: {settings.model}: {steps} flodl steps per epoch per rank, {plain_steps} plain steps")
    if base:
        announce("torch-1", base["samples_per_s"])
    for rep in range(settings.repeat):
        for arm in ARMS[1 if rep == 0 else 0 :]:
            if arm.key not in chosen and arm.key != "torch-1":
                continue
            print(f"gpu_suite: pass {rep + 1}/{settings.repeat}, arm {arm.key} ...", flush=True)
            if arm.policy is None:
                plain = run_plain_arm(arm, settings, work, plain_steps)
                measured = Measured(plain["samples_per_s"]) if plain else None
            else:
                name = arm.key if rep == 0 else f"{arm.key}-{rep + 1}"
                measured = run_flodl_arm(arm, settings, work, steps, batch_size, name)
            if measured is not None:
                runs[arm.key].append(measured)
                announce(arm.key, measured.samples_per_s)
    # The 1-GPU baseline once more, after the other arms: a cold first run would flatter every ratio.
    again = run_plain_arm(ARMS[0], settings, work)
    if again:
        runs["torch-1"].append(Measured(again["samples_per_s"]))
        announce("torch-1", again["samples_per_s"])
    results = {key: combine(found, key == "torch-1") for key, found in runs.items() if found}
    return results, steps


@dataclass
class Ratio:
    measure: str
    value: float | None
    goal: float | None = None  # None: shown for reference, no goal in this scenario
    at_most: bool = False

    def verdict(self) -> str:
        if self.goal is None:
            return "(reference)"
        if self.value is None:
            return "not measured (arm failed or not run)"
        met = self.value <= self.goal if self.at_most else self.value >= self.goal
        return "met" if met else "**MISSED**"

    def row(self) -> str:
        value = "—" if self.value is None else f"{self.value:.3f}"
        goal = "—" if self.goal is None else f"{'≤' if self.at_most else '≥'} {self.goal}"
        return f"| {self.measure} | {value} | {goal} | {self.verdict()} |"


def ratios(results: dict[str, Measured], settings: Settings) -> list[Ratio]:
    def thr(key: str) -> float | None:
        return results[key].samples_per_s if key in results else None

    def over(a: float | None, b: float | None, scale: float = 1.0) -> float | None:
        return None if a is None or b is None else a / (scale * b)

    nvlink = settings.link == "nvlink"
    small = settings.model in ("gpt_nano", "resnet20")
    rows = [
        Ratio("flodl sync / plain DDP", over(thr("sync"), thr("torch-ddp")), 0.98),
        Ratio(
            "flodl sync + bf16_wire / plain DDP + bf16 hook", over(thr("sync-bf16"), thr("torch-ddp-bf16"))
        ),
        Ratio("flodl 1 GPU / plain torch 1 GPU", over(thr("flodl-1"), thr("torch-1")), 0.97),
    ]
    for key in ("torch-ddp", "torch-ddp-bf16", *POLICIES, *(f"{p}-bf16" for p in POLICIES)):
        goal = 0.95 if nvlink and small and key in ("cadence", "async") else None
        rows.append(Ratio(f"scaling efficiency: {key}", over(thr(key), thr("torch-1"), 2.0), goal))
    for policy in ("cadence", "async"):
        slowed = over(thr(f"{policy}-slow"), thr("sync-slow"))
        rows.append(Ratio(f"rank 1 slowed {SLOW_FACTOR}x: {policy} / sync", slowed, 1.3))
    flodl_2 = [over(thr(k), thr("torch-1"), 2.0) for k in (*POLICIES, *(f"{p}-bf16" for p in POLICIES))]
    best = max((v for v in flodl_2 if v is not None), default=None)
    slow_goal = 0.90 if settings.link == "slow" and settings.model == "gpt_85m" else None
    rows.append(Ratio(f"best flodl scaling efficiency ({settings.link} link)", best, slow_goal))
    for policy in POLICIES:
        rows.append(
            Ratio(
                f"bf16_wire / fp32: {policy}",
                over(thr(f"{policy}-bf16"), thr(policy)),
                0.98 if nvlink else None,
            )
        )
    return [r for r in rows if r.value is not None or r.goal is not None]


def report(results: dict[str, Measured], settings: Settings, steps: int, command: str) -> str:
    from plain_torch import load_task

    tokens = settings.model in GPT_MODELS
    context = int(load_task(settings.model, settings.overrides).task.model.context) if tokens else 0
    base = results.get("torch-1")
    lines = [
        f"# GPU suite: {settings.model}, {settings.link} link",
        "",
        *environment_lines(settings.cpu),
        f"- command: `{command}`",
        f"- flodl: {steps} steps per epoch per rank, {settings.skip} warm-up + {settings.epochs} measured "
        f"epochs; overrides: `{' '.join(settings.overrides) or '(none)'}`",
        f"- link: {settings.link}"
        + (f" ({' '.join(f'{k}={v}' for k, v in settings.env.items())})" if settings.env else ""),
        "",
        f"| arm | samples/s |{' tokens/s |' if tokens else ''} scaling efficiency | rank 0 batch share "
        "| rounds/epoch | runs (samples/s) |",
        f"|---|---|{'---|' if tokens else ''}---|---|---|---|",
    ]
    for arm in ARMS:
        if arm.key not in results:
            continue
        m = results[arm.key]
        eff = f"{m.samples_per_s / (arm.nproc * base.samples_per_s):.3f}" if base and arm.nproc > 1 else "—"
        share = "—" if m.batch_share is None else f"{m.batch_share:.3f}"
        rounds = "—" if m.rounds_per_epoch is None else f"{m.rounds_per_epoch:.1f}"
        tok = f" {m.samples_per_s * context:,.0f} |" if tokens else ""
        every = ", ".join(f"{r:,.0f}" for r in m.runs) or "—"
        lines.append(f"| {arm.label} | {m.samples_per_s:,.1f} |{tok} {eff} | {share} | {rounds} | {every} |")
    missing = [a.key for a in ARMS if a.key not in results]
    lines += [
        "",
        "scaling efficiency = 2-GPU throughput / (2 x plain torch 1-GPU throughput)."
        + (
            f" Every arm ran {settings.repeat} times, interleaved (the 1-GPU arm also first and last); "
            "each arm's median run counts."
            if settings.repeat > 1
            else " The 1-GPU arm ran first and last; the faster is the baseline."
        )
        + (f" Not in this run (failed or not chosen): {', '.join(missing)}." if missing else ""),
        "",
        "| measure | value | goal (issue 9) | verdict |",
        "|---|---|---|---|",
        *(r.row() for r in ratios(results, settings)),
        "",
        f"With rank 1 at 1/{SLOW_FACTOR} of the speed, sync runs both ranks at the slow one's pace and local "
        f"SGD each at its own: (1 + 1/{SLOW_FACTOR}) / (2/{SLOW_FACTOR}) = "
        f"{(1 + 1 / SLOW_FACTOR) / (2 / SLOW_FACTOR):.2f} if sync's all-reduce were free; its share of "
        "sync's step raises the ceiling by the ratio of sync's step time to its compute time.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", choices=("gpt_nano", "resnet20", "gpt_85m", "gpt_large"), default="gpt_nano"
    )
    parser.add_argument("--link", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument(
        "--steps", type=int, default=None, help="flodl steps per epoch per rank (default: sized)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="measured flodl epochs (default 2)")
    parser.add_argument(
        "--epoch-s", type=float, default=None, help="target epoch length (default 1.5, quick 1.0)"
    )
    parser.add_argument(
        "--arms", default=None, help=f"comma-separated subset or 'all' of: {','.join(ARM_KEYS)}"
    )
    parser.add_argument("--quick", action="store_true", help="shorter epochs, fewer bf16 arms")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny model on CPU (gloo): checks the pipeline"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per arm (default 600, smoke 120)"
    )
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--keep-runs", type=Path, default=None, help="copy each flodl arm's run dir (no model files) here"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="passes over the arms, interleaved; medians count (default 1)"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every arm (after --)")
    args = parser.parse_args()

    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} passes; give 1 or more")
    if args.arms in (None, ""):
        default = SMOKE_ARMS if args.cpu_smoke else ARM_KEYS
        default = [k for k in default if not (args.quick and k in QUICK_SKIPS)]
        # Between hosts the slowed-rank question is secondary to the link itself: those arms are opt-in there.
        chosen = [k for k in default if not (args.link == "slow" and k.endswith("-slow"))]
    else:
        chosen = list(ARM_KEYS) if args.arms == "all" else args.arms.split(",")
        unknown = set(chosen) - set(ARM_KEYS)
        if unknown:
            parser.error(f"--arms: unknown {sorted(unknown)}; known: {', '.join(ARM_KEYS)}")
    overrides = list(args.overrides)
    if args.cpu_smoke:
        overrides = SMOKE_OVERRIDES["resnet20" if args.model == "resnet20" else "gpt"] + overrides
    settings = Settings(
        model=args.model,
        link=args.link,
        cpu=args.cpu_smoke,
        steps=args.steps or (3 if args.cpu_smoke else None),
        epochs=args.epochs or (1 if args.cpu_smoke else 2),
        skip=1,
        epoch_s=args.epoch_s or (1.0 if args.quick else 1.5),
        # The plain 1-GPU arm measures about as long as a flodl epoch (short runs are the noisiest).
        plain_s=0.3 if args.cpu_smoke else max(1.0 if args.quick else 2.0, args.epoch_s or 0.0),
        plain_warmup=2 if args.cpu_smoke else 20,
        timeout=args.timeout or (120 if args.cpu_smoke else 600),
        overrides=overrides,
        keep_runs=args.keep_runs,
        repeat=args.repeat,
    )
    with tempfile.TemporaryDirectory(prefix="flodl-suite-") as tmp:
        results, steps = run_arms(settings, chosen, Path(tmp))
    command = " ".join(["python", *sys.argv])
    text = report(results, settings, steps, command)
    write_report(results_path(args.results_dir, f"suite-{args.model}-{args.link}", args.cpu_smoke), text)


if __name__ == "__main__":
    main()
