"""The hand-over of SGD momentum to the memory (wire format round trips: test_wire_format.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_gc.momentum import GROUP_KEY, MomentumSpec, absorb_sgd_momentum


def _sgd(**kwargs: object) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **kwargs)


def test_momentum_and_decay_move_out_of_sgd() -> None:
    opt = _sgd(momentum=0.9, nesterov=True, weight_decay=1e-4)
    specs = absorb_sgd_momentum([opt])
    group = opt.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.0, False, 0.0)
    assert specs[id(group["params"][0])] == MomentumSpec(0.9, True, 1e-4)
    assert absorb_sgd_momentum([opt]) == specs  # idempotent
    assert group[GROUP_KEY] in opt.state_dict()["param_groups"][0].values()  # checkpointed with the optimizer


def test_scheduler_rewriting_momentum_is_picked_up_without_losing_decay() -> None:
    opt = _sgd(momentum=0.9, weight_decay=5e-4)
    absorb_sgd_momentum([opt])
    opt.param_groups[0]["momentum"] = 0.8  # what OneCycleLR(cycle_momentum=True) does
    spec = next(iter(absorb_sgd_momentum([opt]).values()))
    assert spec == MomentumSpec(0.8, False, 5e-4)
    assert opt.param_groups[0]["momentum"] == 0.0


def test_sgd_without_momentum_keeps_its_weight_decay() -> None:
    opt = _sgd(weight_decay=1e-3)
    spec = next(iter(absorb_sgd_momentum([opt]).values()))
    assert spec == MomentumSpec() and opt.param_groups[0]["weight_decay"] == 1e-3


def test_other_optimizers_are_left_alone() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], weight_decay=1e-2)
    assert absorb_sgd_momentum([opt]) == {}
    assert opt.param_groups[0]["weight_decay"] == 1e-2


def test_dampening_cannot_be_corrected() -> None:
    with pytest.raises(ValueError, match="dampening=0"):
        absorb_sgd_momentum([_sgd(momentum=0.9, dampening=0.1)])
