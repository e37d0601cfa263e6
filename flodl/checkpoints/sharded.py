"""A checkpoint's sharded state on disk (a run of sharded groups, docs/sharded-groups.md): its dir
SHARDED_DIR, written with torch.distributed.checkpoint (DCP: a `.metadata` file and one `.distcp` file a
rank), each rank its shard of what it holds, nothing gathered. DCP writes a piece several ranks hold alike
(the same key, the same place in the tensor) once: the groups' shards of the consensus are written once per
shard index.

Its keys (flodl/worker/sharded_state.py writes and reads them):

- `model`: the consensus model (every group holds it at a checkpoint's round);
- the optimizer's state: `optimizer` under sync (every group steps the one state), each group's own under
  local SGD (`optimizer_of_group_G`; `optimizer_groups`: how many groups there were); a group whose state
  was empty (DiLoCo resets it after each round) has none;
- `outer_momentum`: an outer optimizer's momentum, a tensor per parameter (its global parameters are the
  consensus).

Under fault_tolerance=survive the groups share no process group (a process's world is its group), so each
group in at the checkpoint's round writes its own save, under `group-G/` of the dir (the model in each, its
own optimizer state): a group out at that round writes nothing, and one resumed takes a group's in it.

Reading is each rank's own (no collective): a rank reads its shard of each tensor as it is laid out now, on
any world and any `shard_group` (full replicas read them whole).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

SHARDED_DIR = "sharded"
MODEL_KEY = "model"
OUTER_KEY = "outer_momentum"
GROUPS_KEY = "optimizer_groups"
_METADATA = ".metadata"
_GROUP_DIR = "group-"


def optimizer_key(group: int | None) -> str:
    """Where the optimizer's state of `group` lies (None: the one every group steps, under sync)."""
    return "optimizer" if group is None else f"optimizer_of_group_{group}"


def group_dir(path: Path, group: int) -> Path:
    """Where `group` writes its own save under the sharded dir `path` (survive: the groups save apart)."""
    return path / f"{_GROUP_DIR}{group}"


def _saves(path: Path) -> dict[int | None, Path]:
    """The saves under the sharded dir `path`: one of every group (None), or each group's own (survive)."""
    if (path / _METADATA).is_file():
        return {None: path}
    found = path.glob(f"{_GROUP_DIR}*/{_METADATA}")
    return {int(p.parent.name.removeprefix(_GROUP_DIR)): p.parent for p in found}


def save_of(path: Path, group: int | None) -> Path:
    """The save under `path` that holds `group`'s optimizer state (one of `saved_groups`), or the one of
    every group."""
    saves = _saves(path)
    return saves.get(group, saves.get(None, path))


def sharded_files(checkpoint_dir: Path) -> list[str]:
    """The sharded dir's files, as a manifest names them (relative to the checkpoint's dir); none in a
    checkpoint of full replicas."""
    sharded = checkpoint_dir / SHARDED_DIR
    if not sharded.is_dir():
        return []
    return sorted(p.relative_to(checkpoint_dir).as_posix() for p in sharded.rglob("*") if p.is_file())


def holds_sharded_model(files: list[str] | dict[str, Any]) -> bool:
    """Whether a checkpoint of these files holds its model in shards (not whole, as `model.pt`)."""
    return any(name.startswith(f"{SHARDED_DIR}/") and name.endswith(_METADATA) for name in files)


def saved_keys(path: Path) -> set[str]:
    """The top-level keys the save at `path` holds (`save_of`)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def write(state: dict[str, Any], path: Path) -> None:
    """Each rank's shard of `state` under `path` (collective: every rank of the job calls it together)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)


def read(state: dict[str, Any], path: Path) -> None:
    """Fill `state`'s tensors in place from `path`, each with the piece of it this rank holds (this rank's
    own read: the ranks may read different keys)."""
    import torch.distributed.checkpoint as dcp

    with (
        warnings.catch_warnings()
    ):  # a process without a process group (the run's host) reads alone, as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)


def whole_model(path: Path) -> dict[str, Tensor]:
    """The consensus model under `path`, whole, as CPU tensors (a replica's state_dict)."""
    return whole(min(_saves(path).values()), MODEL_KEY)  # every save holds the consensus


def whole(save: Path, key: str) -> dict[str, Tensor]:
    """The tensors under `key` (the model, the outer momentum) of the save at `save` (`save_of`), whole, as
    CPU tensors by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(save).read_metadata().state_dict_metadata
    prefix = f"{key}."
    state = {
        name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in metadata.items()
        if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    read(state, save)
    return {name.removeprefix(prefix): tensor for name, tensor in state.items()}


def saved_groups(path: Path) -> tuple[int, ...] | None:
    """The groups whose own optimizer states the sharded dir at `path` holds (local SGD: every group's, or
    under survive those in at the checkpoint); None: the one every group steps (sync)."""
    saves = _saves(path)
    if None not in saves:
        return tuple(sorted(g for g in saves if g is not None))
    if GROUPS_KEY not in saved_keys(path):
        return None
    count = torch.zeros((), dtype=torch.int64)
    read({GROUPS_KEY: count}, path)
    return tuple(range(int(count)))


def source_group(group: int, saved: tuple[int, ...]) -> int:
    """The saved group whose optimizer state `group` takes: its own if saved, else the one at `group` mod
    how many were saved (a state a real optimizer reached, never an average)."""
    return group if group in saved else saved[group % len(saved)]


def saved_apart(path: Path) -> bool:
    """Whether the groups saved apart under the sharded dir `path` (survive: those in at the checkpoint)."""
    return None not in _saves(path)


def regrouped(saved: tuple[int, ...], groups: int, apart: bool = False) -> str:
    """What a checkpoint of `saved` groups' own optimizer states (`apart`: the groups in, each its own save)
    does resumed on `groups` groups, in words (`source_group`'s rule)."""
    count = len(saved)
    if apart:
        taken = ", ".join(f"group {g} takes saved group {source_group(g, saved)}'s" for g in range(groups))
        return (
            f"a checkpoint of groups {list(saved)}'s optimizer states (those in) resumed as {groups}: {taken}"
        )
    gone = range(groups, count)  # a smaller world's: their states are left
    left = f"; saved group {gone[0]}'s is left" if len(gone) == 1 else ""
    left = f"; saved groups {gone[0]}-{gone[-1]}'s are left" if len(gone) > 1 else left
    return (
        f"a checkpoint of {count} groups resumed as {groups}: group g takes saved group g mod {count}'s "
        f"optimizer state (each group's is its own){left}"
    )
