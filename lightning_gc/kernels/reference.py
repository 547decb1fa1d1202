"""Torch implementations of the compression hot path (the reference the Triton kernels must match).

Top-k selection by sampled threshold (DGC §3.1)
------------------------------------------------
Exact ``torch.topk`` over millions of elements is slow (a partial sort). DGC instead estimates the
magnitude threshold from a small sample, keeps the elements above it as candidates, and runs an
exact top-k only over those candidates::

    s      = sample size: max(sample_ratio * n, MIN_SAMPLE_HITS * n / k), a strided sample of |x|
    j      = 2 * ceil(k * s / n) + 2          the sample rank expected to admit ~2k candidates
    thr    = j-th largest |x| in the sample
    C      = { i : |x_i| >= thr }             (retry with a 4x lower sample rank while |C| < k)
    result = exact top-k of |x| over C

Whenever ``|C| >= k`` every element of the true top-k has magnitude ``>= thr`` and is in ``C``,
so the result *is* the exact top-k (up to ties): the sample only decides how much work the
final top-k does, never which elements win. The 2x margin makes a retry rare (the sample rank
``j`` is >= 34, so the candidate count's relative spread is about 1/sqrt(j) < 20 %).

The sample is strided with an offset derived from ``salt`` (the step and the parameter), so the
selection is a pure function of its inputs: reruns and resumed runs choose identical indices.
"""

from __future__ import annotations

import math

import torch

MIN_SAMPLE_HITS = 16
"""The sample is made large enough that at least this many sampled elements are expected above the
true k-th magnitude (``k * s / n >= MIN_SAMPLE_HITS``)."""

_CANDIDATE_MARGIN = 2
_SALT_MULTIPLIER = 0x9E3779B1  # Knuth's multiplicative hash: spreads consecutive salts over the stride


class SelectionScratch:
    """Reusable ``|x|`` and mask buffers, grown to the largest tensor seen, so selection allocates
    nothing gradient-sized in steady state. Not thread-safe: one per hook state."""

    def __init__(self) -> None:
        self._magnitude: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = like.numel()
        current = self._magnitude
        if current is None or current.numel() < numel or current.dtype != like.dtype or current.device != like.device:
            self._magnitude = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._mask = torch.empty(numel, dtype=torch.bool, device=like.device)
        assert self._magnitude is not None and self._mask is not None
        return self._magnitude[:numel], self._mask[:numel]


def sample_size(numel: int, k: int, sample_ratio: float) -> int:
    """Number of elements sampled to estimate the threshold for keeping ``k`` of ``numel``."""
    return min(numel, max(math.ceil(sample_ratio * numel), math.ceil(MIN_SAMPLE_HITS * numel / max(k, 1))))


def topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64) of the ``k`` largest ``|values|``, exact, in no particular order."""
    if k >= values.numel():
        return torch.arange(values.numel(), device=values.device)
    return torch.topk(values.abs(), k, sorted=False).indices


def sampled_topk_indices(
    values: torch.Tensor,
    k: int,
    *,
    sample_ratio: float,
    salt: int = 0,
    scratch: SelectionScratch | None = None,
) -> torch.Tensor:
    """Indices (int64) of the ``k`` largest ``|values|`` of a 1-D tensor, via a sampled threshold.

    Args:
        values: 1-D tensor.
        k: number of indices to return, ``1 <= k``; all indices when ``k >= values.numel()``.
        sample_ratio: fraction of ``values`` sampled for the threshold (raised when too few
            sampled elements would land above it, see :data:`MIN_SAMPLE_HITS`).
        salt: selects the offset of the strided sample; the same salt gives the same result.
        scratch: reusable buffers for ``|values|`` and the candidate mask.
    """
    numel = values.numel()
    if k >= numel:
        return torch.arange(numel, device=values.device)
    samples = sample_size(numel, k, sample_ratio)
    if 4 * samples >= numel:  # the sample would be a large part of the tensor: exact is as cheap
        return topk_indices(values, k)
    magnitude, mask = (scratch or SelectionScratch()).buffers(values)
    torch.abs(values, out=magnitude)
    stride = numel // samples
    offset = (salt * _SALT_MULTIPLIER) % stride
    sample = magnitude[offset::stride][:samples]
    rank = min(samples, _CANDIDATE_MARGIN * math.ceil(k * samples / numel) + 2)
    while True:
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        candidates = torch.nonzero(torch.ge(magnitude, threshold, out=mask)).view(-1)
        if candidates.numel() >= k:
            break
        if rank == samples:  # even the sample's minimum admits fewer than k: give up sampling
            return torch.topk(magnitude, k, sorted=False).indices
        rank = min(samples, 4 * rank)
    chosen = torch.topk(magnitude[candidates], k, sorted=False).indices
    return candidates[chosen]


def compensate_(
    grad: torch.Tensor,
    velocity: torch.Tensor,
    momentum_buf: torch.Tensor | None = None,
    *,
    momentum: float = 0.0,
    nesterov: bool = False,
    grad_scale: torch.Tensor | None = None,
    weight_decay: float = 0.0,
    param: torch.Tensor | None = None,
) -> None:
    """One slice's compensation step, in place on ``velocity`` (v) and ``momentum_buf`` (u)::

        d = grad * grad_scale + weight_decay * param      (each term only when given)
        momentum != 0, plain:    u <- m*u + d;      v <- v + u
        momentum != 0, Nesterov: u <- m*(u + d);    v <- v + u + d
        momentum == 0:           v <- v + d         (error feedback; u untouched, may be None)

    ``grad_scale`` is a 0-d tensor on the slice's device (e.g. a clipping factor), so no host
    sync is needed. ``grad`` may be overwritten with ``d``.
    """
    if grad_scale is not None:
        grad.mul_(grad_scale)
    if weight_decay != 0.0:
        assert param is not None, "weight decay needs the parameter"
        grad.add_(param, alpha=weight_decay)
    if momentum == 0.0:
        velocity.add_(grad)
        return
    assert momentum_buf is not None, "momentum needs a momentum buffer"
    if nesterov:
        momentum_buf.add_(grad).mul_(momentum)
        velocity.add_(momentum_buf).add_(grad)
    else:
        torch.add(grad, momentum_buf, alpha=momentum, out=momentum_buf)
        velocity.add_(momentum_buf)


def sampled_topk_(
    values: torch.Tensor,
    k: int,
    *,
    sample_ratio: float,
    salt: int,
    scratch: SelectionScratch | None,
    out_indices: torch.Tensor,
    out_values: torch.Tensor,
) -> None:
    """Write the ``k`` largest-magnitude (index, value) pairs of ``values`` into the outputs.

    Contract shared with the Triton implementation: every pair is either a selected element
    (its index and exact value) or a no-op (any index, value 0). This implementation always
    writes exactly the top-k (no no-ops).
    """
    indices = sampled_topk_indices(values, k, sample_ratio=sample_ratio, salt=salt, scratch=scratch)
    out_indices.copy_(indices)
    torch.index_select(values, 0, indices, out=out_values)


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
