"""Quickstart task: an MLP on scikit-learn's handwritten digits (real data, installed offline).

The digits set (1,797 8x8 images, 10 classes) ships inside scikit-learn, so this task trains on
real data on a machine with no network. It is small enough for two CPU processes, yet the MLP's
hidden layers are wide enough (``hidden=1024`` gives 1.1 M parameters) for 0.1 % sparsification to
be meaningful.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_gc.common.validation import check_bool, check_choice, check_int, check_range

NUM_FEATURES = 64
NUM_CLASSES = 10
NUM_SAMPLES = 1797


def digits_batches(rank: int, world: int, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of an endless, seeded, epoch-by-epoch shuffle of all 1,797 digits
    (standardised features, labels), for plain training loops (the examples): epoch ``e`` is the
    permutation seeded by ``seed + e``, rank ``r`` takes every ``world``-th sample from ``r``."""
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    x = torch.tensor(features, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp(min=1e-6)
    y = torch.tensor(labels)
    epoch = 0
    while True:
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))[rank::world]
        for start in range(0, len(order) - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            yield x[index], y[index]
        epoch += 1


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's digits, standardised, split into fixed train/validation sets.

    Args:
        batch_size: per-process batch size.
        val_fraction: share of the 1,797 images held out for validation.
        split_seed: seed of the train/validation split (identical on every rank).
        synthetic: made-up features and labels of the same shapes instead of the digits.
    """

    def __init__(
        self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0, synthetic: bool = False
    ) -> None:
        super().__init__()
        self.batch_size = check_int("data.batch_size", batch_size, 1)
        self.val_fraction = check_range(
            "data.val_fraction", val_fraction, 0.0, 1.0, low_inclusive=False, high_inclusive=False
        )
        self.split_seed = check_int("data.split_seed", split_seed, 0)
        self.synthetic = check_bool("data.synthetic", synthetic)

    def setup(self, stage: str | None = None) -> None:
        if self.synthetic:  # same on every rank: seeded by split_seed
            g = torch.Generator().manual_seed(self.split_seed)
            x = torch.rand(NUM_SAMPLES, NUM_FEATURES, generator=g) * 16
            y = torch.randint(NUM_CLASSES, (NUM_SAMPLES,), generator=g)
        else:
            from sklearn.datasets import load_digits

            features, labels = load_digits(return_X_y=True)
            x = torch.tensor(features, dtype=torch.float32)
            y = torch.tensor(labels, dtype=torch.long)
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(x) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class DigitsClassifier(L.LightningModule):
    """An MLP classifier trained with ``torch.optim.SGD`` (or Adam).

    Args:
        hidden: widths of the hidden layers.
        lr, momentum, nesterov, weight_decay: the optimizer settings (Adam and AdamW ignore momentum/nesterov).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
    """

    metric_name = "val/acc"
    metric_mode = "max"

    def __init__(
        self,
        hidden: Sequence[int] = (1024, 1024),
        lr: float = 0.05,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 1e-4,
        optimizer: str = "sgd",
    ) -> None:
        super().__init__()
        check_choice("model.optimizer", optimizer, ("sgd", "adam", "adamw"))
        for position, width in enumerate(hidden):
            check_int(f"model.hidden[{position}]", width, 1)
        check_range("model.lr", lr, 0.0, None, low_inclusive=False)
        check_range("model.momentum", momentum, 0.0, 1.0, high_inclusive=False)
        check_bool("model.nesterov", nesterov)
        check_range("model.weight_decay", weight_decay, 0.0, None)
        self.save_hyperparameters()
        widths = [NUM_FEATURES, *hidden]
        layers: list[nn.Module] = []
        for w_in, w_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(w_in, w_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], NUM_CLASSES))
        self.net = nn.Sequential(*layers)
        self.val_accuracy = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.train_loss = MeanMetric()  # the epoch mean, synced across ranks once, at the epoch's end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.train_loss.update(loss.detach())
        self.log("train/loss_epoch", self.train_loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_accuracy(self(x), y)
        self.log("val/acc", self.val_accuracy, on_epoch=True, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        if h.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        if h.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        return torch.optim.SGD(
            self.parameters(), lr=h.lr, momentum=h.momentum, nesterov=h.nesterov, weight_decay=h.weight_decay
        )
