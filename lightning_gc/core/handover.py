"""Handing the optimizer's first moment over to the compression memory (momentum correction).

With momentum correction the memory accumulates momentum-corrected updates, so the optimizer must
not apply that momentum again. This module and :mod:`lightning_gc.core.adam` are the one place that
knows how an optimizer's state maps onto the memory; :func:`lightning_gc.core.handover_choice.hand_over_for`
picks the hand-over for the optimizers a fit uses.

This module holds the interface every hand-over implements (:class:`HandOver`, told of each
step's start by a :class:`StepStart`) and SGD's.

**SGD** (:class:`MomentumHandOver`, DGC): the memory applies each SGD param group's momentum,
Nesterov flag and weight decay (:func:`lightning_gc.core.momentum.sgd_momentum_specs`, read again before
every step so schedulers that rewrite them are followed), and the optimizer steps without them
(:func:`lightning_gc.core.momentum.momentum_free`). Parameters without SGD momentum get
``explicit_momentum`` when the user gave one, else plain error feedback.

**Adam / AdamW** (:class:`lightning_gc.core.adam.AdamHandOver`, frozen-variance compressed
momentum): :mod:`lightning_gc.core.adam`, whose docstring states its maths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.common.layout import Segment
from lightning_gc.common.log import notify_on_rank_zero, warn_on_rank_zero
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec, momentum_free, sgd_groups, sgd_momentum_specs, unwrap_optimizer
from lightning_gc.core.staleness import staleness_warning

ParamNames = dict[int, tuple[str, int]]
"""The parameters a hand-over serves: parameter id -> (name, order)."""


@dataclass(frozen=True)
class StepStart:
    """What a hand-over is told before an optimizer step (its backward pass not yet run).

    Attributes:
        step: the optimizer step about to run (the steps taken before it).
        announce: the fit's start: say once what the hand-over will do.
        grad_scale: the grad scaler's scale for this step (``None``: no grad scaler).
    """

    step: int = 0
    announce: bool = False
    grad_scale: float | None = None


class HandOver(ABC):
    """What a session asks of a hand-over (one per fit, chosen by
    :func:`lightning_gc.core.handover_choice.hand_over_for`)."""

    @abstractmethod
    def check(self, optimizers: Sequence[Any], *, local_update: bool, delay: int = 0) -> None:
        """Raise ``ValueError`` for optimizers or settings this hand-over cannot honour."""

    @abstractmethod
    def exact_steps(self) -> int:
        """Optimizer steps at the start whose gradients are averaged exactly, as DDP does."""

    def refresh(
        self,
        optimizers: Sequence[Any],
        names: ParamNames,
        *,
        step: int = 0,
        announce: bool = False,
        grad_scale: float | None = None,
    ) -> None:
        """Before optimizer step ``step`` (its backward pass not yet run): give the memory each
        parameter's momentum recurrence (:meth:`before_step`, told the keywords as a :class:`StepStart`)."""
        self.before_step(optimizers, names, StepStart(step, announce, grad_scale))

    @abstractmethod
    def before_step(self, optimizers: Sequence[Any], names: ParamNames, start: StepStart) -> None:
        """:meth:`refresh`'s work: the memory's momentum recurrences for the step ``start`` begins."""

    @abstractmethod
    def stepping(self, optimizers: Sequence[Any]) -> AbstractContextManager[Any]:
        """The context to run the optimizer step in."""

    @abstractmethod
    def release(self) -> None:
        """Undo whatever the hand-over put on the model (at the end of a fit)."""

    def resume_settings(self, step: int) -> dict[str, Any]:
        """Settings that a checkpoint of the memory after ``step`` steps must be resumed with (the
        memory's meaning depends on them), by their setting names; empty when any will do."""
        return {}

    def step_ended(self) -> None:
        """After every optimizer step, taken or skipped (nothing by default)."""
        return None

    def owed_gradient_terms(self, grad: torch.Tensor, unused_here: Sequence[tuple[Segment, torch.Tensor]]) -> None:
        """Add to ``grad`` (a bucket's flat local gradient) the terms this hand-over's gradient hooks
        add to a local gradient, for ``unused_here``: (segment, parameter) pairs that got no gradient
        on this rank in this step (DDP put a zero in their slot) but one on some other rank, so
        the optimizer steps them (nothing by default)."""
        return None


class MomentumHandOver(HandOver):
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

    def check(self, optimizers: Sequence[Any], *, local_update: bool, delay: int = 0) -> None:
        """Raise ``ValueError`` for optimizers the run cannot hand over or update locally; warn
        when a delay shrinks momentum SGD's stable learning rate (:mod:`lightning_gc.core.staleness`)."""
        momenta = [float(group.get("momentum", 0.0)) for group in sgd_groups(optimizers)]
        warning = staleness_warning(max([*momenta, self.explicit_momentum or 0.0]), delay, local_update)
        if warning is not None:
            warn_on_rank_zero(f"lightning_gc: {warning}")
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

    def exact_steps(self) -> int:
        return 0  # SGD's hand-over starts at once

    def before_step(self, optimizers: Sequence[Any], names: ParamNames, start: StepStart) -> None:
        """The SGD groups' current values; ``start.announce`` says once when there is no momentum to correct."""
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
        if start.announce and all(spec.momentum == 0.0 for spec in specs.values()):
            kinds = sorted({type(unwrap_optimizer(o)).__name__ for o in optimizers})
            notify_on_rank_zero(
                f"lightning_gc: no SGD momentum to correct in {kinds}; compressed updates use plain error "
                "feedback under the optimizer's own state (SGD with momentum, Adam and AdamW get their "
                "momentum handed over: see the README)"
            )

    def release(self) -> None:
        """Nothing to undo: SGD's values are zeroed only inside :meth:`stepping`."""

    def stepping(self, optimizers: Sequence[Any]) -> AbstractContextManager[Any]:
        """Around an optimizer step: the optimizers' momentum and decay zeroed while the memory owns them."""
        return momentum_free(optimizers) if self.active else nullcontext()
