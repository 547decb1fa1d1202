"""Image classification: CIFAR ResNets (He et al. 2016, §4.2), torchvision's ResNet-50, one LightningModule."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torchvision.models import resnet50
from torchvision.models.resnet import BasicBlock

from lightning_gc.common.validation import check_choice, check_int
from recipes.common import RecipeTask

ARCHS = ("resnet20", "resnet32", "resnet44", "resnet56", "resnet110", "resnet50")


class _PadShortcut(nn.Module):
    """He et al.'s option-A shortcut: subsample by 2 and zero-pad the new channels (no parameters)."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::2, ::2]
        return nn.functional.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))


def resnet_cifar(depth: int, num_classes: int = 10) -> nn.Sequential:
    """The CIFAR ResNet of ``depth = 6n + 2`` layers: 3 stages of n torchvision ``BasicBlock``\\ s
    with 16, 32, 64 channels; ResNet-20 has 0.27 M parameters, ResNet-110 1.7 M."""
    if (depth - 2) % 6 != 0 or depth < 8:
        raise ValueError(f"`depth` of a CIFAR ResNet must be 6n+2 >= 8 (20, 32, 44, 56, 110, ...), got {depth}")
    n = (depth - 2) // 6
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    channels = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(n):
            stride = 2 if stage > 0 and block == 0 else 1
            down = _PadShortcut(width - channels) if stride == 2 else None
            layers.append(BasicBlock(channels, width, stride=stride, downsample=down))
            channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    net = nn.Sequential(*layers)
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight)
    return net


def build_backbone(arch: str, num_classes: int) -> nn.Module:
    """``resnet<6n+2>`` for CIFAR (32x32 inputs) or torchvision's ``resnet50`` (ImageNet)."""
    check_choice("model.arch", arch, ARCHS)
    if arch == "resnet50":
        return resnet50(num_classes=num_classes)
    return resnet_cifar(int(arch.removeprefix("resnet")), num_classes)


class ImageClassifier(RecipeTask):
    """Cross-entropy classifier; reports top-1 validation accuracy ``val/acc`` (and top-5 when
    there are more than 5 classes).

    Args:
        arch: one of :data:`ARCHS`.
        num_classes: output classes.
        **sgd: :class:`~recipes.common.RecipeTask`'s optimizer and schedule arguments.
    """

    metric_name = "val/acc"
    metric_mode = "max"

    def __init__(self, arch: str = "resnet20", num_classes: int = 10, **sgd: float) -> None:
        super().__init__(**sgd)
        check_int("model.num_classes", num_classes, 2)
        self.save_hyperparameters()
        self.net = build_backbone(arch, num_classes)
        self.top1 = MulticlassAccuracy(num_classes=num_classes, top_k=1, average="micro")
        self.top5 = MulticlassAccuracy(num_classes=num_classes, top_k=5, average="micro") if num_classes > 5 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.top1(logits, y)
        self.log("val/acc", self.top1, prog_bar=True, sync_dist=True)
        if self.top5 is not None:
            self.top5(logits, y)
            self.log("val/acc_top5", self.top5, sync_dist=True)
