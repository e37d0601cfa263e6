"""Fixtures shared by several test modules."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any

import pytest
import torch.distributed as dist

from tests.helpers.drawn import BASE, draw_base


def pytest_configure(config: pytest.Config) -> None:
    """The run's base for seed sweeps (tests/helpers/drawn.py), drawn before pytest-xdist starts its workers:
    they inherit it and collect the same seeds."""
    draw_base()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"seed sweeps drawn from {BASE}={draw_base()} (set it to draw them again)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/unit holds no test that starts a process, tests/runs only such tests (marked multiproc)."""
    for item in items:
        folder = item.path.parent.name
        marked = item.get_closest_marker("multiproc") is not None
        if (folder == "unit" and marked) or (folder == "runs" and not marked):
            where = "tests/runs: multiproc only" if folder == "runs" else "tests/unit: no multiproc test"
            raise pytest.UsageError(f"{item.nodeid} is in {where}")


@pytest.fixture(autouse=True)
def _a_process_only_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`-m 'not multiproc'` starts no process: a test that starts one (a CLI run, ranks, a fresh
    interpreter, DataLoader workers) without the mark fails here, naming itself."""
    if request.node.get_closest_marker("multiproc") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.multiproc")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


@pytest.fixture
def solo_group():
    """A one-rank gloo process group: the reducer's code paths without a second process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def wds() -> Any:
    """webdataset, an optional package: its tests are skipped where it is not installed, the others run."""
    return pytest.importorskip("webdataset", exc_type=ImportError)


@pytest.fixture
def hf() -> Any:
    """HF `datasets`, an optional package: its tests are skipped where it is not installed."""
    return pytest.importorskip("datasets", exc_type=ImportError)
