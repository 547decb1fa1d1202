"""Handing the optimizer's momentum over to the compression memory (DGC's momentum correction).

With momentum correction the memory accumulates momentum-corrected updates, so the optimizer must
step without its own momentum and weight decay (:func:`lightning_gc.momentum.momentum_free`) while
the memory applies each SGD param group's values (:func:`lightning_gc.momentum.sgd_momentum_specs`,
read again before every step so schedulers that rewrite them are followed). Parameters without SGD
momentum get ``explicit_momentum`` when the user gave one, else plain error feedback.

This is the one place that knows how an optimizer's state maps onto the memory; a hand-over for
Adam's moments sits beside it, not inside the comm hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_gc.memory import CompensationMemory
from lightning_gc.momentum import MomentumSpec, momentum_free, sgd_momentum_specs, unwrap_optimizer


class MomentumHandOver:
    """SGD momentum applied by ``memory`` instead of the optimizers (a no-op without momentum correction).

    Args:
        memory: the compensation memory; its ``momentum_correction`` switches the hand-over on.
        explicit_momentum: momentum for parameters whose optimizer has none (``None``: only SGD's).
        owner: the front end's name, used in errors.
    """

    def __init__(self, memory: CompensationMemory, explicit_momentum: float | None, owner: str) -> None:
        self.memory = memory
        self.explicit_momentum = explicit_momentum
        self.owner = owner

    @property
    def active(self) -> bool:
        """Whether the memory applies the momentum (and the optimizers must step without it)."""
        return self.memory.momentum_correction

    def check(self, optimizers: Sequence[Any], *, local_update: bool) -> None:
        """Raise ``ValueError`` for optimizers the run cannot hand over or update locally."""
        if self.active and len(optimizers) > 1:
            raise ValueError(
                f"momentum_correction=True moves one optimizer's momentum into the compression memory, but "
                f"the model configures {len(optimizers)} optimizers; use one optimizer (param groups "
                "for different settings) or momentum_correction=False"
            )
        if local_update:
            inner = [unwrap_optimizer(o) for o in optimizers]
            others = sorted({type(o).__name__ for o in inner if not isinstance(o, torch.optim.SGD)})
            if others:
                raise ValueError(
                    f"local_update=True adds this rank's own update now and swaps it for the average later, "
                    f"which is exact only for a linear update (torch.optim.SGD); the model configures {others}. "
                    "Use local_update=False (the plain stale average) with these optimizers"
                )

    def refresh(self, optimizers: Sequence[Any], names: dict[int, tuple[str, int]], *, announce: bool) -> None:
        """Give the memory each parameter's current momentum recurrence (``names``: parameter id ->
        (name, order)); ``announce`` says once when there is no momentum to correct."""
        if not self.active:
            return
        from_sgd = sgd_momentum_specs(optimizers)
        if self.explicit_momentum is not None:
            conflicting = sorted({s.momentum for s in from_sgd.values() if s.momentum != 0.0})
            if conflicting:
                raise ValueError(
                    f"momentum is set both on the optimizer ({conflicting}) and on {self.owner} "
                    f"(momentum={self.explicit_momentum}); set it in one place"
                )
        fallback = MomentumSpec(momentum=self.explicit_momentum or 0.0)
        specs = {}
        for pid, (name, _) in names.items():
            spec = from_sgd.get(pid)
            specs[name] = spec if spec is not None and spec.momentum != 0.0 else fallback
        self.memory.set_specs(specs)
        if announce and all(spec.momentum == 0.0 for spec in specs.values()):
            rank_zero_info(
                "lightning_gc: no SGD momentum to correct; compressed updates use plain error feedback "
                "(the optimizer keeps its own state)"
            )

    def stepping(self, optimizers: Sequence[Any]) -> AbstractContextManager[Any]:
        """Around an optimizer step: the optimizers' momentum and decay zeroed while the memory owns them."""
        return momentum_free(optimizers) if self.active else nullcontext()
