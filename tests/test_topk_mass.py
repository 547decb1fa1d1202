"""The captured-fraction measure of ``benchmarks/topk_mass.py``."""

from __future__ import annotations

import pytest
import torch

from benchmarks.topk_mass import captured


def test_captured_is_one_for_a_vector_no_denser_than_k_and_the_ratio_for_a_flat_one() -> None:
    sparse = torch.zeros(1000)
    sparse[[3, 500]] = torch.tensor([2.0, -5.0])
    assert captured([sparse, torch.zeros(10, 100)], 0.01) == pytest.approx(1.0)  # k = 10 per tensor
    flat = torch.full((40, 50), -0.3)
    assert captured([flat], 0.01) == pytest.approx(0.01)
    # per tensor: the top 1 of [4, 3, 0, ...] and of [1, 1, 1, 1] (k = 1 each), by squares
    a, b = torch.tensor([4.0, 3.0] + [0.0] * 98), torch.ones(100) * 0.5
    assert captured([a, b], 0.01) == pytest.approx((16 + 0.25) / (25 + 25))
