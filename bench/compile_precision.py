"""compile=true, its modes and precision=bf16 on the device, as ratios measured in one run (issues 20, 29).

    python bench/compile_precision.py                  # ResNet-20 and GPT-nano, 3 interleaved passes
    python bench/compile_precision.py --models gpt2_small --arms torch-default,torch-reduce-overhead,\
        flodl-eager,flodl-compile,flodl-reduce-overhead   # MFU of the GPT-2-class task, flodl against torch
    python bench/compile_precision.py --quick          # one pass, shorter epochs (~8 min on 2x H200)
    python bench/compile_precision.py --models resnet20 --repeat 5
    python bench/compile_precision.py --smoke          # tiny models on CPU (gloo): checks the pipeline
    python bench/compile_precision.py --models gpt2_124m --arms torch-reduce-overhead,flodl-bf16,flodl-fp8 \
        --steps 16 -- eval_every=0                     # issue 43: MFU in the GPT's own mode, fp8 against bf16

Arms, per model (each its own subprocess with a timeout; a failed arm is reported as such):
- `torch-eager`, `torch-compile`: bench/plain_torch.py on 1 GPU, eager and `torch.compile`d (the warm-up
  holds the compilation); the eager arm runs first and sizes the flodl epochs (about --epoch-s long).
- `flodl-eager`, `flodl-compile`: flodl on 1 GPU, without and with `compile=true` (compile_mode=default).
- `torch-<mode>`, `flodl-<mode>` for each other compile mode (`reduce-overhead`: CUDA graphs;
  `max-autotune`: tuned kernels and CUDA graphs, a long compilation; `max-autotune-no-cudagraphs`).
- `flodl-fp32`, `flodl-bf16`, `flodl-fp8`: flodl on 1 GPU with `precision=fp32` / `bf16` / `fp8` (float8
  linears; its MFU still counts against the bf16 peak), and fp8's last-epoch loss against bf16's. The GPT
  configs autocast inside the model (`task.model.amp`); these arms turn that off so that `precision`
  decides.
  On ResNet-20 the fp32 arm is `flodl-eager` itself.
- `pair-compile`: two independent `compile=true` flodl runs on 1 GPU each (CUDA_VISIBLE_DEVICES 0 and 1),
  started together: the sum of their throughputs is what two GPUs give without averaging.
- `cadence-compile`, `async-compile`: flodl on 2 GPUs with `compile=true`.

flodl's throughput counts the epochs after the first; the first epoch's compilation is reported apart
(the `compile s` column: metrics.jsonl's compile_s). plain torch's counts the steps after its warm-up,
timed with CUDA events. With --repeat N every arm runs N times, interleaved (every arm once per pass), and
its median run counts. --steps fixes flodl's steps per epoch (otherwise the eager torch arm, run first,
sizes them). Prints each model's tables once measured and appends them to
bench/results/<date>-compile-precision-<hardware>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchlib import (
    REPO,
    TINY_GPT,
    environment_lines,
    results_path,
    run_child,
    run_flodl,
    steady_throughput,
    write_report,
)
from gpu_suite import Ratio
from plain_torch import load_task

MODELS = ("resnet20", "gpt_nano", "gpt2_small", "gpt2_124m")
# torch.compile's modes beyond the default, each an arm of its own on both sides.
MODES = ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# --smoke: the same code paths in seconds on a CPU.
SMOKE_OVERRIDES = {
    "resnet20": ("task.model.width=4", "task.model.blocks=1", "batch_size=8"),
    "gpt_nano": (
        *TINY_GPT,
        "batch_size=4",
    ),
    "gpt2_small": (
        *TINY_GPT,
        "batch_size=4",
        "grad_accum=2",
        "task.optimizer.fused=false",
    ),
    "gpt2_124m": (
        *TINY_GPT,
        "task.model.vocab=384",
        "task.model.loss_chunk=64",
        "task.train_data.vocab_size=300",
        "task.train_data.tokenizer_bytes=200000",
        "task.eval_data.max_bytes=100000",
        "batch_size=4",
        "task.optimizer.fused=false",
    ),
}
# MFU goals (issues 29, 43), against the device's dense bf16 peak.
MFU_GOALS = {"gpt2_small": 0.45, "gpt2_124m": 0.50}
# flodl against plain torch in the mode the task runs in by default (issue 43).
SAME_MODE_GOALS = {"gpt2_124m": 0.99}
# Let flodl's precision decide (the GPT configs autocast to bf16 inside the model by default).
MODEL_AMP_OFF = {
    "resnet20": (),
    "gpt_nano": ("task.model.amp=false",),
    "gpt2_small": ("task.model.amp=false",),
    "gpt2_124m": ("task.model.amp=false",),
}


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    nproc: int  # GPUs
    policy: str | None  # None: plain torch
    overrides: tuple[str, ...] = ()
    pair: bool = False  # two independent 1-GPU runs at once
    amp_off: bool = False  # the model's own autocast off


ARMS = (
    Arm("torch-eager", "plain torch, 1 GPU, eager", 1, None),
    Arm("torch-compile", "plain torch, 1 GPU, torch.compile", 1, None, ("--compile",)),
    *(
        Arm(
            f"torch-{m}",
            f"plain torch, 1 GPU, torch.compile mode={m}",
            1,
            None,
            ("--compile", f"--compile-mode={m}"),
        )
        for m in MODES
    ),
    Arm("flodl-eager", "flodl, 1 GPU, eager", 1, "sync", ("compile=false",)),
    Arm("flodl-compile", "flodl, 1 GPU, compile=true", 1, "sync", ("compile=true", "compile_mode=default")),
    *(
        Arm(
            f"flodl-{m}",
            f"flodl, 1 GPU, compile=true compile_mode={m}",
            1,
            "sync",
            ("compile=true", f"compile_mode={m}"),
        )
        for m in MODES
    ),
    Arm("flodl-fp32", "flodl, 1 GPU, precision=fp32", 1, "sync", ("precision=fp32",), amp_off=True),
    Arm("flodl-bf16", "flodl, 1 GPU, precision=bf16", 1, "sync", ("precision=bf16",), amp_off=True),
    Arm("flodl-fp8", "flodl, 1 GPU, precision=fp8", 1, "sync", ("precision=fp8",), amp_off=True),
    Arm(
        "pair-compile",
        "2 independent flodl runs, 1 GPU each, compile=true",
        2,
        "sync",
        ("compile=true",),
        pair=True,
    ),
    Arm("cadence-compile", "flodl cadence, 2 GPUs, compile=true", 2, "cadence", ("compile=true",)),
    Arm("async-compile", "flodl async, 2 GPUs, compile=true", 2, "async", ("compile=true",)),
)
ARM_KEYS = tuple(a.key for a in ARMS)
# A reference only, and a compilation of its own; the long ones are asked for by name (--arms).
QUICK_SKIPS = ("torch-compile",)
NAMED_ONLY = tuple(f"{side}-{m}" for side in ("torch", "flodl") for m in MODES[1:])


@dataclass
class Settings:
    cpu: bool
    steps: int | None  # flodl steps per epoch per rank (None: sized from the eager torch arm)
    epochs: int  # measured flodl epochs, after one more
    epoch_s: float
    plain_s: float
    plain_warmup: int
    timeout: float
    repeat: int
    overrides: tuple[str, ...]


@dataclass
class Run:
    samples_per_s: float
    compile_s: float | None = None
    # flodl's model FLOPs utilisation over the measured epochs (None: not known there).
    mfu: float | None = None
    # flodl's training loss over its last epoch (None: plain torch's, not compared).
    loss: float | None = None


def model_overrides(arm: Arm, model: str, settings: Settings) -> list[str]:
    smoke = SMOKE_OVERRIDES[model] if settings.cpu else ()
    return [*smoke, *(MODEL_AMP_OFF[model] if arm.amp_off else ()), *settings.overrides]


def run_plain(arm: Arm, model: str, settings: Settings, work: Path, name: str) -> dict | None:
    out = work / f"{name}.json"
    args = [sys.executable, str(REPO / "bench" / "plain_torch.py"), "--task", model, "--out", str(out)]
    args += ["--device", "cpu" if settings.cpu else "cuda", "--warmup", str(settings.plain_warmup)]
    args += ["--seconds", str(settings.plain_s), *arm.overrides]
    args += [f"--override={o}" for o in model_overrides(arm, model, settings)]
    outcome = run_child(args, work, settings.timeout)
    if not outcome.ok or not out.exists():
        print(f"FAILED {name}: {' '.join(args)}\n{outcome.out[-4000:]}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def run_flodl_arm(
    arm: Arm, model: str, settings: Settings, work: Path, name: str, samples: int
) -> Run | None:
    assert arm.policy is not None
    nproc = 1 if arm.pair else arm.nproc
    overrides = [
        f"task={model}",
        f"policy={arm.policy}",
        f"launch.nproc_per_node={nproc}",
        f"epochs={1 + settings.epochs}",
        # The same work as plain torch's loop: no checkpoint (flodl's default writes one every epoch).
        "checkpoint_every=null",
        data_size(model, samples * nproc),
        *arm.overrides,
        *model_overrides(arm, model, settings),
    ]
    if settings.cpu:
        overrides += ["device=cpu", "launch.start_method=fork"]

    def one(run_dir: Path, env: dict[str, str] | None) -> Run | None:
        records = run_flodl(overrides, run_dir, settings.timeout, env)
        if records is None:
            return None
        # Async has no epoch barrier: its throughput comes from the ranks' own clocks (issue 18).
        rate = steady_throughput(records, skip=1, overlapping=arm.policy == "async")
        last = records[-1]
        mfu = rate * last["mfu"] / last["samples_per_s"] if last.get("mfu") else None
        return Run(rate, records[0]["compile_s"], mfu, last["loss"])

    if not arm.pair:
        return one(work / name, None)
    envs = [None, None] if settings.cpu else [{"CUDA_VISIBLE_DEVICES": str(gpu)} for gpu in (0, 1)]
    with ThreadPoolExecutor(2) as pool:  # both start together: they share the host as a 2-GPU run does
        both = list(pool.map(one, [work / f"{name}-a", work / f"{name}-b"], envs))
    done = [r for r in both if r is not None]
    if len(done) < 2:
        return None
    return Run(sum(r.samples_per_s for r in done), max(r.compile_s or 0.0 for r in done))


def data_size(model: str, samples: int) -> str:
    """The override that makes `model`'s training set `samples` samples long."""
    if model == "gpt2_small":  # the stdlib corpus: windows of `context` bytes
        context = int(load_task(model, []).task.model.context)
        return f"task.train_data.max_bytes={samples * context + 1}"
    if model == "gpt2_124m":  # BPE tokens: GPT-2's ~3.5 bytes of this text a token, with room to spare
        context = int(load_task(model, []).task.model.context)
        return f"task.train_data.max_bytes={samples * context * 5}"
    return f"task.train_data.samples={samples}"


def median(runs: list[Run]) -> Run:
    """The median run (a real run, not an average of two)."""
    return sorted(runs, key=lambda r: r.samples_per_s)[len(runs) // 2]


def measure(
    model: str, settings: Settings, chosen: list[str], work: Path
) -> tuple[dict[str, list[Run]], int]:
    """Every chosen arm of `model`, `settings.repeat` passes; flodl steps per epoch per rank."""
    runs: dict[str, list[Run]] = {key: [] for key in ARM_KEYS}
    eager = ARMS[0]
    # The eager torch arm sizes the flodl epochs unless --steps did.
    sized = settings.steps is None or eager.key in chosen
    base = run_plain(eager, model, settings, work, f"{model}-torch-eager") if sized else None
    if base is None and settings.steps is None:
        raise SystemExit(f"compile_precision: {model}: the eager torch arm failed, nothing can be sized")
    steps = settings.steps or max(10, round(settings.epoch_s * 1000 / base["step_ms"]))  # type: ignore[index]
    if base:
        runs[eager.key].append(Run(base["samples_per_s"]))
    task = load_task(model, model_overrides(eager, model, settings))
    batch_size = int(task.batch_size) * int(task.get("grad_accum", 1))  # samples per optimizer step
    print(f"compile_precision: {model}: {steps} flodl steps per epoch per rank", flush=True)
    for rep in range(settings.repeat):
        for arm in ARMS:
            if arm.key not in chosen or (arm is eager and rep == 0):
                continue
            if arm.key == "flodl-fp32" and not MODEL_AMP_OFF[model]:
                continue  # the same run as flodl-eager
            name = f"{model}-{arm.key}-{rep + 1}"
            print(f"compile_precision: {model}: pass {rep + 1}/{settings.repeat}, {arm.key} ...", flush=True)
            if arm.policy is None:
                plain = run_plain(arm, model, settings, work, name)
                run = Run(plain["samples_per_s"]) if plain else None
            else:
                run = run_flodl_arm(arm, model, settings, work, name, steps * batch_size)
            if run is not None:
                runs[arm.key].append(run)
                print(
                    f"compile_precision: {model}: {arm.key}: {run.samples_per_s:,.1f} samples/s", flush=True
                )
    return {k: v for k, v in runs.items() if v}, steps


def ratios(model: str, results: dict[str, Run]) -> list[Ratio]:
    def over(a: str, b: str) -> float | None:
        if a not in results or b not in results:
            return None
        return results[a].samples_per_s / results[b].samples_per_s

    fp32 = "flodl-fp32" if MODEL_AMP_OFF[model] else "flodl-eager"
    rows = [
        Ratio(
            "flodl compiled / plain torch eager, 1 GPU",
            over("flodl-compile", "torch-eager"),
            1.2 if model == "resnet20" else None,
        ),
        Ratio("flodl compiled / plain torch compiled, 1 GPU", over("flodl-compile", "torch-compile"), 0.98),
        Ratio("flodl eager / plain torch eager, 1 GPU", over("flodl-eager", "torch-eager")),
        Ratio("compile=true / eager, flodl 1 GPU", over("flodl-compile", "flodl-eager")),
        Ratio(
            "cadence compiled, 2 GPUs / 2 independent compiled 1-GPU runs",
            over("cadence-compile", "pair-compile"),
            0.95,
        ),
        Ratio(
            "async compiled, 2 GPUs / 2 independent compiled 1-GPU runs",
            over("async-compile", "pair-compile"),
        ),
        Ratio("precision=bf16 / fp32, flodl 1 GPU", over("flodl-bf16", fp32)),
        Ratio("precision=fp8 / bf16, flodl 1 GPU", over("flodl-fp8", "flodl-bf16"), 1.15),
        Ratio(
            "|fp8 loss / bf16 loss - 1| at equal steps (last epoch's training loss)",
            loss_gap(results.get("flodl-fp8"), results.get("flodl-bf16")),
            0.01,
            at_most=True,
        ),
        *(
            Ratio(
                f"flodl / plain torch, both compile_mode={m}, 1 GPU", over(f"flodl-{m}", f"torch-{m}"), 0.98
            )
            for m in MODES
            if f"flodl-{m}" in results or f"torch-{m}" in results
        ),
        *(Ratio(f"compile_mode={m} / eager, flodl 1 GPU", over(f"flodl-{m}", "flodl-eager")) for m in MODES),
    ]
    if model in SAME_MODE_GOALS:  # issue 43: the GPT's own mode (compile_mode auto: CUDA graphs on 1 GPU)
        rows.append(
            Ratio(
                "flodl precision=bf16 (compile_mode auto: reduce-overhead) / plain torch in that mode, 1 GPU",
                over("flodl-bf16", "torch-reduce-overhead"),
                SAME_MODE_GOALS[model],
            )
        )
    # The MFU goal is bf16's: fp8's arm (its MFU too against the bf16 peak) is shown apart.
    mfus = [r.mfu for key, r in results.items() if key.startswith("flodl-") and key != "flodl-fp8" and r.mfu]
    if model in MFU_GOALS:
        best = max(mfus, default=None)
        rows.append(Ratio("MFU, flodl 1 GPU, its fastest bf16 arm", best, MFU_GOALS[model]))
    fp8 = results.get("flodl-fp8")
    if fp8 is not None and fp8.mfu:
        rows.append(Ratio("MFU, flodl 1 GPU, precision=fp8 (against the bf16 peak)", fp8.mfu))
    return [r for r in rows if r.value is not None or r.goal is not None]


def loss_gap(a: Run | None, b: Run | None) -> float | None:
    if a is None or b is None or a.loss is None or b.loss is None:
        return None
    return abs(a.loss / b.loss - 1)


def model_report(model: str, runs: dict[str, list[Run]], steps: int, settings: Settings) -> list[str]:
    results = {key: median(found) for key, found in runs.items()}
    lines = [
        f"## {model}",
        "",
        f"flodl: {steps} steps per epoch per rank, 1 + {settings.epochs} epochs (the first not counted); "
        f"{settings.repeat} pass(es), the median run of each arm counts.",
        "",
        "| arm | samples/s | MFU | compile s | runs (samples/s) |",
        "|---|---|---|---|---|",
    ]
    # flodl's MFU over its samples/s is the model's FLOPs over the device's peak: plain torch's follows.
    per_sample = next((r.mfu / r.samples_per_s for r in results.values() if r.mfu), None)
    for arm in ARMS:
        if arm.key not in results:
            continue
        m = results[arm.key]
        compile_s = "—" if not m.compile_s else f"{m.compile_s:.1f}"
        mfu = "—" if per_sample is None else f"{m.samples_per_s * per_sample:.1%}"
        every = ", ".join(f"{r.samples_per_s:,.0f}" for r in runs[arm.key])
        lines.append(f"| {arm.label} | {m.samples_per_s:,.1f} | {mfu} | {compile_s} | {every} |")
    lines += [
        "",
        "| measure | value | goal (issues 20, 29, 43) | verdict |",
        "|---|---|---|---|",
        *(r.row() for r in ratios(model, results)),
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {','.join(MODELS)}")
    parser.add_argument("--arms", default=None, help=f"comma-separated subset of: {','.join(ARM_KEYS)}")
    parser.add_argument("--repeat", type=int, default=None, help="interleaved passes (default 3, quick 1)")
    parser.add_argument("--epochs", type=int, default=2, help="measured flodl epochs (after one more)")
    parser.add_argument("--epoch-s", type=float, default=None, help="flodl epoch length (default 2, quick 1)")
    parser.add_argument("--quick", action="store_true", help="one pass, shorter epochs, no torch-compile arm")
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU (gloo): checks the pipeline")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per arm (default 600)")
    parser.add_argument(
        "--steps", type=int, default=None, help="flodl steps per epoch per rank (default: from torch-eager)"
    )
    parser.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every flodl arm (after --)")
    args = parser.parse_args()

    models = args.models.split(",")
    chosen = list(ARM_KEYS) if args.arms is None else args.arms.split(",")
    unknown = sorted({*set(models) - set(MODELS), *set(chosen) - set(ARM_KEYS)})
    if unknown:
        parser.error(
            f"unknown models or arms {unknown}; models: {', '.join(MODELS)}; arms: {', '.join(ARM_KEYS)}"
        )
    if args.arms is None:
        chosen = [k for k in chosen if k not in NAMED_ONLY]
    if args.quick:
        chosen = [k for k in chosen if k not in QUICK_SKIPS]
    settings = Settings(
        cpu=args.smoke,
        steps=3 if args.smoke else args.steps,
        epochs=1 if args.smoke else args.epochs,
        epoch_s=args.epoch_s or (1.0 if args.quick else 2.0),
        plain_s=0.3 if args.smoke else (1.0 if args.quick else 2.0),
        plain_warmup=2 if args.smoke else 20,
        timeout=args.timeout or 600,
        repeat=args.repeat or (1 if args.quick or args.smoke else 3),
        overrides=tuple(args.overrides),
    )
    path = results_path(args.results_dir, "compile-precision", settings.cpu)
    head = ["# compile and precision", "", *environment_lines(settings.cpu)]
    write_report(path, "\n".join([*head, f"- command: `{' '.join(['python', *sys.argv])}`", ""]))
    with tempfile.TemporaryDirectory(prefix="flodl-compile-") as tmp:
        for model in models:  # each model's tables written once measured: a run cut short keeps them
            runs, steps = measure(model, settings, chosen, Path(tmp))
            write_report(path, "\n".join(model_report(model, runs, steps, settings)))
    write_report(
        path,
        "samples/s of flodl: the epochs after the first; compile s: the first step of the first epoch "
        "(metrics.jsonl's compile_s, kept out of samples_per_s). A pair's samples/s is the sum of its two "
        "runs.\n",
    )


if __name__ == "__main__":
    main()
