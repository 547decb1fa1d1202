"""Lightning Fabric front end: ``Fabric(strategy="dgc_ddp")`` and a ``"<name>_ddp"`` preset per compressor.

The strategy is Fabric's ``DDPStrategy`` plus the plain-DDP handle of :mod:`lightning_gc.attach`
(one :class:`~lightning_gc.runtime.session.CompressionSession` underneath all three front ends):

    fabric.setup(model, optimizer)      DDP wraps the model; the handle registers the comm hook and
                                        hands the optimizer's momentum over (one optimizer)
    optimizer.step()                    settles the step on every rank, steps momentum-free
    fabric.save(path, state)            every rank calls it: every rank's residuals and momenta go
                                        into the checkpoint under ``"lightning_gc"``
    fabric.load(path, state)            each rank takes its own part back (before or after setup)
    fabric.strategy.compression         the handle: ``last_metrics``, ``totals``, ``compress_ratio``
                                        (for a warm-up), ``finish()`` (what a delay still owes)

Fabric registers strategies by name in ``lightning.fabric.strategies.STRATEGY_REGISTRY``; importing
``lightning_gc`` adds the presets there (:func:`register_fabric_strategies`).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_gc.common.validation import check_int, check_timeout
from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.registry import available
from lightning_gc.integrations.attach import AttachedCompression
from lightning_gc.integrations.ddp_arguments import ddp_argument_names
from lightning_gc.runtime.build import build_session, preset_for
from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY, no_entry_notice


class FabricCompressionStrategy(DDPStrategy):
    """Fabric's DDP with compressed gradient exchange.

    Args:
        compressor: a registered compressor name (its arguments in ``kwargs``) or a Compressor.
        **kwargs: the compressor's arguments, any :class:`~lightning_gc.runtime.settings.CompressionSettings`
            field (``momentum_correction``, ``delay``, ``nonfinite``, ...; ``"dgc"`` turns momentum
            correction on by default, as ``DGCStrategy`` does), and Fabric's ``DDPStrategy`` and
            ``DistributedDataParallel`` arguments. Unknown names raise ``ValueError`` here.
        total_steps: the run's optimizer steps from step 0, as ``attach`` takes them: what
            ``adam_warmup_steps="auto"`` (the default) needs with Adam/AdamW under momentum
            correction, and what sets the compressed phase's density floor; SGD runs never need it.
    """

    def __init__(self, compressor: str | Compressor = "none", *, total_steps: int | None = None, **kwargs: Any) -> None:
        kwargs = dict(kwargs)
        self.total_steps = None if total_steps is None else check_int("total_steps", total_steps, 1)
        self.session = build_session(
            compressor,
            kwargs,
            owner=type(self).__name__,
            preset=preset_for(compressor),
            others={"DDP": ddp_argument_names(DDPStrategy)},
        )
        if "timeout" in kwargs:
            kwargs["timeout"] = check_timeout("timeout", kwargs["timeout"])
        super().__init__(**kwargs)  # what is left is DDP's
        self._ddp: DistributedDataParallel | None = None
        self._compression: AttachedCompression | None = None
        self._pending_entry: tuple[dict[str, Any], Any] | None = None

    @property
    def compression(self) -> AttachedCompression:
        """The handle of the run (statistics, totals, ratio, ``finish()``); exists after ``fabric.setup``."""
        if self._compression is None:
            raise RuntimeError("the compression handle exists once fabric.setup(model, optimizer) has run")
        return self._compression

    # ------------------------------------------------------------------ set-up
    def setup_module(self, module: Module) -> DistributedDataParallel:
        self._ddp = super().setup_module(module)
        return self._ddp

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        if self._ddp is None:
            raise RuntimeError("set the model up before its optimizer: fabric.setup(model, optimizer)")
        if self._compression is not None:
            raise ValueError(
                f"{type(self).__name__} compresses the gradients of one optimizer; a second was set up "
                "(use one optimizer with param groups)"
            )
        self._compression = AttachedCompression(
            self._ddp,
            optimizer,
            self.session,
            scaler=getattr(self.precision, "scaler", None),
            devices_per_node=self.num_processes,
            total_steps=self.total_steps,
            length_hint=f"construct the strategy as {type(self).__name__}(compressor, total_steps=N) with the run's "
            "optimizer steps",
        )
        if self._pending_entry is not None:
            entry, source = self._pending_entry
            self._compression.load_state_dict(entry, source=source)
            self._pending_entry = None
        return optimizer

    # ------------------------------------------------------------------ each step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise ValueError(f"{type(self).__name__} steps the optimizer itself; got arguments {sorted(kwargs)}")
        return self.compression.step()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Every rank calls ``fabric.save``: every rank's compression state joins rank 0's file."""
        if self._compression is not None:
            state = {**state, CHECKPOINT_KEY: self._compression.state_dict()}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        """Restore what ``state`` names, and this rank's compression state (now, or at set-up).

        Raises:
            ValueError: a checkpoint without compression state once this run's set-up compression memory
                holds state (of its own steps or of a checkpoint loaded earlier): those residuals and
                momenta would not belong to the loaded weights. Nothing is loaded then.
        """
        restores_training = bool(state) and isinstance(state, dict)
        held = self._memory_step()
        if restores_training and held > 0 and CHECKPOINT_KEY not in self.checkpoint_io.load_checkpoint(path):
            raise ValueError(
                f"checkpoint {path} holds no compression state, but this run's compression memory holds the "
                f"state of step {held} (trained here or loaded from an earlier checkpoint), whose residuals and "
                "momenta do not belong to the loaded weights; load it before the first step and any other "
                "checkpoint (memory then starts empty), or load a checkpoint that fabric.save wrote under "
                "this strategy"
            )
        remainder = super().load_checkpoint(path, state, strict=strict, **kwargs)
        if not restores_training:
            return remainder  # the raw checkpoint, or a module/optimizer of it
        entry = remainder.pop(CHECKPOINT_KEY, None)
        if entry is None:
            self._pending_entry = None  # an entry loaded before set-up belongs to other weights now
            rank_zero_info(no_entry_notice(path))
        elif self._compression is None:
            self._pending_entry = (entry, path)
        else:
            self._compression.load_state_dict(entry, source=path)
        return remainder

    def _memory_step(self) -> int:
        """The step the set-up compression memory has state of (0: empty or not set up yet; an
        entry still pending for set-up is replaced by whatever is loaded next)."""
        hook_state = None if self._compression is None else self._compression.session.hook_state
        return 0 if hook_state is None else hook_state.step


def register_fabric_strategies(registry: _StrategyRegistry) -> None:
    """``"<name>_ddp"`` for every registered compressor (``"dgc_ddp"`` with momentum correction)."""
    for name in available():
        preset = f"{name}_ddp"
        if preset not in registry:
            registry.register(
                preset, FabricCompressionStrategy, description=f"Fabric DDP with the {name!r} gradient compressor",
                compressor=name,
            )  # fmt: skip
