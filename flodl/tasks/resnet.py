"""ResNet-20 for 32x32 images (He et al. 2016, CIFAR variant) and a synthetic image dataset for throughput.

Images travel as uint8 (a quarter of float32's bytes to the device) and the model scales them.
Batches are `[images (N, 3, 32, 32) uint8, labels (N,) int64]`: use the classification loss and eval sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flodl.data.dataset import TensorDataSet


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:  # projection shortcut where the shape changes
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """3 stages of `blocks` basic blocks (widths w, 2w, 4w; stride 2 into stages 2 and 3), global pool."""

    def __init__(self, classes: int = 10, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        inputs = width
        for stage, outputs in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(inputs, outputs, stride=2 if stage > 0 and b == 0 else 1))
                inputs = outputs
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, images: Tensor) -> Tensor:
        x = images.float().div(255.0).sub(0.5) if images.dtype == torch.uint8 else images
        x = self.stages(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def synthetic_images(samples: int, classes: int = 10, size: int = 32, seed: int = 0) -> TensorDataSet:
    """`samples` random uint8 RGB images with random labels, the same for a given seed (throughput runs)."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (samples, 3, size, size), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return TensorDataSet(images, labels)
