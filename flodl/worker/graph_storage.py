"""Under a compile mode that captures CUDA graphs, the model's tensors must stay where they were captured.

A replayed graph reads and writes the addresses it captured. Everything that writes a rank's state (a
round's consensus, the EASGD blend, an outer step, an admission's broadcast, sync's agreement, a resume)
copies into the parameters and buffers in place; one that rebound a tensor instead (`param.data = new`, a
buffer replaced) would leave the graph training the old storage, silently. `CapturedStorage` notes every
parameter's and buffer's address once the model's tensors are final (flat buffers, resumed weights) and
checks them after each such write: a host-side comparison of pointers, once per round, never per step.
"""

from __future__ import annotations

from torch import nn

from flodl.config.policy import GRAPH_MODES


class StorageMoved(RuntimeError):
    """A write rebound a tensor that a captured CUDA graph reads: the graph would train a stale copy."""


class CapturedStorage:
    def __init__(self, model: nn.Module, compile_mode: str | None) -> None:
        """Watch `model`'s tensors when `compile_mode` captures graphs (otherwise `check` does nothing)."""
        self.model = model
        self.compile_mode = compile_mode
        self.addresses = self._addresses() if compile_mode in GRAPH_MODES else None

    def _addresses(self) -> dict[str, int]:
        tensors = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        return {name: tensor.data_ptr() for name, tensor in tensors.items()}

    def check(self, after: str) -> None:
        """Raise if `after` (what just wrote the state) moved any parameter or buffer."""
        if self.addresses is None:
            return
        now = self._addresses()
        moved = sorted(name for name, address in self.addresses.items() if now.get(name) != address)
        if moved:
            shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
            raise StorageMoved(
                f"after {after}, {shown} no longer live where compile_mode={self.compile_mode} captured "
                "them: its CUDA graphs would keep training the old storage. State must be written in place "
                "(tensor.copy_), never rebound; run with compile_mode=default until this is fixed"
            )
