"""What the outer loop's two Lightning front ends share: the Trainer strategy
(:class:`~lightning_gc.integrations.outer.OuterLoopStrategy`) and the Fabric one
(:class:`~lightning_gc.integrations.outer_fabric.FabricOuterLoopStrategy`) split their keyword
arguments the same way and register the same preset names, each in its own registry."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_gc.common.outer_presets import OUTER_PRESETS
from lightning_gc.common.validation import check_timeout
from lightning_gc.integrations.ddp_arguments import OWNED_DDP_ARGUMENTS, ddp_argument_names
from lightning_gc.integrations.outer_arguments import OuterArguments, outer_arguments


def split_strategy_arguments(
    owner: str, preset: str, kwargs: dict[str, Any], ddp_strategy: type
) -> tuple[OuterArguments, dict[str, Any]]:
    """The outer loop's checked settings, and what is left of ``kwargs`` for ``ddp_strategy`` (the
    Trainer's or Fabric's ``DDPStrategy``) and ``DistributedDataParallel``.

    Raises:
        ValueError: in one line: a DDP argument the strategy owns (its comm hook), or anything
            :func:`~lightning_gc.integrations.outer_arguments.outer_arguments` refuses.
    """
    owned = sorted(set(kwargs) & set(OWNED_DDP_ARGUMENTS))
    if owned:
        raise ValueError(f"{owner} installs its own DDP comm hook (local gradients); remove {owned}")
    rest = dict(kwargs)
    arguments = outer_arguments(preset, rest, owner=owner, others={"DDP": ddp_argument_names(ddp_strategy)})
    if "timeout" in rest:
        rest["timeout"] = check_timeout("timeout", rest["timeout"])
    return arguments, rest


def register_presets(registry: _StrategyRegistry, strategy: type, what: str) -> None:
    """Every name of :data:`~lightning_gc.common.outer_presets.OUTER_PRESETS` in ``registry`` as
    ``strategy(preset=name)``, described as ``what`` (names already there are kept: idempotent)."""
    for name in OUTER_PRESETS:
        if name not in registry:
            registry.register(name, strategy, description=f"{what} (DiLoCo family), preset {name!r}", preset=name)
