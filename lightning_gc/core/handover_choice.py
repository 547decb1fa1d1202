"""Which hand-over a fit gets: Adam's (:mod:`lightning_gc.core.adam`) or SGD's
(:mod:`lightning_gc.core.handover`), by the optimizers it uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_gc.core.adam import ADAM_TYPES, AdamHandOver
from lightning_gc.core.handover import HandOver, MomentumHandOver
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import unwrap_optimizer


def hand_over_for(
    optimizers: Sequence[Any], memory: CompensationMemory, *, explicit_momentum: float | None,
    adam_warmup_steps: int | Callable[[], int], owner: str, adam_weighting: str = "step",
) -> HandOver:  # fmt: skip
    """The hand-over for a fit's optimizers: Adam's when they are Adam/AdamW and momentum
    correction is on (and no explicit momentum replaces theirs), SGD's otherwise.
    ``adam_warmup_steps`` may be a function, called only when Adam's hand-over is chosen (its
    length may depend on the run's, which an SGD run never needs to know)."""
    inner = [unwrap_optimizer(o) for o in optimizers]
    adam = [o for o in inner if isinstance(o, ADAM_TYPES)]
    if memory.momentum_correction and adam:
        if explicit_momentum is not None:
            raise ValueError(
                f"momentum={explicit_momentum} on {owner} replaces a missing SGD momentum, but the model uses "
                f"{type(adam[0]).__name__}, whose first moment is handed over; remove momentum="
            )
        warmup = adam_warmup_steps() if callable(adam_warmup_steps) else adam_warmup_steps
        return AdamHandOver(memory, warmup, owner, adam_weighting)
    return MomentumHandOver(memory, explicit_momentum, owner)
