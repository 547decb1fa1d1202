"""The outer loop (DiLoCo family) for Lightning Fabric: ``Fabric(strategy="diloco")``.

A Fabric strategy, as the per-step compression is (:mod:`lightning_gc.integrations.fabric`): the
user's loop stays a Fabric loop, and the outer loop
(:class:`~lightning_gc.runtime.outer.OuterLoop`, whose docstring has the maths) runs inside
``optimizer.step()``::

    fabric = Fabric(accelerator="cuda", devices=8, strategy="sparseloco")    # or a class with arguments:
    # strategy=FabricOuterLoopStrategy("diloco", sync_every=100, fragments=4, sync_delay=1, mix=0.5)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)   # the outer loop is built here, on every rank
    for x, y in loader:
        fabric.backward(loss_fn(model(x), y))           # local gradients: nothing is sent
        optimizer.step()                                # one inner step; the outer loop syncs when due
        optimizer.zero_grad()
    fabric.strategy.finish()                            # the final sync: theta_g in every rank's model
    with fabric.strategy.global_weights():              # evaluate theta_g mid-run (theta_r restored after)
        evaluate(model)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
    fabric.load(path, state)                            # before or after fabric.setup

What the strategy does:

* ``fabric.setup`` wraps the model in ``DistributedDataParallel`` whose comm hook sends nothing
  (so ``fabric.no_backward_sync`` and gradient accumulation work as under DDP) and builds the outer
  loop (a collective). One model and one optimizer per run: every ``optimizer.step()`` is one
  inner step.
* ``fabric.save`` (every rank calls it) writes ``theta_g`` as the model's weights and, under
  ``"lightning_gc_outer"``, every rank's outer-loop state (residuals, outer momenta, exchanges in
  flight), own weights ``theta_r``, buffers and inner optimizer state;
  ``fabric.load`` gives each rank its own part back (with the same number of ranks), so a run
  resumed between syncs continues bit for bit.
* Nothing ends a Fabric run for the strategy: call :meth:`FabricOuterLoopStrategy.finish` after the
  loop (a full sync when steps remain or an exchange is in flight).

Fabric registers strategies by name in ``lightning.fabric.strategies.STRATEGY_REGISTRY``; importing
``lightning_gc`` adds ``"diloco"``, ``"diloco_int8"`` and ``"sparseloco"`` there
(:func:`register_outer_fabric_strategies`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_gc.integrations.local_ddp import LOCAL_BUFFERS, keep_local_gradients
from lightning_gc.integrations.outer_attach import (
    OUTER_CHECKPOINT_KEY,
    OuterArguments,
    gather_outer_entry,
    outer_rank_state,
    resume_outer,
)
from lightning_gc.integrations.outer_lightning import register_presets, split_strategy_arguments
from lightning_gc.runtime.outer import OuterLoop


class FabricOuterLoopStrategy(DDPStrategy):
    """Fabric's DDP without gradient averaging, synchronised every ``sync_every`` optimizer steps by
    an outer loop (module docstring for the user's side).

    Args:
        preset: ``"diloco"``, ``"diloco_int8"`` or ``"sparseloco"``
            (:data:`~lightning_gc.integrations.outer_attach.OUTER_PRESETS`).
        **kwargs: the same names as the Trainer strategy and ``outer_loop()``: ``sync_every``,
            ``compressor``, ``error_decay``, ``outer_lr``, ``outer_momentum``, ``outer_nesterov``,
            ``fragments``, ``sync_delay``, ``mix``, the compressor's own arguments; and Fabric's
            ``DDPStrategy`` and ``DistributedDataParallel`` arguments. Unknown names, per-step
            options (``delay``, ``local_update``, ...) and bad values raise ``ValueError`` here.
    """

    def __init__(self, preset: str = "diloco", **kwargs: Any) -> None:
        self.outer_arguments: OuterArguments
        self.outer_arguments, kwargs = split_strategy_arguments(type(self).__name__, preset, kwargs, DDPStrategy)
        super().__init__(**{LOCAL_BUFFERS: False, **kwargs})  # buffers are averaged at each sync
        self._outer: OuterLoop | None = None
        self._optimizer: Optimizer | None = None
        self._pending: dict[str, Any] | None = None  # this rank's part of a checkpoint loaded before set-up

    @property
    def outer(self) -> OuterLoop:
        """The run's outer loop (``syncs``, ``bytes_sent``, ``global_parameters``, ...); exists once
        ``fabric.setup`` has run."""
        if self._outer is None:
            raise RuntimeError("the outer loop exists once fabric.setup(model, optimizer) has run")
        return self._outer

    # ------------------------------------------------------------------ set-up
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self._outer is not None:
            raise ValueError(f"{type(self).__name__} syncs one model; a second was set up")
        ddp = super().setup_module(module)
        ddp.register_comm_hook(None, keep_local_gradients)
        self._outer = self.outer_arguments.build(ddp.module)  # every rank, the default group
        if self._pending is not None:
            resume_outer(self._outer, self._pending)
        return ddp

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        if self._optimizer is not None:
            raise ValueError(
                f"{type(self).__name__} counts every optimizer.step() as one inner step; a second optimizer was "
                "set up (use one optimizer with param groups)"
            )
        self._optimizer = optimizer
        if self._pending is not None:
            optimizer.load_state_dict(self._pending["optimizers"][0])
            self._pending = None
        return optimizer

    # ------------------------------------------------------------------ each step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.outer.inner_step_done()
        return output

    def finish(self) -> bool:
        """The final sync, on every rank: exchanges in flight land and what remains is sent, so the
        model holds ``theta_g`` (nothing happens when nothing remains); whether it synced."""
        return self.outer.finish()

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """The model holds ``theta_g`` inside the block (evaluate it), this rank's ``theta_r`` after."""
        with self.outer.global_weights():
            yield

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Every rank calls ``fabric.save``: the model's weights are ``theta_g``, and every rank's
        outer-loop state joins rank 0's file (a collective)."""
        if self._outer is None:
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        optimizers = [] if self._optimizer is None else [self._optimizer.state_dict()]
        entry = gather_outer_entry(self._outer, optimizer_states=optimizers)
        with self._outer.global_weights():
            super().save_checkpoint(path, {**state, OUTER_CHECKPOINT_KEY: entry}, storage_options, filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Restore what ``state`` names (the model gets ``theta_g``), then this rank's outer-loop
        state, own weights and inner optimizer state (now, or at set-up).

        Raises:
            ValueError: after ``fabric.setup``, a checkpoint without outer-loop state: the loaded
                weights would not be the outer loop's ``theta_g``. Nothing is loaded then.
        """
        restores = bool(state) and isinstance(state, dict)
        if restores and self._outer is not None:  # checked before anything is restored, on the one read
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=kwargs.get("weights_only"))
            if OUTER_CHECKPOINT_KEY not in checkpoint:
                raise ValueError(
                    f"checkpoint {path} holds no outer-loop state, and this run's outer loop is built: its theta_g "
                    "would not be the loaded weights; load such a checkpoint before fabric.setup (the outer loop "
                    "then starts from its weights)"
                )
            reader, self.checkpoint_io = self.checkpoint_io, _Read(checkpoint)
            try:
                remainder = super().load_checkpoint(path, state, strict=strict, **kwargs)
            finally:
                self.checkpoint_io = reader
        else:
            remainder = super().load_checkpoint(path, state, strict=strict, **kwargs)
        if not restores:
            return remainder  # the raw checkpoint, or a module/optimizer of it
        entry = remainder.pop(OUTER_CHECKPOINT_KEY, None)
        if entry is None:
            self._pending = None
            rank_zero_info(f"lightning_gc: checkpoint {path} holds no outer-loop state; the outer loop starts afresh")
            return remainder
        own = outer_rank_state(entry, source=path, rank=self.global_rank, world_size=self.world_size)
        if self._outer is None:
            self._pending = own
            return remainder
        resume_outer(self._outer, own)
        if self._optimizer is not None and own["optimizers"]:
            self._optimizer.load_state_dict(own["optimizers"][0])
        return remainder


class _Read(CheckpointIO):
    """A checkpoint already read, handed to Fabric's loading in place of a second read of the file."""

    def __init__(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint = checkpoint

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        return self.checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        raise RuntimeError("a checkpoint being loaded is not saved")

    def remove_checkpoint(self, path: Any) -> None:
        raise RuntimeError("a checkpoint being loaded is not removed")


def register_outer_fabric_strategies(registry: _StrategyRegistry) -> None:
    """``"diloco"``, ``"diloco_int8"``, ``"sparseloco"`` in Fabric's registry (names already there are kept)."""
    register_presets(registry, FabricOuterLoopStrategy, "Fabric outer loop")
