"""Lightning strategies: DDP whose gradient exchange goes through a compressor.

:class:`GradientCompressionStrategy` is wiring: it parses its arguments into a compressor and
:class:`~lightning_gc.runtime.settings.CompressionSettings`, and calls a
:class:`~lightning_gc.runtime.session.CompressionSession` (which owns the hook, the memory, the momentum
hand-over, the statistics and the checkpoint state) at Lightning's points: registration on every
device (Lightning's own ``DDPStrategy`` only registers comm hooks on CUDA and silently ignores them
on CPU), each optimizer step, logging ``gc/*`` statistics, the end of training, and saving and
restoring every rank's state in checkpoints.

The Deep Gradient Compression preset, :class:`~lightning_gc.integrations.dgc.DGCStrategy`, is its
subclass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.common.validation import check_timeout
from lightning_gc.compressors.base import AdjustableRatio, Compressor
from lightning_gc.compressors.registry import available as available_compressors
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.integrations.ddp_arguments import OWNED_DDP_ARGUMENTS, ddp_argument_names
from lightning_gc.runtime.build import PRESETS, build_session
from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY, no_entry_notice
from lightning_gc.runtime.hook import CompressionHookState
from lightning_gc.runtime.settings import CompressionSettings
from lightning_gc.runtime.teardown import shut_down_process_group_at_exit


class _SkippedStep(Exception):
    """Raised inside the optimizer closure to skip ``optimizer.step`` on every rank."""


class _OwedAveragesFirst(Callback):
    """The Trainer's first callback, put there by the strategy: at the end of training, what a
    delay still owes lands before any other callback reads the weights. Lightning calls the
    callbacks' ``on_train_end`` before the strategy's, and ``StochasticWeightAveraging`` or
    ``WeightAveraging`` swap their averaged weights in there: applied after them, the owed
    averages would move the averaged weights."""

    def __init__(self, strategy: GradientCompressionStrategy) -> None:
        self.strategy = strategy

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.finish_training()


class GradientCompressionStrategy(DDPStrategy):
    """DDP with compressed gradient exchange.

    Args:
        compressor: a compressor name from :func:`lightning_gc.compressors.available` (its
            arguments are then taken from ``**kwargs``) or a
            :class:`~lightning_gc.compressors.Compressor` object.
        **kwargs: any :class:`~lightning_gc.runtime.settings.CompressionSettings` field
            (``momentum_correction``, ``clip_norm``, ``nonfinite``, ``delay``, ``hierarchy``, ...;
            each documented there), the named compressor's arguments (e.g. ``compress_ratio``), and
            anything :class:`~lightning.pytorch.strategies.DDPStrategy` or ``DistributedDataParallel``
            take (e.g. ``bucket_cap_mb``, ``find_unused_parameters``, ``start_method``,
            ``timeout``). Unknown names raise ``ValueError`` here, not at setup. ``timeout`` (a
            ``timedelta`` or seconds; torch's default is 30 minutes) bounds every collective: a
            rank whose peer died stops with an error within it (on gloo, usually at once).
    """

    preset: str | None = None
    """The :data:`~lightning_gc.runtime.build.PRESETS` entry whose settings this class defaults to."""

    def __init__(self, compressor: str | Compressor = "none", **kwargs: Any) -> None:
        owned = sorted(set(kwargs) & set(OWNED_DDP_ARGUMENTS))
        if owned:
            raise ValueError(
                f"{type(self).__name__} installs its own DDP comm hook; remove {owned} "
                "(use DDPStrategy directly for a custom hook)"
            )
        self.session = build_session(
            compressor, kwargs, owner=type(self).__name__, preset=self.preset, others={"DDP": ddp_argument_names()}
        )
        self._training_finished = False  # this fit's owed averages applied (finish_training)
        if "timeout" in kwargs:
            kwargs["timeout"] = check_timeout("timeout", kwargs["timeout"])
        super().__init__(**kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"<name>_ddp"`` for every compressor without a dedicated preset class."""
        for name in available_compressors():
            preset = f"{name}_ddp"
            if name not in PRESETS and preset not in strategy_registry:
                strategy_registry.register(
                    preset, cls, description=f"DDP with the {name!r} gradient compressor", compressor=name
                )

    # ------------------------------------------------------------------ public knobs
    @property
    def compressor(self) -> Compressor:
        return self.session.compressor

    @property
    def settings(self) -> CompressionSettings:
        return self.session.settings

    @property
    def memory(self) -> CompensationMemory:
        return self.session.memory

    @property
    def totals(self) -> dict[str, float]:
        """Running sums over every step of the run: ``steps``, ``bytes_sent``, ``dense_bytes``, ``skipped_steps``."""
        return self.session.totals

    @property
    def adjustable(self) -> AdjustableRatio | None:
        """The compressor as an :class:`~lightning_gc.compressors.base.AdjustableRatio`, or ``None``
        when it has no ratio (quantisers, PowerSGD, casts)."""
        return self.compressor if isinstance(self.compressor, AdjustableRatio) else None

    @property
    def compress_ratio(self) -> float:
        """The compressor's current ratio; :class:`~lightning_gc.SparsityWarmup` sets it."""
        return self._ratio_owner().compress_ratio

    @compress_ratio.setter
    def compress_ratio(self, value: float) -> None:
        self._ratio_owner().compress_ratio = value

    def _ratio_owner(self) -> AdjustableRatio:
        if self.adjustable is None:
            raise AttributeError(f"compressor {self.compressor.name!r} has no compress_ratio")
        return self.adjustable

    @property
    def hook_state(self) -> CompressionHookState | None:
        """The comm hook's state once DDP is set up (layouts, step counter, stats)."""
        return self.session.hook_state

    # ------------------------------------------------------------------ wiring
    def _register_ddp_hooks(self) -> None:
        # Replaces DDPStrategy's, which registers comm hooks on CUDA only.
        assert isinstance(self.model, DistributedDataParallel)
        unused = bool(self._ddp_kwargs.get("find_unused_parameters", False))
        self.session.attach(self.model, find_unused_parameters=unused, devices_per_node=self.num_processes)

    def synchronous_until(self, steps: int) -> None:
        """Make the first ``steps`` optimizer steps synchronous when ``sync_warmup_steps`` was left
        to its default (``None``); a sparsity warm-up calls it as training starts, before any step."""
        self.session.synchronous_until(steps)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            # the fit's length, read only by the Adam hand-over's "auto" warm-up (lightning_gc.runtime.adam_plan)
            self.session.start_fit(
                self.optimizers,
                lambda: trainer.estimated_stepping_batches,
                length_hint="a Trainer with max_steps=-1 and max_epochs=-1 (or an iterable dataset without a "
                "length and no max_steps) cannot estimate it; set Trainer(max_steps=...)",
            )
            self._training_finished = False
            if not any(isinstance(c, _OwedAveragesFirst) and c.strategy is self for c in trainer.callbacks):
                trainer.callbacks.insert(0, _OwedAveragesFirst(self))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        scaler = getattr(self.precision_plugin, "scaler", None)
        self.session.before_step(self.optimizers, None if scaler is None else float(scaler.get_scale()))

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        try:
            with self.session.stepping([optimizer]):
                output = super().optimizer_step(optimizer, self._settling(closure, optimizer), model, **kwargs)
        except _SkippedStep:
            output = None
            rank_zero_warn(f"lightning_gc: non-finite gradient; step {self.lightning_module.global_step} skipped")
        self._log(self.session.after_step())
        assert isinstance(self.model, DistributedDataParallel)
        self.session.verify(self.model)
        return output

    def _settling(self, closure: Callable[[], Any], optimizer: Any) -> Callable[[], Any]:
        """``closure`` (forward + backward), then the step's non-finite check settled on every rank:
        a skipped step never reaches the optimizer."""

        def settled() -> Any:
            result = closure()
            if self.session.settle(optimizer):
                raise _SkippedStep
            return result

        return settled

    def _log(self, metrics: dict[str, float] | None) -> None:
        module = self.lightning_module
        if metrics is None or not self.settings.log_stats or module is None or module._current_fx_name is None:
            return
        module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def finish_training(self) -> None:
        """Apply what a delay still owes, once per fit (see :meth:`CompressionSession.finish`):
        from the first callback's ``on_train_end``, or else from the strategy's."""
        if not self._training_finished:
            self._training_finished = True
            assert isinstance(self.model, DistributedDataParallel)
            self.session.finish(self.model, self.optimizers)

    def on_train_end(self) -> None:
        self.finish_training()
        super().on_train_end()
        # Lightning shuts NCCL groups down at exit but leaves gloo's to interpreter finalization,
        # where its worker threads can abort a finished run (see lightning_gc.runtime.teardown). Only after
        # training ended normally: a rank failing mid-step could wait there for its collectives.
        shut_down_process_group_at_exit()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Adds every rank's compression state; must be called on all ranks (Lightning does)."""
        if self.hook_state is not None:
            # the LightningModule, wrapped by DDP or (after fit) not: the compression state lives on
            assert self.lightning_module is not None
            optimizer_states = [self.optimizer_state(o) for o in self.optimizers] if self.settings.local_update else []
            checkpoint[CHECKPOINT_KEY] = self.session.checkpoint_entry(
                self.lightning_module, optimizer_states, rank=self.global_rank, world_size=self.world_size
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        entry = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            return checkpoint  # validate/test/predict exchange no gradients: any world size will do
        if entry is None:
            rank_zero_info(no_entry_notice(checkpoint_path))
            return checkpoint
        # Lightning loads checkpoints before setup, and every fit's setup builds a new hook state
        # (a second fit on the same Trainer too), which takes this over.
        own_optimizer_states = self.session.resume(
            entry, source=checkpoint_path, rank=self.global_rank, world_size=self.world_size
        )
        if own_optimizer_states is not None:  # local updates: this rank's, which Lightning restores next
            checkpoint["optimizer_states"] = own_optimizer_states
        return checkpoint
