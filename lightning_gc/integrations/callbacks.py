"""Training callbacks: DGC's warm-up sparsity schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_gc.common.validation import check_choice, check_int, check_range
from lightning_gc.compressors.base import AdjustableRatio
from lightning_gc.integrations.strategy import GradientCompressionStrategy

PAPER_WARMUP_DENSITIES: tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.00390625)
"""DGC's warm-up (Lin et al. 2018, §3.4): 75 %, 93.75 %, 98.4375 %, 99.6 % sparsity, one stage per epoch,
after which the strategy's own ratio (99.9 % sparsity by default) applies."""


class SparsityWarmup(Callback):
    """Raise sparsity exponentially at the start of training (DGC's warm-up training).

    Stage ``i`` sends ``max(densities[i], target)`` of each compressed tensor, where ``target`` is
    the strategy's ``compress_ratio`` when fitting starts; after the last stage, ``target``.
    With ``interval="epoch"`` stage ``i`` covers epochs ``[i e, (i + 1) e)`` for ``e =
    epochs_per_stage`` (default 1; fractions count the epoch's batches, so ``0.25`` makes the
    four stages one epoch, as the paper's language-model and speech runs warm up, whatever the
    world size and batch); with ``interval="step"`` optimizer steps ``[i s, (i + 1) s)`` for
    ``s = steps_per_stage``. The ratio is a pure function of the epoch and batch, or of the global
    step, hence identical on every rank and restored exactly on resume.

    Args:
        densities: the fraction sent in each stage, each in (0, 1]; default
            :data:`PAPER_WARMUP_DENSITIES`.
        interval: ``"epoch"`` or ``"step"``.
        steps_per_stage: stage length in optimizer steps, required with ``interval="step"``.
        epochs_per_stage: stage length in epochs (> 0) with ``interval="epoch"``; default 1.
    """

    def __init__(
        self,
        densities: Sequence[float] | None = None,
        *,
        interval: str = "epoch",
        steps_per_stage: int | None = None,
        epochs_per_stage: float | None = None,
    ) -> None:
        chosen = PAPER_WARMUP_DENSITIES if densities is None else tuple(densities)
        self.densities = tuple(
            check_range(f"densities[{i}]", d, 0.0, 1.0, low_inclusive=False) for i, d in enumerate(chosen)
        )
        self.interval = check_choice("interval", interval, ("epoch", "step"))
        if interval == "step":
            if steps_per_stage is None:
                raise ValueError("`steps_per_stage` is required with interval='step', got None")
            self.steps_per_stage: int | None = check_int("steps_per_stage", steps_per_stage, 1)
        elif steps_per_stage is not None:
            raise ValueError(
                f"`steps_per_stage` only applies to interval='step', got steps_per_stage={steps_per_stage!r} "
                f"with interval={interval!r}"
            )
        else:
            self.steps_per_stage = None
        if epochs_per_stage is not None and interval != "epoch":
            raise ValueError(
                f"`epochs_per_stage` only applies to interval='epoch', got epochs_per_stage={epochs_per_stage!r} "
                f"with interval={interval!r}"
            )
        self.epochs_per_stage = float(
            1.0
            if epochs_per_stage is None
            else check_range("epochs_per_stage", epochs_per_stage, 0.0, None, low_inclusive=False)
        )
        self.target: float | None = None

    def ratio_at(self, stage: int, target: float) -> float:
        """The ratio in force during ``stage`` (0-based) when the final ratio is ``target``."""
        return max(self.densities[stage], target) if stage < len(self.densities) else target

    @staticmethod
    def adjustable(trainer: Trainer) -> AdjustableRatio:
        """The compressor whose ratio this callback sets: ``trainer.strategy.adjustable`` of a
        :class:`~lightning_gc.GradientCompressionStrategy`; ``ValueError`` naming the strategy
        (and its compressor) when there is none."""
        strategy = trainer.strategy
        if isinstance(strategy, GradientCompressionStrategy):
            if strategy.adjustable is not None:
                return strategy.adjustable
            detail = f" with compressor {strategy.compressor.name!r}, which has no ratio"
        else:
            detail = ""
        raise ValueError(
            "SparsityWarmup needs a GradientCompressionStrategy whose compressor has a `compress_ratio` "
            f"(e.g. 'dgc_ddp', 'topk_ddp', 'randomk_ddp', 'fft_ddp'), got {type(strategy).__name__}{detail}"
        )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        compressor = self.adjustable(trainer)  # checked before training starts
        if self.target is None:  # the configured ratio, before this callback ever changed it
            self.target = float(compressor.compress_ratio)

    def steps(self, trainer: Trainer) -> int:
        """The optimizer steps the warm-up's stages last: ``stages * steps_per_stage``, or with
        ``interval="epoch"`` the steps of its whole epochs, ``ceil(B / a)`` each (Lightning steps on
        an epoch's last, partial accumulation too), plus ``ceil(rest / a)`` for the batches of a
        partial last epoch: ``B`` batches per epoch, ``a`` accumulated per step."""
        if self.steps_per_stage is not None:
            return len(self.densities) * self.steps_per_stage
        per_epoch, accumulated = trainer.num_training_batches, trainer.accumulate_grad_batches
        batches = round(len(self.densities) * self.epochs_per_stage * per_epoch, 6)  # 0.1 * 3 is not 0.3
        whole_epochs = int(batches // per_epoch)
        rest = batches - whole_epochs * per_epoch
        return whole_epochs * math.ceil(per_epoch / accumulated) + math.ceil(rest / accumulated)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A delayed exchange (`delay`) with `sync_warmup_steps` left to None stays synchronous as long as the warm-up.
        strategy = trainer.strategy
        if isinstance(strategy, GradientCompressionStrategy):
            strategy.synchronous_until(self.steps(trainer))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        assert self.target is not None
        if self.interval == "epoch":
            progress = trainer.current_epoch + batch_idx / max(1, trainer.num_training_batches)
            stage = int(progress / self.epochs_per_stage)
        else:
            assert self.steps_per_stage is not None
            stage = trainer.global_step // self.steps_per_stage
        ratio = self.ratio_at(stage, self.target)
        compressor = self.adjustable(trainer)  # the same value on every rank: a function of the step
        if compressor.compress_ratio != ratio:
            compressor.compress_ratio = ratio
