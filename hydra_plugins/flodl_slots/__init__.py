"""flodl's slots launcher for Hydra sweeps: `python train.py -m hydra/launcher=slots ...`.

Each job runs as its own process (`train.py` with the job's overrides, its run dir the job's sweep subdir)
and gets a disjoint set of `launch.nproc_per_node` GPUs through `CUDA_VISIBLE_DEVICES`; its ranks find a
free rendezvous port of their own. The next job starts as soon as enough GPUs are free, not when a whole
batch of jobs is done. On a host without GPUs, `hydra.launcher.max_parallel` jobs run at a time.
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module unregistered, and the
# dataclass below must not look its annotations up in sys.modules.
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict

from flodl.metrics import run_clock

log = logging.getLogger("flodl")
_POLL_S = 0.2
# The override that tells a job the slots launcher started (a single run to Hydra) which sweep it belongs to.
GROUP_KEY = "logger.group"


@dataclass
class SlotLauncherConf:
    _target_: str = "hydra_plugins.flodl_slots.SlotLauncher"
    # Jobs at a time on a host without GPUs (with GPUs, the free GPUs decide).
    max_parallel: int = 2


# Hydra imports every plugin module before it composes, so `hydra/launcher=slots` is known wherever it is.
ConfigStore.instance().store(group="hydra/launcher", name="slots", node=SlotLauncherConf, provider="flodl")


def gpu_slots(free: list[int], wanted: int) -> list[int] | None:
    """The lowest `wanted` free GPU indices, or None when there are not enough (pure)."""
    return sorted(free)[:wanted] if len(free) >= wanted else None


@dataclass
class _Running:
    index: int
    process: subprocess.Popen
    gpus: list[int]
    job_dir: Path
    overrides: list[str]


class SlotLauncher(Launcher):
    def __init__(self, max_parallel: int = 2) -> None:
        self.max_parallel = max_parallel
        self.config: DictConfig | None = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import torch

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        gpus = torch.cuda.device_count()
        free = list(range(gpus))
        pending = list(enumerate(job_overrides, start=initial_job_idx))
        running: list[_Running] = []
        results: dict[int, JobReturn] = {}
        while pending or running:
            while pending:
                index, overrides = pending[0]
                job_cfg = self._job_config(list(overrides), index)
                wanted = int(job_cfg.launch.nproc_per_node)
                if gpus:
                    if wanted > gpus:
                        raise ValueError(f"job {index} wants {wanted} GPUs; this host has {gpus}")
                    chosen = gpu_slots(free, wanted)
                    if chosen is None:
                        break
                elif len(running) >= self.max_parallel:
                    break
                else:
                    chosen = []
                pending.pop(0)
                free = [g for g in free if g not in chosen]
                job_dir = sweep_dir / str(job_cfg.hydra.sweep.subdir)
                running.append(self._start(index, list(overrides), chosen, job_dir, sweep_dir))
            time.sleep(_POLL_S)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                free.extend(job.gpus)
                results[job.index] = self._result(job)
        failed = [i for i, r in sorted(results.items()) if r.status == JobStatus.FAILED]
        if failed:
            raise RuntimeError(f"sweep jobs {failed} failed; see their rank logs under {sweep_dir}")
        return [results[i] for i in sorted(results)]

    def _job_config(self, overrides: list[str], index: int) -> DictConfig:
        loader = self.hydra_context.config_loader
        job_cfg = loader.load_sweep_config(self.config, overrides)
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = index
            job_cfg.hydra.job.num = index
        return job_cfg

    def _start(
        self, index: int, overrides: list[str], gpus: list[int], job_dir: Path, sweep: Path
    ) -> _Running:
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        command = [*_this_command(), *overrides, f"hydra.run.dir={job_dir}"]
        if not any(o.startswith(f"{GROUP_KEY}=") for o in overrides):  # a group the user chose stays theirs
            command.append(f"{GROUP_KEY}={'/'.join(sweep.parts[-2:])}")
        job_dir.mkdir(parents=True, exist_ok=True)
        log.info("job %d on %s: %s", index, f"GPUs {gpus}" if gpus else "CPU", " ".join(overrides))
        output = (job_dir / "job.out").open("w")
        env[run_clock.LAUNCHED_AT_ENV] = repr(time.time())
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        output.close()
        return _Running(index, process, gpus, job_dir, overrides)

    def _result(self, job: _Running) -> JobReturn:
        ok = job.process.returncode == 0
        if not ok:
            log.error("job %d failed (exit code %d): see %s", job.index, job.process.returncode, job.job_dir)
        return JobReturn(
            overrides=job.overrides,
            cfg=OmegaConf.create({}),
            hydra_cfg=OmegaConf.create({}),
            working_dir=str(job.job_dir),
            task_name="train",
            status=JobStatus.COMPLETED if ok else JobStatus.FAILED,
            _return_value=None if ok else RuntimeError(f"job {job.index} exited {job.process.returncode}"),
        )


def _this_command() -> list[str]:
    """The command this sweep was started with: `python -m flodl` again (its __main__.py run as a script would
    put flodl/ itself first on sys.path), else the script (`flodl-train`, `train.py`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name == "flodl.__main__":
        return [sys.executable, "-m", "flodl"]
    return [sys.executable, sys.argv[0]]
