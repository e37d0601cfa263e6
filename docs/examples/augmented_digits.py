"""A torchvision-style Dataset: each read decodes an image and augments it at random in __getitem__.

flodl reads it afresh in every epoch (a map-style Dataset is never cached unless declared), so the
augmentation is new each time; `num_workers` runs the reads in DataLoader worker processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from flodl.tasks.digits import digits_dataset


class AugmentedDigits(Dataset):
    def __init__(self, split: str = "train", max_shift: int = 1, noise: float = 0.05) -> None:
        data = digits_dataset(split)
        self.images, self.labels = data.fields[0].view(-1, 1, 8, 8), data.fields[1]
        self.max_shift, self.noise = max_shift, noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if self.max_shift:  # random translation: pad, then crop at a random offset
            s = self.max_shift
            dx, dy = torch.randint(0, 2 * s + 1, (2,)).tolist()
            image = F.pad(image, (s, s, s, s))[:, dy : dy + 8, dx : dx + 8]
        image = image + self.noise * torch.randn_like(image)
        return image.flatten(), self.labels[i]
