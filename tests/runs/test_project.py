"""flodl from a user's own project: built as a wheel and installed (not from this checkout), the user's
package and conf/ in a temp dir, run with the installed command under torchrun and under self-launch; a typo'd
target is refused before any rank starts. The wheel carries flodl's own conf/ and finds it from anywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.procs import PYTHON, REPO, TORCHRUN, Result, child_env, finish, leftovers, start
from tests.helpers.user_project import write_project

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """flodl's wheel, built offline from a copy of this checkout (the checkout gets no build/ folder)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    for name in ("flodl", "hydra_plugins", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = [PYTHON, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root)]
    subprocess.run([*build, str(source)], check=True)
    (built,) = root.glob("flodl-*.whl")
    return built


@pytest.fixture(scope="module")
def command(wheel: Path) -> Path:
    """flodl installed from its wheel into a folder of its own: its command."""
    site = wheel.parent / "site"
    pip = [PYTHON, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    subprocess.run([*pip, str(wheel)], check=True)
    return site / "bin" / "flodl-train"


def test_the_wheel_carries_every_module_and_config(wheel: Path) -> None:
    # pyproject.toml names flodl's packages one by one (conf/ becomes flodl.conf): a package left off the list
    # would be missing here.
    inside = set(zipfile.ZipFile(wheel).namelist())
    modules = [p for top in ("flodl", "hydra_plugins") for p in (REPO / top).rglob("*.py")]
    wanted = {p.relative_to(REPO).as_posix() for p in modules}
    wanted |= {"flodl/" + p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.y*ml")}
    wanted.add("flodl/conf/__init__.py")
    assert "flodl/conf/task/digits.yaml" in wanted
    assert not wanted - inside, sorted(wanted - inside)


def test_the_installed_command_finds_its_configs_outside_the_checkout(command: Path, tmp_path: Path) -> None:
    # No site processing (-S): the test venv's editable install of this checkout stays off sys.path; its
    # site-packages come in on PYTHONPATH for flodl's dependencies only.
    site, deps = command.parents[1], sysconfig.get_paths()["purelib"]
    env = child_env(PYTHONPATH=os.pathsep.join([str(site), deps]))
    where = "import os, sys, flodl.conf; print(flodl.conf.__file__, %r in map(os.path.abspath, sys.path))"
    found = (
        finish(start([PYTHON, "-S", "-c", where % str(REPO)], tmp_path, env), timeout=60).check().out.split()
    )
    assert found == [str(site / "flodl" / "conf" / "__init__.py"), "False"], found
    result = finish(start([PYTHON, "-S", str(command), "--cfg", "job"], tmp_path, env), timeout=120).check()
    job = yaml.safe_load(result.out)
    assert (job["policy"], job["task"]["name"]) == ("sync", "digits"), result.out


def test_a_checkout_run_from_source_finds_its_own_configs(tmp_path: Path) -> None:
    # No site processing (-S): no install of flodl at all, the checkout on PYTHONPATH (as on a machine that
    # runs it from source), the test venv's site-packages for the dependencies.
    env = child_env(PYTHONPATH=os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]]))
    result = finish(
        start([PYTHON, "-S", str(REPO / "train.py"), "policy=async", "--cfg", "job"], tmp_path, env), 120
    )
    job = yaml.safe_load(result.check().out)
    assert (job["policy"], job["task"]["name"], job["easgd_alpha"]) == ("async", "digits", 0.5), result.out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return write_project(tmp_path)


def run_installed(args: list[str], project: Path, command: Path) -> Result:
    # The installed copy only: not this checkout (PYTHONPATH), not the user's project (the command adds it).
    env = child_env(PYTHONPATH=str(command.parents[1]))
    result = finish(start(args, project, env), timeout=180)
    assert not result.timed_out, result.out[-4000:]
    return result


def assert_trained(project: Path, world: int, width: int) -> None:
    run_dirs = [p.parent for p in project.rglob("metrics.jsonl")]
    assert len(run_dirs) == 1, run_dirs
    records = [json.loads(line) for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 1]
    assert all(len(r["per_rank"]) == world for r in records)
    state = torch.load(run_dirs[0] / "model.pt", weights_only=True)
    assert state["net.0.weight"].shape == (width, 4)  # the command line's model argument reached the model
    assert not leftovers(project)


def test_torchrun_two_ranks_of_the_users_task(project: Path, command: Path) -> None:
    # task.model.dropout is not in the task's yaml: the command line adds it as a model argument.
    args = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(command), "--config-dir", "conf"]
    run_installed(
        [*args, "task=blobs", "task.model.width=12", "task.model.dropout=0.1"], project, command
    ).check()
    assert_trained(project, world=2, width=12)
    assert "dropout: 0.1" in next(project.rglob(".hydra/config.yaml")).read_text()


def test_self_launch_two_ranks_of_the_users_task(project: Path, command: Path) -> None:
    args = [str(command), "--config-dir", "conf", "task=blobs", "launch.nproc_per_node=2"]
    run_installed([*args, "+task.model.dropout=0.1"], project, command).check()
    assert_trained(project, world=2, width=8)


def test_typo_in_a_target_is_one_line_before_any_rank(project: Path, command: Path) -> None:
    args = [PYTHON, "-m", "flodl", "--config-dir", "conf", "task=blobs", "launch.nproc_per_node=2"]
    result = run_installed([*args, "task.model._target_=mypkg.parts.Nett"], project, command)
    assert result.code == 2, result.out
    (line,) = result.out.strip().splitlines()
    where = "flodl: invalid flodl config: task.model._target_='mypkg.parts.Nett': does not import"
    assert line.startswith(where) and "has no attribute 'Nett'" in line, line
    assert not list(project.rglob("rank*.log"))


def test_installing_the_checkout_keeps_the_torch_already_installed(tmp_path: Path) -> None:
    """The README's own-project recipe: a CPU torch first, then flodl; pip keeps that torch (a range in
    pyproject.toml), instead of pulling a CUDA build of several GB."""
    report = tmp_path / "report.json"
    args = [PYTHON, "-m", "pip", "install", "--dry-run", "--no-build-isolation", "--quiet"]
    subprocess.run([*args, "--report", str(report), str(REPO)], check=True, capture_output=True, timeout=300)
    planned = {
        item["metadata"]["name"]: item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert set(planned) == {"flodl"}, f"pip would install more than flodl: {planned}"
