"""The hand-over of SGD momentum to the memory (wire format round trips: test_wire_format.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_gc.core.momentum import LEGACY_GROUP_KEY, MomentumSpec, momentum_free, sgd_momentum_specs


def _sgd(**kwargs: object) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)


def test_the_memory_takes_momentum_and_decay_and_the_group_keeps_them() -> None:
    opt = _sgd(momentum=0.9, nesterov=True, weight_decay=1e-4)
    group = opt.param_groups[0]
    specs = sgd_momentum_specs([opt])
    assert specs[id(group["params"][0])] == MomentumSpec(0.9, True, 1e-4)
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, True, 1e-4)  # untouched
    assert sgd_momentum_specs([opt]) == specs
    assert opt.state_dict()["param_groups"][0]["momentum"] == 0.9  # checkpoints hold the user's values


def test_the_optimizer_steps_momentum_free_and_gets_its_values_back() -> None:
    opt = _sgd(momentum=0.9, nesterov=True, weight_decay=1e-4)
    param = opt.param_groups[0]["params"][0]
    param.grad = torch.ones(2)
    with momentum_free([opt]):
        assert (opt.param_groups[0]["momentum"], opt.param_groups[0]["weight_decay"]) == (0.0, 0.0)
        opt.step()
    assert torch.equal(param.detach(), torch.full((2,), -0.1))  # lr * grad: no decay, no momentum
    assert opt.state[param].get("momentum_buffer") is None
    assert (opt.param_groups[0]["momentum"], opt.param_groups[0]["nesterov"]) == (0.9, True)
    with pytest.raises(RuntimeError), momentum_free([opt]):
        raise RuntimeError("a failed step")
    assert opt.param_groups[0]["weight_decay"] == 1e-4  # restored on errors too


@pytest.mark.parametrize(
    ("rewrite", "spec"),
    [
        ({"momentum": 0.8}, MomentumSpec(0.8, False, 5e-4)),  # what OneCycleLR(cycle_momentum=True) does
        ({"weight_decay": 1e-2}, MomentumSpec(0.9, False, 1e-2)),  # a weight-decay schedule
        ({"momentum": 0.0}, None),  # momentum scheduled away: the optimizer keeps the decay
    ],
)
def test_schedulers_rewriting_the_group_are_followed(rewrite: dict, spec: MomentumSpec | None) -> None:
    opt = _sgd(momentum=0.9, weight_decay=5e-4)
    sgd_momentum_specs([opt])
    opt.param_groups[0].update(rewrite)
    assert sgd_momentum_specs([opt]).get(id(opt.param_groups[0]["params"][0])) == spec


def test_checkpoints_from_before_keep_their_momentum() -> None:
    """Older checkpoints stored the values under a group key and zeroed the group's own."""
    opt = _sgd(momentum=0.0)
    opt.param_groups[0][LEGACY_GROUP_KEY] = {"momentum": 0.9, "nesterov": False, "weight_decay": 1e-4}
    assert next(iter(sgd_momentum_specs([opt]).values())) == MomentumSpec(0.9, False, 1e-4)
    assert LEGACY_GROUP_KEY not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9


def test_sgd_without_momentum_keeps_its_weight_decay() -> None:
    opt = _sgd(weight_decay=1e-3)
    assert sgd_momentum_specs([opt]) == {}
    with momentum_free([opt]):
        assert opt.param_groups[0]["weight_decay"] == 1e-3


def test_other_optimizers_are_left_alone() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], weight_decay=1e-2)
    assert sgd_momentum_specs([opt]) == {}
    with momentum_free([opt]):
        assert opt.param_groups[0]["weight_decay"] == 1e-2


def test_dampening_cannot_be_corrected() -> None:
    with pytest.raises(ValueError, match="dampening=0"):
        sgd_momentum_specs([_sgd(momentum=0.9, dampening=0.1)])
