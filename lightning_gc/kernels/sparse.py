"""Sparse (index, value) pairs into dense tensors, in torch; Triton twin: :mod:`.sparse_triton`.

Two scatters over the ``k`` pairs of a step: :func:`commit_sparse_` removes what was sent from the
residual memory (with momentum factor masking), :func:`scatter_average_` decodes every rank's
gathered pairs into the averaged gradient::

    commit:   v[i] -= sent;  u[i] <- 0 where sent != 0      for every sent pair (i, sent)
    average:  out[i] += value / world_size                  for every gathered pair (i, value)

Duplicate indices accumulate in both.
"""

from __future__ import annotations

import torch


def commit_sparse_(
    velocity: torch.Tensor, momentum_buf: torch.Tensor | None, indices: torch.Tensor, sent: torch.Tensor
) -> None:
    """Remove what was sent from memory: ``v[i] -= sent`` for every pair, and, when a momentum
    buffer is given (momentum factor masking), ``u[i] <- 0`` where a non-zero value left.

    Subtracting (rather than zeroing) keeps whatever a narrow wire dtype rounded away, and makes
    (i, 0) pairs no-ops; duplicate indices accumulate.
    """
    velocity.index_add_(0, indices, sent.to(velocity.dtype), alpha=-1)
    if momentum_buf is not None:
        keep = (sent == 0).to(momentum_buf.dtype)
        momentum_buf.scatter_reduce_(0, indices, keep, reduce="prod")


def scatter_average_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, world_size: int) -> None:
    """``out[i] += v / world_size`` for every gathered (i, v) pair; duplicates add."""
    out.index_add_(0, indices, values.to(out.dtype), alpha=1.0 / world_size)
