"""A finished run's model outside flodl: safetensors that the safetensors package reads back, and the
refusals that name what is missing. The end-to-end load of a real run is in tests/runs/test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flodl.checkpoints.export import export_safetensors, load_model, main, safetensors_bytes


def test_every_dtype_shape_and_tied_tensor_reads_back_with_the_safetensors_package(tmp_path: Path) -> None:
    shared = torch.randn(5, 3)
    state = {
        "embed.weight": shared,
        "head.weight": shared,  # tied: the same storage under two names
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(7).to(torch.bfloat16),
        "fp16": torch.randn(2, 2).half(),
        "steps": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(9, dtype=torch.uint8),
    }
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(state, {"source": "flodl"}))
    loaded = load_file(path)
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_a_strided_view_is_written_as_its_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = tmp_path / "t.safetensors"
    path.write_bytes(safetensors_bytes({"t": base.t()}, {}))
    assert torch.equal(load_file(path)["t"], base.t())


def test_export_writes_beside_model_pt_and_load_model_rebuilds_the_recorded_model(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "task:\n  model:\n    _target_: flodl.tasks.digits.DigitsMLP\n    hidden: 16\n"
    )
    from flodl.tasks.digits import DigitsMLP

    state = DigitsMLP(hidden=16).state_dict()
    torch.save(state, tmp_path / "model.pt")
    written = export_safetensors(tmp_path)
    assert written == tmp_path / "model.safetensors"
    assert {k: torch.equal(v, state[k]) for k, v in load_file(written).items()} == dict.fromkeys(state, True)
    model = load_model(tmp_path)
    assert isinstance(model, DigitsMLP) and not model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_dir_without_model_pt_is_refused_naming_the_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit, match=r"model\.pt.*finished flodl run"):
        main([str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"recorded config"):
        load_model(tmp_path)
