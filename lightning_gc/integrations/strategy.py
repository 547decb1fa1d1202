"""Lightning strategies: DDP whose gradient exchange goes through a compressor.

:class:`GradientCompressionStrategy` is wiring: it parses its arguments into a compressor and
:class:`~lightning_gc.runtime.settings.CompressionSettings`, and calls a
:class:`~lightning_gc.runtime.session.CompressionSession` (which owns the hook, the memory, the momentum
hand-over, the statistics and the checkpoint state) at Lightning's points: registration on every
device (Lightning's own ``DDPStrategy`` only registers comm hooks on CUDA and silently ignores them
on CPU), each optimizer step, logging ``gc/*`` statistics, the end of training, and saving and
restoring every rank's state in checkpoints.

:class:`DGCStrategy` is the Deep Gradient Compression preset, registered as ``"dgc_ddp"`` and
``"dgc_ddp_spawn"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from difflib import get_close_matches
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
from lightning_gc.compressors.dgc import DGCCompressor
from lightning_gc.compressors.registry import argument_names, compressor_class
from lightning_gc.compressors.registry import available as available_compressors
from lightning_gc.compressors.registry import create as create_compressor
from lightning_gc.compressors.two_phase import two_phase_compressors
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY, no_entry_notice
from lightning_gc.runtime.hook import CompressionHookState
from lightning_gc.runtime.policy import CompressionPolicy
from lightning_gc.runtime.session import CompressionSession
from lightning_gc.runtime.settings import CompressionSettings
from lightning_gc.runtime.teardown import shut_down_process_group_at_exit

PRESET_CLASSES: dict[str, str] = {"dgc": "DGCStrategy"}
"""Compressors whose ``<name>_ddp`` preset is a dedicated class (with that method's defaults)."""
_OWNED_DDP_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def ddp_argument_names(strategy_class: type = DDPStrategy) -> set[str]:
    """Keyword arguments a Lightning (or Fabric) DDP strategy class accepts, its own and those it
    forwards to DistributedDataParallel, less those the compression strategies set themselves."""
    set_by_lightning = {"self", "module", "device_ids", "output_device", "kwargs", *_OWNED_DDP_ARGUMENTS}
    names = set(inspect.signature(strategy_class.__init__).parameters)
    names |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    return names - set_by_lightning


def resolve_compressor(
    compressor: str | Compressor,
    kwargs: dict[str, Any],
    *,
    owner: str,
    others: dict[str, set[str]] | None = None,
) -> Compressor:
    """The compressor named (built from the arguments it takes, popped from ``kwargs``) or given;
    whatever remains in ``kwargs`` must be a name of ``others`` (what else the caller takes, by
    who takes it; default: DDP's arguments).

    Raises:
        ValueError: unknown compressor name, bad compressor arguments, or an argument neither the
            compressor nor the others take (named with its value, and the close name if any).
    """
    others = {"DDP": ddp_argument_names()} if others is None else others
    if isinstance(compressor, str):
        accepted = argument_names(compressor_class(compressor))
        compressor = create_compressor(compressor, **{k: kwargs.pop(k) for k in list(kwargs) if k in accepted})
    elif not isinstance(compressor, Compressor):
        raise ValueError(
            f"`compressor` must be one of {available_compressors()} or a lightning_gc Compressor, got {compressor!r}"
        )
    allowed = set().union(*others.values())
    if "exchange" in kwargs and "exchange" not in allowed:
        raise ValueError(
            f"`exchange={kwargs['exchange']!r}` is not for compressor {compressor.name!r}: the two-phase exchange "
            f"re-encodes averaged chunks, which only {two_phase_compressors()} can, and the global top-k exchange "
            "merges the selections of topk and dgc; randomk and powersgd are all-reduced already"
        )
    unknown = {name: kwargs[name] for name in sorted(set(kwargs) - allowed)}
    if unknown:
        known = argument_names(type(compressor)) | allowed | _strategy_argument_names()
        hints = [
            f"`{name}`: did you mean `{close[0]}`?" for name in unknown if (close := get_close_matches(name, known, 1))
        ]
        takes = "".join(f", {who} takes {sorted(names)}" for who, names in others.items())
        raise ValueError(
            f"unknown argument(s) {unknown} for {owner}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f": compressor {compressor.name!r} takes {sorted(argument_names(type(compressor)))}{takes}"
        )
    return compressor


def _strategy_argument_names() -> set[str]:
    """The arguments the compression strategies take themselves (besides the compressor's and DDP's)."""
    return {
        name
        for cls in (GradientCompressionStrategy, DGCStrategy)
        for name in inspect.signature(cls.__init__).parameters
        if name not in ("self", "kwargs", "compressor")
    }


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
        momentum_correction: hand the momentum (and the weight decay inside it) of every
            ``torch.optim.SGD`` param group over to the compression memory, which accumulates
            momentum-corrected updates (DGC); the optimizer then takes momentum-free steps. With
            ``torch.optim.Adam``/``AdamW``: after ``adam_warmup_steps`` the second moment freezes
            and the first moment is handed over the same way. Parameters of other optimizers (or
            SGD without momentum) use plain error feedback.
        momentum: momentum applied by the memory for parameters whose optimizer has none to hand
            over (e.g. Adam, or SGD with ``momentum=0``); ``None`` takes it from SGD only.
        momentum_masking: zero the momentum where values were sent sparsely (DGC §3.3).
        clip_norm: local gradient clipping before accumulation: each tensor's local gradient is
            clipped to L2 norm ``clip_norm / sqrt(world_size)`` (DGC §3.2). ``None``: off.
        error_feedback: keep what was not sent (the residual) for later steps; ``None`` (default)
            turns it on for biased compressors and with momentum correction, which requires it.
        min_wire_ratio: selective compression: a bucket whose wire ratio under the compressor
            (dense bytes / bytes sent) would be below this is sent exactly by one all-reduce.
            The default 1.0 never sends more bytes than plain DDP.
        compress_when: ``None`` (default): compress every bucket that passes ``min_wire_ratio``; or
            a :class:`~lightning_gc.runtime.policy.CompressionPolicy`, e.g.
            :class:`~lightning_gc.runtime.selective.CompressWhenFaster`: compress a bucket only where the
            performance model predicts a faster step. Rank 0's policy is used on all ranks.
        log_stats: log ``gc/bytes_sent``, ``gc/dense_bytes``, ``gc/wire_ratio``, ``gc/density``
            and ``gc/compress_s`` after every optimizer step. Running sums over all steps are kept
            in :attr:`totals` either way.
        nonfinite: a NaN/Inf in a local gradient: ``"raise"`` (default) stops with
            ``FloatingPointError`` naming the parameters before anything enters memory;
            ``"skip"`` skips the step on every rank and rolls memory back. Under a mixed-precision
            grad scaler ("16-mixed") such steps are always skipped and the scaler backs off.
        verify_every_n_steps: every so many optimizer steps, compare a checksum of every
            parameter across ranks and raise naming the first that differs (``None``: only the
            setup check of configuration and model layout, which always runs).
        delay: delayed synchronisation (:mod:`lightning_gc.exchanges.delay`): each step applies the average
            of the exchange launched ``delay`` steps earlier, and its own exchange runs during the
            next step's compute. 0 (default): every step waits for its own exchange. What is still
            owed when training ends is applied then, so every rank ends with the same parameters.
        local_update: with ``delay``, apply this rank's own contribution at once and swap it for
            the average when that arrives (OD-SGD); ranks then differ by their own recent terms
            during training. Needs ``torch.optim.SGD`` (a linear update) and a compressor that
            knows what it sent before the exchange (not PowerSGD).
        sync_warmup_steps: with ``delay``, the first optimizer steps are synchronous. ``None``
            (default): as many as a :class:`~lightning_gc.SparsityWarmup` callback's stages last, so
            the delay starts at the target density, where the update is small; 0 without one.
        adam_warmup_steps: with ``torch.optim.Adam``/``AdamW`` and ``momentum_correction``, the
            optimizer steps of plain Adam (gradients averaged exactly as DDP does) before the second
            moment freezes and the first moment is compressed (:mod:`lightning_gc.core.handover`;
            1-bit Adam freezes after 15-25 % of training).
        adam_weighting: after the freeze, how the compressed momentum weights elements against each
            other (what top-k favours): ``"step"`` (default) by each element's pending Adam step,
            ``"decrease"`` by the first-order loss decrease of applying it (the step times
            ``sqrt(d)``, ``d`` the frozen denominator), ``"gradient"`` by its gradient sum (the step
            times ``d``, SGD's ranking). What is eventually applied is the same; see
            :mod:`lightning_gc.core.handover`.
        hierarchy: ``"flat"`` (default): one compressed exchange over all ranks. ``"node"``: two
            levels (:mod:`lightning_gc.exchanges.hierarchy`): a dense sum within each node over its fast link,
            the compressed exchange across nodes with every device carrying ``1/devices`` of each
            bucket, then a dense all-gather within the node; residuals stay exact on the device that
            owns each piece. ``"node_sparse"`` (``topk``, ``dgc``): two levels with nothing dense on
            any link (:mod:`lightning_gc.exchanges.hierarchy_sparse`): global top-k within each node, the
            node's agreed pairs gathered across nodes (``1/devices`` of them per device), every rank
            keeping its whole residual; for nodes whose link is not much faster than the network.
            ``"auto"``: ``"node"`` when there is more than one node and more than one device per
            node. Not with ``local_update`` nor PowerSGD (which needs whole matrices).
        **kwargs: the named compressor's arguments (e.g. ``compress_ratio``), and anything
            :class:`~lightning.pytorch.strategies.DDPStrategy` or ``DistributedDataParallel``
            take (e.g. ``bucket_cap_mb``, ``find_unused_parameters``, ``start_method``,
            ``timeout``). Unknown names raise ``ValueError`` here, not at setup. ``timeout`` (a
            ``timedelta`` or seconds; torch's default is 30 minutes) bounds every collective: a
            rank whose peer died stops with an error within it (on gloo, usually at once).
    """

    def __init__(
        self,
        compressor: str | Compressor = "none",
        *,
        momentum_correction: bool = False,
        momentum: float | None = None,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        error_feedback: bool | None = None,
        min_wire_ratio: float = 1.0,
        compress_when: CompressionPolicy | None = None,
        log_stats: bool = True,
        nonfinite: str = "raise",
        verify_every_n_steps: int | None = None,
        delay: int = 0,
        local_update: bool = False,
        sync_warmup_steps: int | None = None,
        adam_warmup_steps: int = 1000,
        adam_weighting: str = "step",
        hierarchy: str = "flat",
        **kwargs: Any,
    ) -> None:
        owned = sorted(set(kwargs) & set(_OWNED_DDP_ARGUMENTS))
        if owned:
            raise ValueError(
                f"{type(self).__name__} installs its own DDP comm hook; remove {owned} "
                "(use DDPStrategy directly for a custom hook)"
            )
        compressor = resolve_compressor(compressor, kwargs, owner=type(self).__name__)
        settings = CompressionSettings(
            momentum_correction=momentum_correction,
            momentum=momentum,
            momentum_masking=momentum_masking,
            clip_norm=clip_norm,
            error_feedback=error_feedback,
            min_wire_ratio=min_wire_ratio,
            compress_when=compress_when,
            log_stats=log_stats,
            nonfinite=nonfinite,
            verify_every_n_steps=verify_every_n_steps,
            delay=delay,
            local_update=local_update,
            sync_warmup_steps=sync_warmup_steps,
            adam_warmup_steps=adam_warmup_steps,
            adam_weighting=adam_weighting,
            hierarchy=hierarchy,
        )
        self.session = CompressionSession(compressor, settings, owner=type(self).__name__)
        self._training_finished = False  # this fit's owed averages applied (finish_training)
        if "timeout" in kwargs:
            kwargs["timeout"] = check_timeout("timeout", kwargs["timeout"])
        super().__init__(**kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"<name>_ddp"`` for every compressor without a dedicated preset class."""
        for name in available_compressors():
            preset = f"{name}_ddp"
            if name not in PRESET_CLASSES and preset not in strategy_registry:
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
        if self.settings.sync_warmup_steps is None and self.hook_state is not None:
            self.hook_state.sync_warmup_steps = steps

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.session.start_fit(self.optimizers)
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


class DGCStrategy(GradientCompressionStrategy):
    """Deep Gradient Compression over DDP (Lin et al., ICLR 2018).

    Keep a plain ``torch.optim.SGD(momentum=..., nesterov=..., weight_decay=...)``: its momentum
    and weight decay move into the compression memory (momentum correction), each large tensor
    sends exactly ``ceil(compress_ratio * numel)`` values chosen by a sampled threshold, the
    momentum is masked where values were sent, and the rest stays in the velocity for later steps.
    With ``compress_ratio=1`` training equals plain DDP with the same SGD.

    Args:
        compress_ratio: fraction of elements sent per compressed tensor, in (0, 1].
        momentum_correction, momentum, momentum_masking, clip_norm: see
            :class:`GradientCompressionStrategy`.
        sample_ratio: fraction of each tensor sampled for the threshold, in (0, 1].
        min_compress_numel: tensors with fewer elements, and 1-D tensors, go dense.
        value_dtype: values on the wire, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        index_encoding: indices on the wire, ``"int32"`` or ``"elias_fano"`` (sorted,
            Elias--Fano coded: ~12 bits per index at ratio 0.001; same training result).
        dense_dtype: dtype of the tensors sent dense (1-D, small) next to compressed ones,
            ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``None`` (the gradient's); what
            rounding drops stays in the residual.
        exchange: ``"gather"`` (every rank's pairs all-gathered) or ``"global_topk"`` (ranks
            agree on ``k`` positions per tensor in ``log2 N`` pairwise merge rounds, then
            all-reduce their values: traffic per rank grows as ``log N``, not ``N``; see
            :mod:`lightning_gc.compressors.global_topk`).
        **kwargs: :class:`GradientCompressionStrategy` / ``DDPStrategy`` arguments.
    """

    def __init__(
        self,
        compress_ratio: float = 0.001,
        *,
        momentum_correction: bool = True,
        momentum: float | None = None,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        sample_ratio: float = 0.01,
        min_compress_numel: int = 1024,
        value_dtype: str = "float32",
        index_encoding: str = "int32",
        dense_dtype: str | None = None,
        exchange: str = "gather",
        **kwargs: Any,
    ) -> None:
        compressor = DGCCompressor(
            compress_ratio,
            sample_ratio=sample_ratio,
            min_compress_numel=min_compress_numel,
            value_dtype=value_dtype,
            index_encoding=index_encoding,
            dense_dtype=dense_dtype,
            exchange=exchange,
        )
        super().__init__(
            compressor,
            momentum_correction=momentum_correction,
            momentum=momentum,
            momentum_masking=momentum_masking,
            clip_norm=clip_norm,
            **kwargs,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"dgc_ddp"`` and ``"dgc_ddp_spawn"`` (no-op for names already present)."""
        for name, start_method in (("dgc_ddp", "popen"), ("dgc_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Deep Gradient Compression over DDP, start_method={start_method!r}",
                    start_method=start_method,
                )
