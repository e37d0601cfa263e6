"""The floors of flodl: imports run one way, down; no circle; the config's schema and rules stay off torch.

Every module's imports are read with ast, those inside functions too, so a change that opens a door up a
floor fails here. docs/architecture.md draws the same floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import flodl
from tests.helpers.imports import names_imported_by

PACKAGE = Path(flodl.__file__).parent

# The floor of each room (longest prefix wins). A module imports floors below its own, and its own floor
# only within its room (its subpackage; a top-level module is a room of its own).
FLOORS = {
    # What every floor reads: the run's configuration, the words on the wire, the record_scalar registry.
    "flodl.config": 0,
    "flodl.links.messages": 0,
    "flodl.metrics.scalars": 0,
    # How the lines a person reads count epochs.
    "flodl.counting": 0,
    # Pure logic and the services that do not know who runs them; the checkpoint format on disk.
    "flodl.rounds": 1,
    "flodl.averaging": 1,
    "flodl.data": 1,
    "flodl.metrics": 1,
    "flodl.links": 1,
    "flodl.checkpoints": 1,
    "flodl.sharding": 1,
    "flodl.logs": 1,
    # The package's public API: record_scalar.
    "flodl": 1,
    # Who runs them: every rank's worker, the run's coordinator, and the built-in tasks on the data plane.
    "flodl.worker": 2,
    "flodl.coordinator": 2,
    "flodl.tasks": 2,
    # The running job: one rank assembled for its policy, its body, the run's host, resume, failure records;
    # the public callback API (the coordinator's hooks).
    "flodl.job": 3,
    "flodl.callbacks": 3,
    # The checks before any rank starts (they build what a rank would, without starting one).
    "flodl.preflight": 4,
    # The launcher's process: Hydra's side of the command, self-launch, the supervisor, the run dir.
    "flodl.launcher": 5,
    # The commands (`flodl-train`, `python -m flodl`, `flodl-torchrun`): above everything they start.
    "flodl.cli": 6,
    "flodl.torchrun": 6,
    # `python -m flodl` runs the command.
    "flodl.__main__": 7,
}
# Below this floor the settings come ready-made: nothing but the config itself reads the schema or rules.
SETTINGS_FLOOR = 3
SETTINGS = {"flodl.config.schema", "flodl.config.rules"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path, module: str, runtime_only: bool) -> set[str]:
    """Every dotted name `module` imports (with `from a import b`, both `a` and `a.b`).

    runtime_only: just what importing the module runs (not function bodies nor `if TYPE_CHECKING:`).
    """
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if runtime_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        if runtime_only and isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            return
        names.update(names_imported_by(node, package))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def flodl_imports(module: str, runtime_only: bool = False) -> set[str]:
    """The flodl modules `module` imports (a name resolves to its longest prefix that is a module)."""
    found = set()
    for name in imported_names(MODULES[module], module, runtime_only):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


GRAPH = {module: flodl_imports(module) for module in MODULES}


def placed_by(module: str) -> str | None:
    """The longest entry of FLOORS that holds `module` (the package itself holds only its __init__)."""
    holders = [p for p in FLOORS if module == p or (p != "flodl" and module.startswith(p + "."))]
    return max(holders, key=len, default=None)


def floor_of(module: str) -> int:
    return FLOORS[placed_by(module)]


def room_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def test_every_module_has_a_floor():
    assert len(MODULES) > 50
    assert [module for module in MODULES if placed_by(module) is None] == []


def test_the_reader_sees_imports_inside_functions_and_under_type_checking(tmp_path: Path):
    assert "flodl.config.sweep" in GRAPH["flodl.config.schema"]  # inside register_configs()
    source = tmp_path / "typed.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flodl.config import schema\n"
    )
    assert "flodl.config.schema" in imported_names(source, "flodl.typed", runtime_only=False)
    assert "flodl.config.schema" not in imported_names(source, "flodl.typed", runtime_only=True)


def test_no_import_circle():
    done: set[str] = set()  # modules whose every import path was walked without a circle

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        for target in sorted(GRAPH[module]):
            if target in path:
                return [*path[path.index(target) :], target]
            if target not in done and (found := circle_from(target, [*path, target])):
                return found
        done.add(module)
        return None

    circles = (circle_from(module, [module]) for module in sorted(GRAPH) if module not in done)
    assert next((circle for circle in circles if circle), None) is None


def test_imports_only_run_down_the_floors():
    wrong = [
        f"{source} (floor {floor_of(source)}) imports {target} (floor {floor_of(target)})"
        for source, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if not (
            floor_of(target) < floor_of(source)
            or (floor_of(target) == floor_of(source) and room_of(target) == room_of(source))
        )
    ]
    assert wrong == []


def test_below_the_resume_floor_only_the_config_reads_the_schema_and_rules():
    readers = sorted(
        module
        for module, targets in GRAPH.items()
        if any(t == s or t.startswith(s + ".") for t in targets for s in SETTINGS)
        and floor_of(module) < SETTINGS_FLOOR
        and not module.startswith("flodl.config")
    )
    assert readers == []


@pytest.mark.parametrize("module", sorted(SETTINGS))
def test_importing_the_schema_or_the_rules_imports_no_torch(module: str):
    """Everything that importing `module` runs (function bodies, like the host's GPU probe, run later)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(flodl_imports(current, runtime_only=True))
    with_torch = sorted(
        m
        for m in seen
        if any(
            n == "torch" or n.startswith("torch.") for n in imported_names(MODULES[m], m, runtime_only=True)
        )
    )
    assert with_torch == []


def test_the_rules_read_no_files():
    """The rules judge values and the host facts they are handed; what touches the filesystem (writable paths,
    the checkpoint `resume` names) is the preflight's (flodl/preflight/checks.py)."""
    rooms = sorted((PACKAGE / "config" / "rules").glob("*.py"))
    assert len(rooms) > 1
    for room in rooms:
        tree = ast.parse(room.read_text())
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & {"os", "os.path", "pathlib", "shutil", "tempfile", "glob"}, (room, imported)
        calls = [
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        ]
        assert "open" not in calls, room
