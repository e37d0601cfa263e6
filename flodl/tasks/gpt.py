"""A GPT language model and token datasets: synthetic tokens (throughput) and the Python standard library's
own source files as bytes (a real char-level corpus present on every machine, no download).

Batches are `[inputs, targets]`, both (batch, context) int64, targets shifted by one token.
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flodl.tasks.chunked_ce import chunked_cross_entropy

VOCAB = 256  # bytes as tokens
EVAL_PERCENT = 10  # of the stdlib's files (by a hash of the path) go to the eval split
# Third-party packages installed under the stdlib's folder differ between machines: not part of the corpus.
_INSTALLED = {"site-packages", "dist-packages"}


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"CausalSelfAttention: dim={dim} is not a multiple of heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(out.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(dim, bias=bias)
        self.attn = CausalSelfAttention(dim, heads, bias)
        self.ln_mlp = nn.LayerNorm(dim, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim, bias=bias), nn.GELU(), nn.Linear(4 * dim, dim, bias=bias)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and the output head tied to the token embedding.

    `amp`: run the forward pass under bf16 autocast on CUDA (parameters and optimizer stay float32);
    ignored on CPU, so tiny test configs run in float32 there. `bias`: biases in the blocks' linear layers
    and layer norms (GPT-2 has them; without, a step has no bias gradients to reduce). `loss_chunk`: given
    targets, the loss over the tied output layer is computed this many tokens at a time, so the full float32
    logits never exist (flodl/tasks/chunked_ce.py; for large vocabularies); None: from the whole logits.
    `float8_blocks`: under precision=fp8 the blocks' linear layers multiply in float8 too (False: only the
    output layer, inside the chunked loss).
    """

    def __init__(
        self,
        layers: int = 6,
        dim: int = 384,
        heads: int = 6,
        context: int = 256,
        vocab: int = VOCAB,
        amp: bool = True,
        bias: bool = True,
        loss_chunk: int | None = None,
        float8_blocks: bool = True,
    ) -> None:
        super().__init__()
        self.context = context
        self.amp = amp
        self.loss_chunk = loss_chunk
        # use_float8(): the chunked loss's matmuls through the output layer run in float8.
        self.float8_loss = False
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, bias) for _ in range(layers))
        self.ln_out = nn.LayerNorm(dim, bias=bias)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.apply(_init_weights)
        if not float8_blocks:  # precision=fp8 leaves them in the autocast dtype (flodl/worker/float8.py)
            for module in self.blocks.modules():
                if isinstance(module, nn.Linear):
                    module.__dict__["float8"] = False  # a plain attribute (nn.Module's setattr types it)

    def use_float8(self) -> bool:
        """precision=fp8 (flodl/worker/float8.py): the output layer, tied to the embedding and so left as it
        is by the conversion, multiplies in float8 inside the chunked loss (its logits and the hidden states'
        gradient, in training). Whether it does: only with `loss_chunk` set."""
        self.float8_loss = bool(self.loss_chunk)
        return self.float8_loss

    def train_flops(self, batch: list[Tensor]) -> float:
        """Model FLOPs of a training step on `batch` (forward and backward): 6N + 12·L·d·T per token, N the
        parameters but the position embedding (the tied head counted once), T the tokens of a sample."""
        inputs = batch[0]
        samples, length = inputs.shape
        params = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        dim = self.tokens.weight.shape[1]
        return float((6 * params + 12 * len(self.blocks) * dim * length) * length * samples)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits (batch, length, vocab) for token ids (batch, length); given `targets` (batch, length), the
        mean next-token cross-entropy instead (computed in the forward pass, so it runs through DDP's and
        torch.compile's wrappers of the model)."""
        length = idx.shape[1]
        if length > self.context:
            raise ValueError(f"GPT: sequence of {length} tokens exceeds the context of {self.context}")
        # Its own bf16 autocast when asked; otherwise the caller's (precision=bf16 or fp8) stays on: an
        # autocast(enabled=False) here would turn that off and run the whole model in float32.
        own = self.amp and idx.is_cuda
        with torch.autocast(idx.device.type, dtype=torch.bfloat16) if own else contextlib.nullcontext():
            x = self.tokens(idx) + self.positions(torch.arange(length, device=idx.device))
            for block in self.blocks:
                x = block(x)
            x = self.ln_out(x)
            if targets is not None and self.loss_chunk:
                return chunked_cross_entropy(
                    x.flatten(0, 1), self.head.weight, targets.flatten(), self.loss_chunk, self.float8_loss
                )
            logits = self.head(x).float()
            if targets is None:
                return logits
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    # Small normal init (as usual for GPTs): keeps the initial loss near ln(vocab).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def next_token_loss(model: nn.Module, batch: list[Tensor]) -> Tensor:
    """The mean next-token cross-entropy, computed by the model given the targets (GPT.forward)."""
    inputs, targets = batch
    return model(inputs, targets)


def next_token_sums(model: nn.Module, batch: list[Tensor]) -> dict[str, Tensor]:
    """Per-sample sums (the framework divides by the number of windows): `loss` is the mean cross
    entropy per token in nats, `accuracy` the share of next tokens predicted exactly."""
    inputs, targets = batch
    logits = model(inputs)
    length = targets.shape[1]
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    hits = (logits.argmax(dim=-1) == targets).sum()
    return {"loss": ce / length, "accuracy": hits.double() / length}


class TokenWindows:
    """Non-overlapping windows of `context + 1` tokens over one token stream (a BatchDataSet): uint8 for
    bytes, int32 for a larger vocabulary (flodl/tasks/bpe.py).

    Sample i covers tokens [i·context, (i+1)·context]; pure, so the same index always gives the same batch.
    """

    # One tensor in process memory: read directly by the step (flodl's data plane would only copy it).
    resident = True

    def __init__(self, tokens: Tensor, context: int) -> None:
        if tokens.dtype not in (torch.uint8, torch.int32) or tokens.dim() != 1:
            raise ValueError(
                f"TokenWindows: expected a 1-D uint8 or int32 tensor, got {tokens.dtype} "
                f"{tuple(tokens.shape)}"
            )
        if tokens.numel() < context + 1:
            raise ValueError(
                f"TokenWindows: {tokens.numel()} tokens are fewer than one window of {context + 1}"
            )
        self.tokens = tokens
        self.context = context
        # Tokens each sample trains on: the run reports tokens/s.
        self.tokens_per_sample = context
        self._span = torch.arange(context + 1)

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.context

    def get_batch(self, indices: Tensor) -> list[Tensor]:
        windows = self.tokens[indices.view(-1, 1) * self.context + self._span].long()
        return [windows[:, :-1], windows[:, 1:]]


def synthetic_tokens(samples: int, context: int = 256, seed: int = 0) -> TokenWindows:
    """`samples` windows of uniformly random bytes, the same for a given seed (throughput runs)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples * context + 1,), generator=generator, dtype=torch.uint8)
    return TokenWindows(tokens, context)


def stdlib_files(split: str, root: str | None = None) -> list[Path]:
    """The split's `*.py` files under the standard library (or `root`), in a fixed pseudo-random order.

    Whole files go to one split (by a hash of the path relative to the root), so no text is shared.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"stdlib_files: split must be 'train' or 'eval', got {split!r}")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(_python_files(base))
    keys = {p: p.relative_to(base).as_posix().encode() for p in files}
    chosen = [p for p in files if (zlib.crc32(b"split:" + keys[p]) % 100 < EVAL_PERCENT) == (split == "eval")]
    # A hash order rather than sorted: a size cap then samples the whole library, not its first packages.
    return sorted(chosen, key=lambda p: (zlib.crc32(b"order:" + keys[p]), keys[p]))


def _python_files(base: Path) -> list[Path]:
    found = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _INSTALLED]  # pruned: not walked at all
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return found


def stdlib_parts(split: str, max_bytes: int, root: str | None = None) -> list[bytes]:
    """The split's files, each followed by a blank line, the last cut so that they hold `max_bytes`."""
    parts: list[bytes] = []
    total = 0
    for path in stdlib_files(split, root):
        if total >= max_bytes:
            break
        data = path.read_bytes() + b"\n\n"
        parts.append(data[: max_bytes - total])
        total += len(parts[-1])
    return parts


def stdlib_text(
    split: str, context: int = 256, max_bytes: int = 8_000_000, root: str | None = None
) -> TokenWindows:
    """The split's files as one byte stream (files separated by a blank line), cut at `max_bytes`."""
    stream = b"".join(stdlib_parts(split, max_bytes, root))
    return TokenWindows(torch.frombuffer(bytearray(stream), dtype=torch.uint8), context)
