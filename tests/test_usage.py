"""GradientUsage: which parameters got a gradient, as autograd (and so DDP) sees it."""

from __future__ import annotations

import torch

from lightning_gc.runtime.usage import GradientUsage


def test_a_zeroed_gradient_is_not_a_use_and_each_take_starts_afresh() -> None:
    used, idle = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    usage = GradientUsage([used, idle, frozen])
    idle.grad = torch.zeros(3)  # what zero_grad(set_to_none=False) leaves: a tensor, no use
    (used * 2).sum().backward()
    assert usage.take([used, idle, frozen]) == [True, False, False]
    assert usage.take([used]) == [False]  # forgotten once taken
    (used * 2).sum().backward()  # two microbatches (no_sync) before a synchronised step: one use
    (used * 3).sum().backward()
    assert usage.take([used, idle]) == [True, False]
    usage.remove()
    (used * 2).sum().backward()
    assert usage.take([used]) == [False]  # the hooks are off the parameters
