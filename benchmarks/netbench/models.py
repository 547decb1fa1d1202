"""What the benchmark trains: a LightningModule around a named network, and synthetic batches.

* ``resnet18``: torchvision's ResNet-18 with 10 classes on 3x32x32 inputs (11.2 M parameters);
* ``mlp29m``: a 3072-4096-4096-10 MLP on flattened 3x32x32 inputs (29.4 M parameters, the
  >= 25 M-element gradient);
* ``tiny``: a 3072-16-10 MLP for unit tests.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

INPUT_SHAPE = (3, 32, 32)
CLASSES = 10


def _resnet18() -> nn.Module:
    from torchvision.models import resnet18

    return resnet18(num_classes=CLASSES)


def _mlp(*widths: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    sizes = [3 * 32 * 32, *widths, CLASSES]
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": _resnet18,
    "mlp29m": lambda: _mlp(4096, 4096),
    "tiny": lambda: _mlp(16),
}


class BenchModule(L.LightningModule):
    """Cross-entropy classifier trained with ``SGD(lr, momentum=0.9)``."""

    def __init__(self, model: str, lr: float = 0.01) -> None:
        super().__init__()
        self.net = MODELS[model]()
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def synthetic_batches(count: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` preallocated random batches (data loading costs nothing in the timed loop)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch_size, *INPUT_SHAPE, generator=generator),
            torch.randint(0, CLASSES, (batch_size,), generator=generator),
        )
        for _ in range(count)
    ]


def gradient_shapes(model: str) -> list[tuple[int, ...]]:
    """Shapes of the trainable parameters of ``model`` (what DDP all-reduces)."""
    return [tuple(p.shape) for p in MODELS[model]().parameters() if p.requires_grad]
