"""Which hand-over a fit gets: Adam's (:mod:`lightning_gc.core.adam`) or SGD's
(:mod:`lightning_gc.core.handover`), by the optimizers it uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_gc.core.adam import ADAM_TYPES, AdamHandOver
from lightning_gc.core.handover import HandOver, MomentumHandOver
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import unwrap_optimizer


def hand_over_for(
    optimizers: Sequence[Any], memory: CompensationMemory, *, explicit_momentum: float | None,
    adam_warmup_steps: int, owner: str, adam_weighting: str = "step",
) -> HandOver:  # fmt: skip
    """The hand-over for a fit's optimizers: Adam's when they are Adam/AdamW and momentum
    correction is on (and no explicit momentum replaces theirs), SGD's otherwise."""
    inner = [unwrap_optimizer(o) for o in optimizers]
    adam = [o for o in inner if isinstance(o, ADAM_TYPES)]
    if memory.momentum_correction and adam:
        if explicit_momentum is not None:
            raise ValueError(
                f"momentum={explicit_momentum} on {owner} replaces a missing SGD momentum, but the model uses "
                f"{type(adam[0]).__name__}, whose first moment is handed over; remove momentum="
            )
        return AdamHandOver(memory, adam_warmup_steps, owner, adam_weighting)
    return MomentumHandOver(memory, explicit_momentum, owner)
