"""The standard library's source as BPE tokens: a byte-level BPE tokenizer trained offline on the corpus
itself (the `tokenizers` package, flodl's `gpt2` extra), never downloaded.

The tokenizer is trained once from the train split's first `tokenizer_bytes` and saved; each split's tokens
are cached beside it (int32 .npy), both under a folder named by the vocabulary size and a hash of the text
the tokenizer learnt from. A file lock makes ranks started together build them once. The text is the byte
stream of the char-level tasks (flodl/tasks/gpt.py: files separated by a blank line), so bits per byte
compare with their nats per byte (x 1/ln 2).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from flodl.config.host import user_temp_dir
from flodl.tasks.gpt import TokenWindows, stdlib_parts

# GPT-2's vocabulary: 256 bytes and 50,001 merges (here no special token: files are split by a blank line).
GPT2_VOCAB = 50257
_FORMAT = "bpe-v1"  # bump when what is cached changes meaning


def bpe_text(
    split: str,
    context: int = 1024,
    vocab_size: int = GPT2_VOCAB,
    max_bytes: int = 32_000_000,
    tokenizer_bytes: int = 32_000_000,
    root: str | None = None,
    cache_dir: str | None = None,
) -> TokenWindows:
    """The split's first `max_bytes` of stdlib text (or of `root`'s *.py files) as BPE tokens."""
    folder = _model_dir(vocab_size, tokenizer_bytes, root, cache_dir)
    text = _texts(split, max_bytes, root)
    path = folder / f"{split}-{max_bytes}-{_digest(text)}.npy"
    with _locked(folder):
        if not path.exists():
            tokenizer = _tokenizer(folder, vocab_size, tokenizer_bytes, root)
            ids = [e.ids for e in tokenizer.encode_batch(text)]
            _write_atomic(path, np.concatenate([np.asarray(i, dtype=np.int32) for i in ids]))
    tokens = torch.from_numpy(np.load(path))
    return TokenWindows(tokens, context)


def token_bytes(
    vocab_size: int = GPT2_VOCAB,
    tokenizer_bytes: int = 32_000_000,
    root: str | None = None,
    cache_dir: str | None = None,
) -> Tensor:
    """Bytes of text each token id stands for (int64, one per id of the tokenizer's vocabulary)."""
    folder = _model_dir(vocab_size, tokenizer_bytes, root, cache_dir)
    with _locked(folder):
        tokenizer = _tokenizer(folder, vocab_size, tokenizer_bytes, root)
    # Byte-level BPE spells each byte as one character of its alphabet: a token's length is its bytes.
    return torch.tensor([len(tokenizer.id_to_token(i)) for i in range(tokenizer.get_vocab_size())])


def next_token_bits(model: nn.Module, batch: list[Tensor], token_bytes: Tensor) -> dict[str, Tensor]:
    """Per-sample sums as the framework wants them (it divides by the windows): `loss`, the mean cross
    entropy per token in nats, and `bits_per_byte`, each batch's nats/token x tokens / bytes / ln 2."""
    inputs, targets = batch
    mean = model(inputs, targets).float()  # GPT.forward: the mean over the batch's tokens
    samples = targets.shape[0]
    text_bytes = token_bytes.to(targets.device)[targets].sum()
    bits = mean * targets.numel() / text_bytes / math.log(2)
    return {"loss": mean * samples, "bits_per_byte": bits * samples}


def _texts(split: str, max_bytes: int, root: str | None) -> list[str]:
    # A stdlib file that is not UTF-8 (a few tests of codecs) keeps its other characters.
    return [p.decode("utf-8", errors="replace") for p in stdlib_parts(split, max_bytes, root)]


def _digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
    return h.hexdigest()[:16]


def _model_dir(vocab_size: int, tokenizer_bytes: int, root: str | None, cache_dir: str | None) -> Path:
    source = _digest(_texts("train", tokenizer_bytes, root))
    folder = Path(cache_dir) if cache_dir else user_temp_dir() / "bpe"
    path = folder / f"{_FORMAT}-{vocab_size}-{source}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tokenizer(folder: Path, vocab_size: int, tokenizer_bytes: int, root: str | None) -> Any:
    """The folder's tokenizer, trained there first if absent (call under the folder's lock)."""
    tokenizers = _tokenizers_package()
    path = folder / "tokenizer.json"
    if path.exists():
        return tokenizers.Tokenizer.from_file(str(path))
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=byte_level.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_texts("train", tokenizer_bytes, root), trainer)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return tokenizer


def _tokenizers_package() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            "the BPE tasks (task=gpt2_124m) train their tokenizer with the `tokenizers` package: "
            "pip install 'flodl[gpt2]' (or pip install tokenizers)"
        ) from err
    return tokenizers


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)
