"""SGD momentum (and the weight decay inside it) applied by compression memory instead of the optimizer.

DGC's momentum correction accumulates *momentum*, not raw gradients, in the residual. The user
keeps writing ``torch.optim.SGD(params, lr, momentum=m, nesterov=..., weight_decay=wd)``; the
memory applies ``m``, ``nesterov`` and ``wd`` of every SGD param group with momentum (see
:mod:`lightning_gc.core.memory`), and the optimizer takes a momentum-free, decay-free step on the
aggregated update.

torch's SGD adds weight decay *before* momentum (``buf = m*buf + g + wd*p``), so decay must move
together with momentum for the dense limit to equal ordinary SGD. Groups without momentum keep
their weight decay: it is then applied densely by the optimizer, which is exact and cheaper.

The param groups always hold the user's values: :func:`sgd_momentum_specs` reads them (every
batch, so a scheduler that rewrites ``momentum``, ``weight_decay`` or ``nesterov``, including to
0, is followed), and :func:`momentum_free` zeroes them only for the duration of the optimizer's
step. Checkpoints, schedulers and loggers therefore see the values the user set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

LEGACY_GROUP_KEY = "lightning_gc"
"""Where checkpoints written before 2026-11-23 kept the values, with the group's own zeroed."""

_MOVED = ("momentum", "nesterov", "weight_decay")


@dataclass(frozen=True)
class MomentumSpec:
    """The momentum recurrence the memory applies to one parameter.

    ``u <- m*u + (1 - dampening)*g``, SGD's buffer (Nesterov then adds ``g + m*u`` to the velocity,
    plain momentum ``u``), with ``g`` the local gradient plus ``weight_decay * p``. ``momentum == 0``
    means plain error feedback.
    SGD's hand-over has ``dampening = 0``; Adam's first moment is ``m = dampening = beta1``.
    """

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    dampening: float = 0.0


NO_MOMENTUM = MomentumSpec()


def unwrap_optimizer(optimizer: object) -> object:
    """The torch optimizer behind a Lightning ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


def sgd_groups(optimizers: Iterable[object]) -> Iterator[dict[str, Any]]:
    """The param groups of the ``torch.optim.SGD`` optimizers among ``optimizers`` (wrappers
    unwrapped), with the values an older checkpoint moved out put back."""
    for optimizer in optimizers:
        inner = unwrap_optimizer(optimizer)
        if isinstance(inner, torch.optim.SGD):
            for group in inner.param_groups:
                legacy = group.pop(LEGACY_GROUP_KEY, None)
                if legacy is not None and group.get("momentum", 0.0) == 0.0:
                    group.update(legacy)  # an older checkpoint: put the moved values back
                yield group


def sgd_momentum_specs(optimizers: Iterable[object]) -> dict[int, MomentumSpec]:
    """``id(param) -> spec`` for every parameter of an SGD group with momentum, from the group's
    current values; other parameters (other optimizers, SGD without momentum) are absent.

    Raises:
        ValueError: an SGD group with momentum uses ``dampening != 0`` or ``maximize=True``,
            which momentum correction cannot reproduce.
    """
    specs: dict[int, MomentumSpec] = {}
    for group in sgd_groups(optimizers):
        if group.get("momentum", 0.0) == 0.0:
            continue
        if group.get("dampening", 0.0) != 0.0:
            raise ValueError(
                f"momentum correction needs SGD `dampening=0`, got dampening={group['dampening']!r}; "
                "set dampening=0 or pass momentum_correction=False"
            )
        if group.get("maximize", False):
            raise ValueError("momentum correction does not support SGD `maximize=True`")
        spec = MomentumSpec(
            momentum=float(group["momentum"]),
            nesterov=bool(group.get("nesterov", False)),
            weight_decay=float(group.get("weight_decay", 0.0)),
        )
        for param in group["params"]:
            specs[id(param)] = spec
    return specs


@contextmanager
def momentum_free(optimizers: Iterable[object]) -> Iterator[None]:
    """Within the block, every SGD group with momentum has ``momentum``, ``nesterov`` and
    ``weight_decay`` set to 0 (the memory applied them); afterwards they are restored, also when
    the block raises. Wrap exactly the optimizer's step in it."""
    saved = [
        (group, {key: group[key] for key in _MOVED}) for group in sgd_groups(optimizers) if group["momentum"] != 0.0
    ]
    for group, _ in saved:
        group.update(momentum=0.0, nesterov=False, weight_decay=0.0)
    try:
        yield
    finally:
        for group, values in saved:
            group.update(values)
