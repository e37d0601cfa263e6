"""A finished run's model outside flodl: rebuilt in one call, or written in the Hugging Face convention.

`load_model(run_dir)` builds the run's `task.model` from the config the run recorded (`.hydra/config.yaml`)
and loads `model.pt` into it. `python -m flodl.checkpoints.export RUN_DIR` (or `flodl-export RUN_DIR`) writes
`model.safetensors` beside `model.pt`: the same float32 tensors in the safetensors layout (an 8-byte
little-endian header length, a JSON header of dtype, shape and byte offsets, then the raw bytes), which
`safetensors.torch.load_file` and the Hugging Face tools read without pickle.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from flodl.checkpoints.disk import MODEL_FILE, atomic_write_bytes

SAFETENSORS_FILE = "model.safetensors"
# The run's composed config, as Hydra's output subdir holds it (written by rank 0).
RUN_CONFIG = Path(".hydra") / "config.yaml"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _required(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {what} here; pass the dir of a finished flodl run")
    return path


def load_state(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The run's final model as a state dict (CPU, float32 parameters)."""
    path = _required(Path(run_dir) / MODEL_FILE, MODEL_FILE)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_model(run_dir: str | Path) -> nn.Module:
    """The run's `task.model` rebuilt from its recorded config, with `model.pt` loaded, in eval mode.

    The model's `_target_` must import here as it did in the run (run from the project's root, or install
    the project)."""
    config = OmegaConf.load(_required(Path(run_dir) / RUN_CONFIG, "recorded config"))
    model = instantiate(config.task.model)
    model.load_state_dict(load_state(run_dir))
    return model.eval()


def safetensors_bytes(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """`state` in the safetensors layout. Tensors that share storage (tied weights) are each written whole."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    chunks, offset = [], 0
    for name, tensor in state.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: {tensor.dtype} has no safetensors dtype")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors' bytes start 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded + b"".join(chunks)


def export_safetensors(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's model as `model.safetensors` (beside `model.pt` unless `out` says where)."""
    target = Path(out) if out is not None else Path(run_dir) / SAFETENSORS_FILE
    atomic_write_bytes(safetensors_bytes(load_state(run_dir), {"format": "pt", "source": "flodl"}), target)
    return target


def main(argv: list[str] | None = None) -> None:
    """`flodl-export RUN_DIR [--out PATH]`."""
    parser = argparse.ArgumentParser(prog="flodl-export", description="write a run's model.pt as safetensors")
    parser.add_argument("run_dir", type=Path, help="a finished run's dir (it holds model.pt)")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"where to write (default: RUN_DIR/{SAFETENSORS_FILE})"
    )
    args = parser.parse_args(argv)
    try:
        print(export_safetensors(args.run_dir, args.out))
    except (FileNotFoundError, TypeError) as err:
        raise SystemExit(f"flodl-export: {err}") from err


if __name__ == "__main__":
    main()
