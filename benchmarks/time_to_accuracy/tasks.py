"""What is trained: the two real tasks (and their smoke-sized twins), their data, model and metric.

* ``cifar10``: ResNet-20 (``recipes.plain.resnet_cifar``) on a seeded subset of CIFAR-10's
  training JPEGs (the shared archive, read by ``recipes.images.CIFAR10DataModule``), 5,000 images
  held out for evaluation and never trained on; random crops of the 4-pixel padded image and
  horizontal flips; SGD lr 0.1, momentum 0.9, weight decay 1e-4, global batch 128 (2 x 64),
  lr x0.1 at 60 % and 85 % of the epochs (``benchmarks/accuracy.py``'s cifar10 task); metric:
  held-out top-1 %; DGC's sparsity warm-up: one epoch per stage.
* ``ptb``: a 2-layer LSTM of 200 units with tied embeddings (``recipes.language.LSTMLanguageModel``'s
  network, as :mod:`.nets`, dropout 0.2) on Penn Treebank's training text, 2 x 20 windows of 35 tokens, SGD lr 2.0,
  momentum 0.9, one warm-up epoch, lr x0.25 at 60 % and 85 % of the epochs, gradient clipping
  0.25 (DGC: each tensor locally to 0.25 / sqrt(N)) (``benchmarks/accuracy.py``'s lstm_ptb
  task); metric: perplexity of ``ptb.valid.txt``; DGC's warm-up: a quarter epoch per stage.

``--smoke`` keeps the code path and shrinks everything: ResNet-8 on random 32x32 images whose
labels a linear map of the pixels decides, a 16-unit LSTM on random tokens.

The data are prepared once (:func:`prepare`, in the driver) into one ``.pt`` file that every
worker loads. The data order is a pure function of (seed, epoch, rank) and augmentation of
(seed, rank, step): every mode sees the same batches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.time_to_accuracy import nets
from recipes.plain import WarmupMultiStep

TASKS = ("cifar10", "ptb")
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # recipes.images'
WORLD = 2


@dataclass(frozen=True)
class TaskConfig:
    """Everything a worker needs to rebuild the task; plain data, saved in every record."""

    name: str
    smoke: bool
    metric: str
    higher_is_better: bool
    batch_size: int  # per rank
    epochs: float
    lr: float
    momentum: float
    weight_decay: float
    lr_warmup_epochs: float
    lr_milestones: tuple[float, ...]
    lr_gamma: float
    clip_norm: float | None
    stage_epochs: float  # DGC sparsity warm-up: epochs per stage
    momentum_masking: bool
    train_size: int | None = None  # cifar10: images trained on
    width: int = 200  # ptb: LSTM units
    bptt: int = 35

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def config(name: str, *, smoke: bool = False, epochs: float | None = None, train_size: int | None = None) -> TaskConfig:
    """The task's configuration; ``epochs`` and ``train_size`` override the defaults (16 and 20,000
    for cifar10, 4 for ptb)."""
    if name == "cifar10":
        chosen = epochs or (1 if smoke else 16)
        return TaskConfig(
            name, smoke, "top-1 %", True, batch_size=4 if smoke else 64, epochs=chosen, lr=0.1, momentum=0.9,
            weight_decay=1e-4, lr_warmup_epochs=0.0, lr_milestones=(round(0.6 * chosen), round(0.85 * chosen)),
            lr_gamma=0.1, clip_norm=None, stage_epochs=1.0, momentum_masking=True,
            train_size=train_size or (64 if smoke else 20_000),
        )  # fmt: skip
    if name == "ptb":
        chosen = epochs or (1 if smoke else 4)
        return TaskConfig(
            name, smoke, "perplexity", False, batch_size=4 if smoke else 20, epochs=chosen, lr=2.0, momentum=0.9,
            weight_decay=0.0, lr_warmup_epochs=1.0, lr_milestones=(round(0.6 * chosen), round(0.85 * chosen)),
            lr_gamma=0.25, clip_norm=0.25, stage_epochs=0.25, momentum_masking=False,
            width=16 if smoke else 200, bptt=8 if smoke else 35,
        )  # fmt: skip
    raise ValueError(f"unknown task {name!r}; tasks are {TASKS}")


def _synthetic_images(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=generator)
    projection = torch.randn(3 * 32 * 32, 10, generator=torch.Generator().manual_seed(12345))
    return images, (images.flatten(1).float() / 255 - 0.5).matmul(projection).argmax(1)


def prepare(cfg: TaskConfig, data_root: Path, cache: Path) -> Path:
    """Read (or make) the task's data once into ``cache/<task>-....pt``; returns its path."""
    size = f"{cfg.train_size}-images" if cfg.name == "cifar10" else f"bptt-{cfg.bptt}"
    path = cache / f"{cfg.name}-{'smoke' if cfg.smoke else 'real'}-{size}.pt"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    if cfg.name == "cifar10" and cfg.smoke:
        (train_x, train_y), (val_x, val_y) = _synthetic_images(cfg.train_size or 64, 0), _synthetic_images(64, 1)
        data = {"train": (train_x, train_y), "val": (val_x, val_y), "vocab": 0}
    elif cfg.name == "cifar10":
        from recipes.images import CIFAR10DataModule

        module = CIFAR10DataModule(
            root=str(data_root / "cifar10"), download=False, val_size=5000, split_seed=0,
            train_size=cfg.train_size, num_workers=0,
        )  # fmt: skip
        module.require_files()
        train, val = module.real_datasets()
        data = {"train": (train.images, train.labels), "val": (val.images, val.labels), "vocab": 0}
    else:
        from recipes.language import PTBDataModule

        module = PTBDataModule(root=str(data_root / "ptb"), bptt=cfg.bptt, vocab_size=50, synthetic=cfg.smoke)
        module.setup("fit")
        stacked = {}
        for split, dataset in (("train", module.train_set), ("val", module.val_set)):
            if cfg.smoke:  # SyntheticDataset: materialise (64 training windows, 16 held out)
                dataset = [dataset[i] for i in range(min(len(dataset), 64 if split == "train" else 16))]
                stacked[split] = tuple(torch.stack(part) for part in zip(*dataset))
            else:
                stacked[split] = dataset.tensors
        data = {**stacked, "vocab": module.vocab_size}
    torch.save(data, path)
    return path


class TaskData:
    """The prepared tensors and the deterministic batch order (module docstring)."""

    def __init__(self, cfg: TaskConfig, path: Path, seed: int) -> None:
        loaded = torch.load(path)
        self.cfg, self.seed = cfg, seed
        self.train_x, self.train_y = loaded["train"]
        self.val_x, self.val_y = loaded["val"]
        self.vocab = int(loaded["vocab"])
        self.steps_per_epoch = max(1, len(self.train_x) // (WORLD * cfg.batch_size))
        self._order: tuple[tuple[int, int], torch.Tensor] | None = None

    def total_steps(self) -> int:
        return max(1, round(self.cfg.epochs * self.steps_per_epoch))

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch of optimizer step ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if self._order is None or self._order[0] != (epoch, rank):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = ((epoch, rank), torch.randperm(len(self.train_x), generator=generator)[rank::WORLD])
        size = self.cfg.batch_size
        index = self._order[1][within * size : (within + 1) * size]
        x, y = self.train_x[index], self.train_y[index]
        if self.cfg.name == "cifar10":
            x = augment(x, torch.Generator().manual_seed((self.seed * 7919 + rank) * 1_000_003 + step))
        return x, y

    def held_out(self, rank: int, size: int = 500) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the held-out split, in batches."""
        x, y = self.val_x[rank::WORLD], self.val_y[rank::WORLD]
        if self.cfg.name == "cifar10":
            x = normalize(x.float().div(255))
        return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def normalize(images: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    return (images - mean) / std


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``RandomCrop(32, padding=4)`` and ``RandomHorizontalFlip`` of uint8 images, then normalised
    (the recipe's transform), from ``generator`` alone."""
    count = len(images)
    padded = nn.functional.pad(images.float().div(255), (4, 4, 4, 4))
    offsets = torch.randint(0, 9, (count, 2), generator=generator).tolist()
    flips = torch.rand(count, generator=generator) < 0.5
    crops = torch.stack([padded[i, :, r : r + 32, c : c + 32] for i, (r, c) in enumerate(offsets)])
    crops[flips] = crops[flips].flip(-1)
    return normalize(crops)


def build_model(cfg: TaskConfig, vocab: int) -> nn.Module:
    """The task's network (seed the global RNG first: every rank must build the same weights)."""
    if cfg.name == "cifar10":
        return nets.resnet_cifar(8 if cfg.smoke else 20)
    return nets.LanguageModel(vocab, cfg.width, num_layers=2, dropout=0.2)


def loss(cfg: TaskConfig, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if cfg.name == "cifar10":
        return nn.functional.cross_entropy(output, target)
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def evaluation_sums(cfg: TaskConfig, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """(correct, images) or (summed token cross-entropy, tokens) over ``batches``: summed across
    ranks, :func:`metric_of` turns them into the metric."""
    total, count = 0.0, 0.0
    with torch.no_grad():
        for x, y in batches:
            output = model(x)
            if cfg.name == "cifar10":
                total += float((output.argmax(1) == y).sum())
            else:
                total += float(nn.functional.cross_entropy(output.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
    return [total, count]


def metric_of(cfg: TaskConfig, total: float, count: float) -> float:
    return 100.0 * total / count if cfg.name == "cifar10" else math.exp(total / count)


def optimizer_and_schedule(cfg: TaskConfig, model: nn.Module, steps_per_epoch: int) -> tuple[Any, Any]:
    """``torch.optim.SGD`` and the recipes' warm-up + step-decay schedule (per optimizer step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    factor = WarmupMultiStep(steps_per_epoch, cfg.lr_warmup_epochs, cfg.lr_milestones, cfg.lr_gamma)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def from_dict(values: dict[str, Any]) -> TaskConfig:
    return replace(
        config(values["name"], smoke=values["smoke"]), **{**values, "lr_milestones": tuple(values["lr_milestones"])}
    )
