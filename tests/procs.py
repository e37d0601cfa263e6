"""Run flodl's CLI in a child process group that is always cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "train.py")
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]


@dataclass
class Result:
    code: int
    out: str

    def check(self) -> Result:
        assert self.code == 0, f"exit code {self.code}:\n{self.out[-6000:]}"
        return self


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "HYDRA_FULL_ERROR": "1"})
    env.update(extra)
    return env


def run(args: list[str], cwd: Path, timeout: float = 180, **env: str) -> Result:
    """Run `args`; on timeout terminate, then kill, the whole process group and fail the test."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(args)}\n{out[-6000:]}") from None
    return Result(proc.returncode, out)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def train(*overrides: str, cwd: Path, timeout: float = 180, **env: str) -> Result:
    return run([PYTHON, TRAIN, *overrides], cwd=cwd, timeout=timeout, **env)


def torchrun(nproc: int, *overrides: str, cwd: Path, timeout: float = 180, **env: str) -> Result:
    args = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", TRAIN, *overrides]
    return run(args, cwd=cwd, timeout=timeout, **env)


def leftovers(cwd: Path) -> list[str]:
    """Processes still running in `cwd` (the ranks of a finished run must all be gone)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and Path(proc.cwd()) == cwd:
                found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return found
