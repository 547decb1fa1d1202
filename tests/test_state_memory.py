"""The per-rank memory count (``python -m benchmarks.state_memory``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.state_memory import held_bytes, measure

SHAPES = [(64, 512), (64,), (128, 64)]  # 41,024 float32 elements: 164,096 bytes of gradient


@dataclass
class _Holder:
    tensors: dict[str, torch.Tensor]


_Holder.__module__ = "lightning_gc.test_holder"  # held_bytes follows lightning_gc objects only


def test_a_storage_counts_once_however_many_views_reach_it() -> None:
    buffer = torch.zeros(100)
    holder = _Holder({"whole": buffer, "first": buffer[:10], "last": buffer[90:], "other": torch.zeros(5)})
    assert held_bytes([holder, [buffer[3:7]], (holder,)]) == 4 * 105


def test_two_phase_state_shrinks_with_the_world_size_where_the_gathered_form_grows() -> None:
    """The gathered form receives every rank's payload; the two-phase owner keeps its chunk's
    state in runs of 1/N of the bucket. The memory's residual is one gradient whatever the codec."""
    gathered = [measure(SHAPES, ("onebit", {}), n) for n in (2, 8)]
    two_phase = [measure(SHAPES, ("onebit", {"exchange": "two_phase"}), n) for n in (2, 8)]
    gradient = 4 * (64 * 512 + 64 + 128 * 64)
    assert all(g == gradient and m == gradient for _, m, g in gathered + two_phase)
    assert gathered[1][0] > gathered[0][0]
    assert two_phase[1][0] < two_phase[0][0]
    assert two_phase[0][0] < 2.2 * gradient  # its decoded contribution, the chunk's two runs, payloads
