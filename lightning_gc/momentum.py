"""Moving SGD momentum (and the weight decay inside it) from the optimizer into compression memory.

DGC's momentum correction accumulates *momentum*, not raw gradients, in the residual. The user
keeps writing ``torch.optim.SGD(params, lr, momentum=m, nesterov=..., weight_decay=wd)``; this
module takes ``m``, ``nesterov`` and ``wd`` out of every SGD param group so that the optimizer
performs a momentum-free, decay-free step on the aggregated update, and the memory applies
them instead (see :mod:`lightning_gc.memory`).

torch's SGD adds weight decay *before* momentum (``buf = m*buf + g + wd*p``), so decay must move
together with momentum for the dense limit to equal ordinary SGD. Groups without momentum keep
their weight decay: it is then applied densely by the optimizer, which is exact and cheaper.

The moved values are stored in the param group itself under :data:`GROUP_KEY`. Param groups are
part of ``optimizer.state_dict()``, so they survive checkpoints, and a scheduler that rewrites
``group["momentum"]`` (e.g. ``OneCycleLR(cycle_momentum=True)``) is picked up the next time
:func:`absorb_sgd_momentum` runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

GROUP_KEY = "lightning_gc"


@dataclass(frozen=True)
class MomentumSpec:
    """The momentum recurrence the memory applies to one parameter.

    ``u <- m*u + g`` (plain) or ``u <- m*(u + g)`` (Nesterov), with ``g`` the local gradient
    plus ``weight_decay * p``. ``momentum == 0`` means plain error feedback.
    """

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


NO_MOMENTUM = MomentumSpec()


def _unwrap(optimizer: object) -> object:
    # Lightning wraps optimizers in LightningOptimizer; the param groups live on the inner one.
    return getattr(optimizer, "_optimizer", optimizer)


def absorb_sgd_momentum(optimizers: Iterable[object]) -> dict[int, MomentumSpec]:
    """Move momentum/Nesterov/weight decay out of every SGD param group; return ``id(param) -> spec``.

    Idempotent: a group already absorbed keeps its stored values unless something (a scheduler)
    has written a non-zero momentum into it again, in which case the new value is taken.
    Optimizers other than SGD are left alone and their parameters get :data:`NO_MOMENTUM`.

    Raises:
        ValueError: an SGD group uses ``dampening != 0`` or ``maximize=True``, which momentum
            correction cannot reproduce.
    """
    specs: dict[int, MomentumSpec] = {}
    for optimizer in optimizers:
        inner = _unwrap(optimizer)
        if not isinstance(inner, torch.optim.SGD):
            continue
        for group in inner.param_groups:
            if group.get("momentum", 0.0) != 0.0:
                if group.get("dampening", 0.0) != 0.0:
                    raise ValueError(
                        f"momentum correction needs SGD `dampening=0`, got dampening={group['dampening']!r}; "
                        "set dampening=0 or pass momentum_correction=False"
                    )
                if group.get("maximize", False):
                    raise ValueError("momentum correction does not support SGD `maximize=True`")
                # On re-absorption only momentum was rewritten; nesterov/decay were zeroed by us.
                stored = group.get(GROUP_KEY, {})
                group[GROUP_KEY] = {
                    "momentum": float(group["momentum"]),
                    "nesterov": bool(group.get("nesterov", False) or stored.get("nesterov", False)),
                    "weight_decay": float(group.get("weight_decay", 0.0) or stored.get("weight_decay", 0.0)),
                }
                group["momentum"], group["nesterov"], group["weight_decay"] = 0.0, False, 0.0
            spec = MomentumSpec(**group[GROUP_KEY]) if GROUP_KEY in group else NO_MOMENTUM
            for param in group["params"]:
                specs[id(param)] = spec
    return specs
