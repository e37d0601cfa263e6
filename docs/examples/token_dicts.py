"""A tokenized dataset whose samples are dicts of variable-length sequences, batched by a padding collate.

Label: whether the sequence holds token 3. The samples are generated from a seed, so their reads are
deterministic and the task declares them cacheable (RAM tier, then the disk pack).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

VOCAB = 16
MARK = 3


class TokenSequences(Dataset):
    def __init__(self, n: int = 2000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 13, (n,), generator=g).tolist()
        self.sequences = [torch.randint(0, VOCAB, (k,), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.sequences[i]
        return {
            "input_ids": ids,
            "label": int((ids == MARK).any()),
            "meta": {"source": "synthetic", "index": i},
        }


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Pads to the batch's longest sequence; the mask marks the real tokens."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.stack([F.pad(s["input_ids"], (0, width - len(s["input_ids"]))) for s in samples])
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    return {
        "input_ids": ids,
        "attention_mask": torch.arange(width) < lengths.unsqueeze(1),
        "labels": torch.tensor([s["label"] for s in samples]),
        "sources": [s["meta"]["source"] for s in samples],
    }


class MaxPoolClassifier(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embed(input_ids).masked_fill(~attention_mask.unsqueeze(-1), float("-inf"))
        return self.head(x.max(dim=1).values)


def loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    return F.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])


def sums(model: nn.Module, batch: dict[str, Any]) -> dict[str, Tensor]:
    logits = model(batch["input_ids"], batch["attention_mask"])
    return {"accuracy": (logits.argmax(dim=1) == batch["labels"]).sum()}
