"""flodl's command: `flodl-train`, `python -m flodl`, `torchrun -m flodl` (and the repo's `train.py`).

flodl's own configs are the checkout's `conf/`, installed as the package `flodl.conf`; a user's project adds
its own with Hydra's `--config-dir conf` (or `hydra.searchpath=[file://conf]`), so `task=mytask` resolves next
to flodl's `task=digits`.

flodl-train                                   # embedded default, one process
torchrun --nproc_per_node=2 -m flodl ...      # torchrun starts the ranks
flodl-train launch.nproc_per_node=2           # flodl starts the ranks itself
flodl-train -m policy=sync,cadence seed=0,1   # multirun sweep, every job checked before the first trains
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import DictConfig

from flodl.config.schema import register_configs
from flodl.launcher.run_dir import register_resolvers

register_configs()
register_resolvers()


def _configs() -> str:
    """Where flodl's configs are: the package `flodl.conf` once installed (a wheel, or an editable install
    of the checkout), else the checkout's own `conf/` (run from source: `PYTHONPATH=. python train.py`)."""
    spec = importlib.util.find_spec("flodl.conf")
    # A namespace package (a leftover flodl/conf/ of an old layout, holding __pycache__ only) has no origin.
    if spec is not None and spec.origin and (Path(spec.origin).parent / "config.yaml").is_file():
        return "pkg://flodl.conf"
    return str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(config_path=_configs(), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    from flodl.launcher.launch import launch_from_hydra

    return launch_from_hydra(cfg)  # a sweep's job: its objective, for the sweeper


@hydra.main(config_path=_configs(), config_name="config", version_base="1.3")
def _coordinator_main(cfg: DictConfig) -> None:
    from flodl.launcher.launch import coordinator_from_hydra

    coordinator_from_hydra(cfg)


def main() -> NoReturn:
    """`flodl-train`: the process ends with the command."""
    _run(_hydra_main)


def coordinator() -> NoReturn:
    """`flodl-coordinator`: the host of a fault_tolerance=survive run whose ranks are started apart (several
    hosts): WORLD_SIZE and MASTER_PORT set, the same overrides as the ranks; start it before them."""
    _run(_coordinator_main)


def _run(entry: Callable[[], None]) -> NoReturn:
    # The user's project is importable from where they run, as under `python -m flodl`; a console script's
    # sys.path starts at the venv's bin/ instead. Spawned ranks inherit sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from flodl.launcher.launch import report_config_errors

    try:
        report_config_errors(entry)  # Hydra's rejections too: one line, exit code 2
    except SystemExit as done:
        _leave(done.code)
    _leave(0)


def _leave(code: str | int | None) -> NoReturn:
    """The command's end as the interpreter's own exit makes it (threads waited for, exit handlers run,
    output flushed, SystemExit's code), less its teardown of every module: a second of each command's end
    once torch and its compiler's modules are in. An error raised past the command ends it as usual."""
    from flodl.links.stop import leave_now

    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does first
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # as the interpreter says a SystemExit's message
        code = 1
    leave_now(code or 0)
