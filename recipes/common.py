"""What every recipe shares: the SGD + warm-up schedule, the datamodules' common arguments and
loaders, synthetic data, and missing-data errors."""

from __future__ import annotations

import functools
import math
import os
import urllib.error
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from lightning_gc.common.validation import check_choice, check_int, check_range
from recipes.plain import WarmupMultiStep


class RecipeTask(L.LightningModule):
    """Base of the recipes' modules: a plain ``torch.optim.SGD`` (or ``AdamW``) with :class:`WarmupMultiStep`.

    The optimizer keeps its momentum and weight decay; a DGC strategy takes them over itself
    (momentum correction; for AdamW after its variance freezes), a dense strategy leaves them where
    they are.

    Args:
        optimizer: ``"sgd"`` or ``"adamw"`` (``torch.optim.AdamW``, betas (0.9, 0.999)).
        lr: peak learning rate (reached at the end of the warm-up).
        momentum, nesterov: ``torch.optim.SGD``'s (AdamW ignores them).
        weight_decay: SGD's L2 term or AdamW's decoupled decay.
        lr_warmup_epochs: length of the linear warm-up in epochs (0: none).
        lr_warmup_start: factor of ``lr`` the warm-up starts from.
        lr_milestones: epochs at which the learning rate is multiplied by ``lr_gamma``.
        lr_gamma: the decay factor.
    """

    metric_name: str = "val/loss"
    """The metric the run reports (``result.json``'s ``metric``)."""
    metric_mode: str = "min"
    """``"min"`` or ``"max"``: which way the metric improves."""

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 1e-4,
        lr_warmup_epochs: float = 0.0,
        lr_warmup_start: float = 0.1,
        lr_milestones: Sequence[float] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        # checked here, with the config's names, so a bad value fails before any process starts
        self.optimizer_name = check_choice("model.optimizer", optimizer, ("sgd", "adamw"))
        check_range("model.lr", lr, 0.0, low_inclusive=False)
        check_range("model.momentum", momentum, 0.0, 1.0, high_inclusive=False)
        check_range("model.weight_decay", weight_decay, 0.0)
        check_range("model.lr_warmup_epochs", lr_warmup_epochs, 0.0)
        check_range("model.lr_warmup_start", lr_warmup_start, 0.0, 1.0)
        for i, milestone in enumerate(lr_milestones):
            check_range(f"model.lr_milestones[{i}]", milestone, 0.0)
        check_range("model.lr_gamma", lr_gamma, 0.0, 1.0, low_inclusive=False)
        self.lr, self.momentum, self.nesterov, self.weight_decay = lr, momentum, nesterov, weight_decay
        self.lr_warmup_epochs, self.lr_warmup_start = lr_warmup_epochs, lr_warmup_start
        self.lr_milestones, self.lr_gamma = list(lr_milestones), lr_gamma

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer: torch.optim.Optimizer
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        else:
            optimizer = torch.optim.SGD(
                self.parameters(),
                lr=self.lr,
                momentum=self.momentum,
                nesterov=self.nesterov,
                weight_decay=self.weight_decay,
            )
        self.lr_schedule = WarmupMultiStep(
            None, self.lr_warmup_epochs, self.lr_milestones, self.lr_gamma, self.lr_warmup_start
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        """The schedule's epoch length, now that the fit loop has loaded the training data."""
        trainer = self.trainer
        batches = trainer.num_training_batches
        if math.isfinite(batches):
            self.lr_schedule.steps_per_epoch = max(1, math.ceil(batches / trainer.accumulate_grad_batches))
        elif self.lr_warmup_epochs or self.lr_milestones:
            raise ValueError(
                "`model.lr_warmup_epochs` and `model.lr_milestones` are in epochs, which need a training loader "
                f"with a length; this one has {batches} batches. Leave them at 0 and [] for it"
            )


class RecipeDataModule(L.LightningDataModule):
    """Base of the recipes' datamodules: checks the arguments they share and builds their loaders.

    Args:
        root: the dataset's directory (``data.root``), resolved to an absolute path.
        batch_size: per-process batch size (``data.batch_size`` >= 1).
        num_workers: loader worker processes (``data.num_workers`` >= 0), at most the cores each
            training process has to spare (:func:`loader_workers`); synthetic data is made in the
            main process.
        synthetic: use made-up samples instead of files.
        synthetic_size: number of made-up training samples (``data.synthetic_size`` >= 1).

    Subclasses set ``train_set`` and ``val_set`` in ``setup``; the training loader shuffles and
    drops the last partial batch, the validation loader does neither.
    """

    def __init__(self, root: str, batch_size: int, num_workers: int, synthetic: bool, synthetic_size: int) -> None:
        super().__init__()
        self.root = Path(root).expanduser().resolve()
        self.batch_size = check_int("data.batch_size", batch_size, 1)
        self.num_workers = check_int("data.num_workers", num_workers, 0)
        self.synthetic = bool(synthetic)
        self.synthetic_size = check_int("data.synthetic_size", synthetic_size, 1)

    def loader_options(self) -> dict[str, Any]:
        """Further ``DataLoader`` arguments of a subclass (e.g. ``collate_fn``, ``pin_memory``)."""
        return {}

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        local_processes = self.trainer.num_devices if self.trainer is not None else 1
        workers = 0 if self.synthetic else loader_workers(self.num_workers, local_processes)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=workers,
            persistent_workers=workers > 0,
            **self.loader_options(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)


def loader_workers(requested: int, local_processes: int) -> int:
    """``requested`` loader workers, capped at the cores each of this machine's ``local_processes``
    training processes has besides its own: a worker beyond that competes with training for a core
    (the recipes' 4 workers per process would be 8 extra processes on a 2-core machine)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(0, min(requested, cores // max(1, local_processes) - 1))
    if workers < requested:
        _say_once(
            f"data.num_workers={requested} lowered to {workers}: {cores} cores for {local_processes} training processes"
        )
    return workers


@functools.cache
def _say_once(message: str) -> None:
    """``message`` on rank 0, the first time only (the training and validation loaders both ask)."""
    rank_zero_info(message)


class SyntheticDataset(Dataset):
    """``size`` made-up samples, each ``make(generator)`` with a generator seeded by (seed, index).

    Deterministic: the same index gives the same sample in every process and epoch.
    """

    def __init__(self, size: int, make: Callable[[torch.Generator], Any], seed: int = 0) -> None:
        self.size = check_int("synthetic_size", size, 1)
        self.make = make
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        return self.make(torch.Generator().manual_seed(self.seed * 1_000_003 + index))


class DownloadFailed(RuntimeError):
    """A dataset download that could not reach its server; the message says what to do offline."""


@contextmanager
def fetching(name: str, url: str, root: Path) -> Iterator[None]:
    """Run a download, turning a network failure into a :class:`DownloadFailed` that says what to
    do offline."""
    try:
        yield
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise DownloadFailed(
            f"downloading {name} from {url} failed ({error}). Without network access, put the files under "
            f"data.root={str(root)!r} and set data.download=false, or use data.synthetic=true for a smoke test."
        ) from error


def dataset_missing(name: str, root: Path, expected: str, how: str) -> FileNotFoundError:
    """The error every datamodule raises when its files are not where ``data.root`` points."""
    return FileNotFoundError(
        f"{name} not found under data.root={str(root)!r}: expected {expected}. {how} "
        f"Or run a smoke test on made-up data with data.synthetic=true."
    )
