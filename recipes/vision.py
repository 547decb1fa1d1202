"""Image classification: CIFAR ResNets (He et al. 2016, §4.2), torchvision's ResNet-50, one LightningModule."""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torchvision.models import resnet50

from lightning_gc.common.validation import check_choice, check_int
from recipes.common import RecipeTask
from recipes.plain import resnet_cifar

ARCHS = ("resnet20", "resnet32", "resnet44", "resnet56", "resnet110", "resnet50")


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
