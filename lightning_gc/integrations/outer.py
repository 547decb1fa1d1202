"""The outer loop (DiLoCo family) as a Lightning Trainer strategy: ``Trainer(strategy="diloco")``.

Each rank takes ``sync_every`` inner optimizer steps on its own gradients (any optimizer; DDP
sends nothing: its comm hook hands every bucket back unchanged), then the ranks average their
compressed, error-fed pseudo-gradients once and take one outer SGD step together
(:class:`~lightning_gc.runtime.outer.OuterLoop`, whose docstring has the maths; DESIGN.md §9).

What the Trainer sees:

* ``theta_g`` (the last synchronised weights) with the floating-point buffers averaged at the last
  sync (``buffers_g``) is what users evaluate and keep: validation during the fit runs on them
  (swapped into the module, this rank's ``theta_r`` and own buffers restored after), and
  checkpoints hold them as the model's weights.
* The end of the fit syncs once more when inner steps remain since the last sync (``max_steps`` not
  a multiple of ``sync_every``) or an exchange is in flight (``sync_delay``; it lands first):
  after ``fit`` every rank's module holds the same ``theta_g`` (checkpoints written during the fit
  precede that sync; ``trainer.save_checkpoint`` after it does not).
* Streaming (``fragments``, ``sync_delay``, ``mix``; :mod:`lightning_gc.runtime.outer_fragments`):
  each fragment's ``theta_g`` moves at its own steps; validation and checkpoints take every
  fragment's latest ``theta_g``, and a checkpoint holds the average of an exchange in flight, which
  the resumed run applies at the step it would have.
* A checkpoint also holds, under ``"lightning_gc_outer"``, every rank's outer-loop state, its own
  ``theta_r`` and floating-point buffers, its inner optimizer's state and its precision plugin's
  state (a GradScaler's scale follows the rank's own overflows; Lightning keeps rank 0's only);
  resuming with the same number of ranks continues exactly, also between syncs.
* Gradient accumulation and mixed precision work as under DDP: one inner step per optimizer step;
  one optimizer per fit (a second is refused at set-up: each of its steps would count as an inner step).
* ``outer/syncs`` and ``outer/bytes_sent`` (this rank's running totals) are logged every step.

DDP's per-forward buffer sync is off by default here: buffers (BatchNorm statistics) stay local
between syncs and are averaged at each sync, rather than rank 0's sent at every forward.
"""

from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.compressors.base import AdjustableRatio, Compressor
from lightning_gc.integrations.local_ddp import LOCAL_BUFFERS, keep_local_gradients
from lightning_gc.integrations.outer_attach import (
    OUTER_CHECKPOINT_KEY,
    OUTER_PRESETS,
    OuterArguments,
    gather_outer_entry,
    outer_loop,
    outer_rank_state,
    resume_outer,
)
from lightning_gc.integrations.outer_lightning import register_presets, split_strategy_arguments
from lightning_gc.runtime.outer import LocalWeights, OuterLoop
from lightning_gc.runtime.teardown import shut_down_process_group_at_exit

__all__ = ["OUTER_PRESETS", "OuterLoopStrategy", "outer_loop", "register_outer_strategies"]


class _OuterFirst(Callback):
    """The Trainer's first callback (the strategy puts it there): every other callback sees ``theta_g``
    during validation (swapped back by the strategy's ``on_validation_end``, after theirs) and after the
    final sync at the end of training (before e.g. weight averaging reads the weights)."""

    def __init__(self, strategy: "OuterLoopStrategy") -> None:
        self.strategy = strategy

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.swap_in_global()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.strategy.finish_training()


class OuterLoopStrategy(DDPStrategy):
    """DDP without gradient averaging, synchronised every ``sync_every`` steps by an outer loop.

    Args:
        preset: ``"diloco"`` (exact average, outer Nesterov SGD lr 0.7 momentum 0.9),
            ``"diloco_int8"`` (unbiased 8-bit codes scaled by each 512-element chunk's ``max|x|``, ``int8``,
            two-phase from 3 ranks) or ``"sparseloco"`` (``chunk_topk`` 2 % with
            ``error_decay=0.95``, outer SGD lr 1 without momentum); :data:`OUTER_PRESETS`.
        **kwargs: overrides of the preset: ``sync_every``, ``compressor`` (a name or a
            :class:`~lightning_gc.compressors.Compressor`), ``error_decay``, ``outer_lr``,
            ``outer_momentum``, ``outer_nesterov``, ``fragments``, ``sync_delay``, ``mix`` (default
            1, 0, 0.0: no streaming), the compressor's own arguments (e.g. ``compress_ratio``);
            and anything :class:`~lightning.pytorch.strategies.DDPStrategy` or
            ``DistributedDataParallel`` take (``timeout``, ``start_method``, ...). Unknown names
            and bad values raise ``ValueError`` here, in one line naming them.
    """

    def __init__(self, preset: str = "diloco", **kwargs: Any) -> None:
        self.outer_arguments: OuterArguments
        self.outer_arguments, kwargs = split_strategy_arguments(type(self).__name__, preset, kwargs, DDPStrategy)
        super().__init__(**kwargs)
        self.outer: OuterLoop | None = None
        """The fit's outer loop, built when DDP wraps the module (a new one each fit)."""
        self._swap: ExitStack | None = None  # open while theta_g is in the module (OuterLoop.global_weights)
        self._local: LocalWeights | None = None  # this rank's own weights meanwhile
        self._pending: dict[str, Any] | None = None  # this rank's part of a loaded checkpoint
        self._finished = True

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_outer_strategies(strategy_registry)

    # ------------------------------------------------------------------ public knobs
    @property
    def compressor(self) -> Compressor:
        """The configured codec, a template: every fragment of each fit's outer loop runs its own
        copy (``outer.compressor`` is fragment 0's)."""
        return self.outer_arguments.compressor

    @property
    def adjustable(self) -> AdjustableRatio | None:
        """The configured compressor as an :class:`~lightning_gc.compressors.base.AdjustableRatio`,
        or ``None`` (a template: a ratio set here applies to the outer loops built after)."""
        return self.compressor if isinstance(self.compressor, AdjustableRatio) else None

    @property
    def totals(self) -> dict[str, float]:
        """Running sums of the fit (this rank): ``steps`` (inner), ``syncs``, ``bytes_sent``, and
        ``dense_bytes``, what plain DDP would have all-reduced for as many steps."""
        if self.outer is None:
            return {"steps": 0, "syncs": 0, "bytes_sent": 0, "dense_bytes": 0}
        dense = sum(t.numel() * t.element_size() for t in self.outer.global_parameters.values())
        steps, syncs, sent = self.outer.inner_steps, self.outer.syncs, self.outer.bytes_sent
        return {"steps": steps, "syncs": syncs, "bytes_sent": sent, "dense_bytes": dense * steps}

    # ------------------------------------------------------------------ wiring
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # DDPStrategy's, with buffers kept local between syncs unless asked otherwise (module docstring)
        device_ids = self.determine_ddp_device_ids()
        ddp_kwargs = {LOCAL_BUFFERS: False, **self._ddp_kwargs}
        with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext():
            return DistributedDataParallel(module=model, device_ids=device_ids, **ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        # Replaces DDPStrategy's (CUDA only): on every device, gradients stay on their rank.
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(None, keep_local_gradients)
        self._swap = self._local = None  # a new outer loop: nothing of the last one is swapped in
        self.outer = self.outer_arguments.build(self.model.module)  # all ranks, the default group
        if self._pending is not None:
            resume_outer(self.outer, self._pending)
            self._pending = None

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._finished = False
            if not any(isinstance(c, _OuterFirst) and c.strategy is self for c in trainer.callbacks):
                trainer.callbacks.insert(0, _OuterFirst(self))

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) > 1:  # as Fabric's front end: each optimizer.step() would count as an inner step
            raise ValueError(
                f"{type(self).__name__} counts every optimizer step as one inner step; configure_optimizers "
                f"returned {len(self.optimizers)} optimizers (use one optimizer with param groups)"
            )

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.outer is not None
        self.outer.inner_step_done()
        module = self.lightning_module
        if module is not None and module._current_fx_name is not None:
            metrics = {"outer/syncs": float(self.outer.syncs), "outer/bytes_sent": float(self.outer.bytes_sent)}
            module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return output

    def _fitting(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return self.outer is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def swap_in_global(self) -> None:
        """During the fit: put ``theta_g`` and ``buffers_g`` into the module, this rank's own
        weights aside (idempotent): :meth:`OuterLoop.global_weights` held open until :meth:`swap_back`."""
        if self._swap is None and self._fitting():
            assert self.outer is not None
            swap = ExitStack()
            self._local = swap.enter_context(self.outer.global_weights())
            self._swap = swap

    def swap_back(self) -> None:
        """Put this rank's own weights back into the module after :meth:`swap_in_global`."""
        if self._swap is not None:
            swap, self._swap, self._local = self._swap, None, None
            swap.close()

    def _global_state(self) -> dict[str, torch.Tensor]:
        """``theta_g`` and ``buffers_g`` under every name the module's state dict gives them (tied
        parameters and shared buffers under each of their names)."""
        assert self.outer is not None
        module = self.outer.module
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        by_id = {id(params[name]): t for name, t in self.outer.global_parameters.items()}
        by_id |= {id(buffers[name]): t for name, t in self.outer.global_buffers.items()}
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        return {name: by_id[id(t)] for name, t in named if id(t) in by_id}

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.swap_in_global()  # done by the first callback already, unless it was removed

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.swap_back()  # after every callback's on_validation_end (checkpoints hold theta_g)

    def finish_training(self) -> None:
        """Once per fit: a final sync when inner steps remain since the last one or an exchange is
        in flight, so that the fit ends with ``theta_g`` in every rank's module."""
        if self._finished or self.outer is None:
            return
        self._finished = True
        self.swap_back()
        self.outer.finish()

    def on_train_end(self) -> None:
        self.finish_training()
        super().on_train_end()
        shut_down_process_group_at_exit()  # gloo's threads must stop before interpreter finalization

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """The model's weights become ``theta_g``; every rank's state is added (a collective:
        every rank calls it, as Lightning does)."""
        if self._fitting():  # during the fit, or after it (not after loading another checkpoint to evaluate)
            assert self.outer is not None
            state_dict = checkpoint.get("state_dict")
            if state_dict is not None:
                for name, value in self._global_state().items():
                    if name in state_dict:  # in the module's dtype (theta_g is float32 for a half-precision one)
                        state_dict[name] = value.detach().to(state_dict[name].dtype, copy=True)
            optimizer_states = [self.optimizer_state(o) for o in self.optimizers]
            precision = self.precision_plugin.state_dict()  # this rank's (a GradScaler's scale is per rank)
            entry = gather_outer_entry(
                self.outer, local=self._local, optimizer_states=optimizer_states, precision=precision
            )
            checkpoint[OUTER_CHECKPOINT_KEY] = {**entry, "preset": self.outer_arguments.preset}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            return checkpoint  # evaluation: the weights (theta_g) are all it needs
        entry = checkpoint.get(OUTER_CHECKPOINT_KEY)
        if entry is None:
            rank_zero_info(f"lightning_gc: checkpoint {checkpoint_path} holds no outer-loop state; it starts afresh")
            return checkpoint
        # this rank's part, applied when the outer loop is built (setup)
        self._pending = outer_rank_state(
            entry, source=checkpoint_path, rank=self.global_rank, world_size=self.world_size
        )
        checkpoint["optimizer_states"] = self._pending["optimizers"]  # this rank's, which Lightning restores next
        if self._pending.get("precision"):  # this rank's precision plugin state (GradScaler), restored next too
            checkpoint[type(self.precision_plugin).__qualname__] = self._pending["precision"]
        return checkpoint


def register_outer_strategies(strategy_registry: _StrategyRegistry) -> None:
    """Register ``"diloco"``, ``"diloco_int8"`` and ``"sparseloco"`` with the Trainer's registry
    (idempotent: names already there are kept)."""
    register_presets(strategy_registry, OuterLoopStrategy, "outer loop")
