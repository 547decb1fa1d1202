"""The hook benchmark's op count (``python -m benchmarks.hook_phases --ops``)."""

from __future__ import annotations

import torch

from benchmarks.hook_phases import _OpCounter, count_ops


def test_the_op_counter_counts_ops_that_compute_and_skips_views() -> None:
    values = torch.arange(8.0)
    with _OpCounter() as counter:
        values.view(2, 4)[0].add_(1.0)  # two views, one op
        torch.zeros(3)
    assert counter.count == 2


def test_small_tensors_cost_ops_per_tensor_in_the_quantisers_and_none_in_one_cast() -> None:
    """fp16 casts the whole bucket at once: its op count does not depend on how many tensors the
    bucket holds. onebit works tensor by tensor, so a layer's bias and norm add ops of their own."""
    shapes = [(64, 32, 3, 3), (64,), (64,), (128, 64), (128,)]  # two large tensors, three small ones
    every, of_small = count_ops(shapes, ("fp16", {}))
    assert every > 0 and of_small == 0
    every, of_small = count_ops(shapes, ("onebit", {}))
    assert 0 < of_small < every
