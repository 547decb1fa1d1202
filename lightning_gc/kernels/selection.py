"""Top-k selection by sampled threshold (DGC §3.1), in torch; its Triton twin is :mod:`.selection_triton`.

Exact ``torch.topk`` over millions of elements is slow (a partial sort). DGC instead estimates the
magnitude threshold from a small sample, keeps the elements above it as candidates, and runs an
exact top-k only over those candidates::

    s      = sample size: max(sample_ratio * n, MIN_SAMPLE_HITS * n / k), a jittered sample of |x|
    j      = 2 * ceil(k * s / n) + 2          the sample rank expected to admit ~2k candidates
    thr    = j-th largest |x| in the sample
    C      = { i : |x_i| >= thr }             (retry with a 4x lower sample rank while |C| < k)
    result = exact top-k of |x| over C

Whenever ``|C| >= k`` every element of the true top-k has magnitude ``>= thr`` and is in ``C``,
so the result *is* the exact top-k (up to ties): the sample only decides how much work the
final top-k does, never which elements win. The 2x margin makes a retry rare (the sample rank
``j`` is >= 34, so the candidate count's relative spread is about 1/sqrt(j) < 20 %).

The sample is *jittered-stratified*: one element per block of ``n // s``, at a place inside the
block given by a hash of (block number, ``salt``). A plain strided sample aliases with periodic
layouts (a 3x3 convolution's weight gradient sampled with a stride of 36 sees one kernel position
only) and then admits far fewer than ``k`` candidates; the jitter breaks that while keeping the
sample spread over the whole tensor. ``salt`` is the step and the parameter, so the selection is
a pure function of its inputs: reruns and resumed runs choose identical indices. The jitter key is
``salt * FIBONACCI_MUL mod 2**32`` (:mod:`.rng`), the same integers on both implementations.

On the CPU the pass over the whole tensor is the cost (it is memory-bound), so ``C`` is found
without materialising ``|x|`` or a mask: the tensor is viewed as rows of :data:`ROW` elements,
one ``amax`` and one ``amin`` pass give each row's largest magnitude ``r_j = max(max x, -min x)``,
and only rows with ``r_j >= thr`` are read again (at most ``|C|`` of them). That is two
vectorised read-only passes instead of ``abs`` + compare + ``nonzero`` (two writes, three reads),
about 3x faster on one core, and it yields ``C`` in ascending order exactly as ``nonzero`` does.
A NaN in a row makes ``r_j`` NaN, which no threshold admits (NaN never reaches the hook: it
screens gradients first).

On a GPU (:mod:`.selection_triton`) the same sample and threshold are used without a host sync:
no retry, and ``C`` goes through a buffer of fixed capacity, so a step may send fewer than ``k``
pairs (padded with no-ops) but never a wrong one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.kernels.rng import FIBONACCI_MUL, MASK32

MIN_SAMPLE_HITS = 16
"""The sample is made large enough that at least this many sampled elements are expected above the
true k-th magnitude (``k * s / n >= MIN_SAMPLE_HITS``)."""

_CANDIDATE_MARGIN = 2


ROW = 64
"""Elements per row of the CPU candidate search: short rows keep the re-read small (at most
``|C| * ROW`` elements), long rows keep ``amax``/``amin`` vectorised (16-element rows are 6x slower)."""


class SelectionScratch:
    """Reusable per-row maximum buffers, grown to the largest tensor seen, so selection allocates
    nothing gradient-sized (nor ``1/ROW`` of it) in steady state. Not thread-safe: one per hook state."""

    def __init__(self) -> None:
        self._high: torch.Tensor | None = None
        self._low: torch.Tensor | None = None

    def row_buffers(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        current = self._high
        if current is None or current.numel() < rows or current.dtype != like.dtype or current.device != like.device:
            self._high = torch.empty(rows, dtype=like.dtype, device=like.device)
            self._low = torch.empty(rows, dtype=like.dtype, device=like.device)
        assert self._high is not None and self._low is not None
        return self._high[:rows], self._low[:rows]


def sample_size(numel: int, k: int, sample_ratio: float) -> int:
    """Number of elements sampled to estimate the threshold for keeping ``k`` of ``numel``."""
    return min(numel, max(math.ceil(sample_ratio * numel), math.ceil(MIN_SAMPLE_HITS * numel / max(k, 1))))


@dataclass(frozen=True)
class SamplePlan:
    """Where the threshold sample is taken and which of its order statistics is the threshold."""

    samples: int
    stride: int
    key: int  # 32-bit jitter key derived from the salt
    rank: int  # the threshold is the rank-th largest sampled magnitude


def sample_positions(plan: SamplePlan, device: torch.device | str) -> torch.Tensor:
    """The sampled positions (int64): block ``i`` contributes ``i * stride + jitter_i`` with
    ``jitter_i = ((i * FIBONACCI_MUL + key) mod 2^32) * stride >> 32``, uniform in ``[0, stride)``
    (``FIBONACCI_MUL = 0x9E3779B1``, see :mod:`.rng`). Integer arithmetic only, identical in the Triton kernel."""
    block = torch.arange(plan.samples, device=device, dtype=torch.int64)
    jitter = (((block * FIBONACCI_MUL + plan.key) & MASK32) * plan.stride) >> 32
    return block * plan.stride + jitter


def sample_plan(numel: int, k: int, sample_ratio: float, salt: int) -> SamplePlan | None:
    """The sample for keeping ``k`` of ``numel`` (``k < numel``); ``None`` when the sample would be
    a large part of the tensor and an exact top-k is as cheap. Shared by every implementation."""
    samples = sample_size(numel, k, sample_ratio)
    if 4 * samples >= numel:
        return None
    stride = numel // samples
    rank = min(samples, _CANDIDATE_MARGIN * math.ceil(k * samples / numel) + 2)
    return SamplePlan(samples=samples, stride=stride, key=(salt * FIBONACCI_MUL) & MASK32, rank=rank)


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
        values: 1-D contiguous tensor.
        k: number of indices to return, ``1 <= k``; all indices when ``k >= values.numel()``.
        sample_ratio: fraction of ``values`` sampled for the threshold (raised when too few
            sampled elements would land above it, see :data:`MIN_SAMPLE_HITS`).
        salt: keys the sample's jitter; the same salt gives the same result.
        scratch: reusable per-row buffers (see :class:`SelectionScratch`).
    """
    numel = values.numel()
    if k >= numel:
        return torch.arange(numel, device=values.device)
    plan = sample_plan(numel, k, sample_ratio, salt)
    if plan is None:
        return topk_indices(values, k)
    search = _CandidateSearch(values, scratch or SelectionScratch())
    sample = values.index_select(0, sample_positions(plan, values.device)).abs_()  # not x[pos]: 10x slower on CPU
    rank = plan.rank
    while True:
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        candidates, magnitudes = search.at_least(threshold)
        if candidates.numel() >= k:
            break
        if rank == plan.samples:  # even the sample's minimum admits fewer than k: give up sampling
            return topk_indices(values, k)
        rank = min(plan.samples, 4 * rank)
    chosen = torch.topk(magnitudes, k, sorted=False).indices
    return candidates[chosen]


class _CandidateSearch:
    """``{i : |x_i| >= thr}`` in ascending order, for any threshold, from one pass over ``x``.

    ``x`` is viewed as ``[rows, ROW]`` plus a tail of ``numel % ROW``; the row maxima of ``|x|``
    are computed once, and each query re-reads only the rows whose maximum reaches the threshold
    (whole rows, with ``index_select``: far cheaper than gathering single elements).
    """

    def __init__(self, values: torch.Tensor, scratch: SelectionScratch) -> None:
        self.body = values.numel() - values.numel() % ROW
        self.rows = values[: self.body].view(-1, ROW)
        self.tail = values[self.body :]
        high, low = scratch.row_buffers(self.rows.shape[0], values)
        torch.amax(self.rows, dim=1, out=high)
        torch.amin(self.rows, dim=1, out=low)
        self.row_max = torch.maximum(high, low.neg_(), out=high)

    def at_least(self, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, their magnitudes) of every element with ``|x| >= threshold``, ascending."""
        hit_rows = torch.nonzero(self.row_max >= threshold).view(-1)
        hit = self.rows.index_select(0, hit_rows).abs_()
        row, column = torch.nonzero(hit >= threshold, as_tuple=True)
        tail = self.tail.abs()
        tail_kept = torch.nonzero(tail >= threshold).view(-1)
        positions = torch.cat([hit_rows[row] * ROW + column, tail_kept + self.body])
        return positions, torch.cat([hit[row, column], tail[tail_kept]])


@dataclass(frozen=True)
class SegmentedTopK:
    """The top-k selections of one bucket: segment ``i`` is the slice ``[starts[i], starts[i] +
    numels[i])`` of the flat bucket, keeps its ``ks[i]`` largest magnitudes, and writes them to
    output slots ``[firsts[i], firsts[i] + ks[i])`` as *bucket* positions. Its sample is keyed by
    ``step_salt + salts[i]`` (the step's salt plus the parameter's own offset).

    Built once per bucket plan and hashable, so an implementation may cache what it derives from it.
    """

    starts: tuple[int, ...]
    numels: tuple[int, ...]
    ks: tuple[int, ...]
    firsts: tuple[int, ...]
    salts: tuple[int, ...]

    @property
    def total_k(self) -> int:
        return sum(self.ks)


SelectOne = Callable[[torch.Tensor, int, int, torch.Tensor, torch.Tensor], None]
"""``select_one(values, k, salt, out_indices, out_values)``: one tensor's ``k`` pairs, indices in ``values``."""


def for_each_segment(
    select_one: SelectOne,
    values: torch.Tensor,
    segments: SegmentedTopK,
    step_salt: int,
    out_indices: torch.Tensor,
    out_values: torch.Tensor,
) -> None:
    """Select every segment of ``segments`` one at a time through ``select_one``, salted
    ``step_salt + salts[i]``, its indices moved to bucket positions."""
    for start, numel, k, first, salt in zip(
        segments.starts, segments.numels, segments.ks, segments.firsts, segments.salts, strict=True
    ):
        chosen = slice(first, first + k)
        select_one(values[start : start + numel], k, step_salt + salt, out_indices[chosen], out_values[chosen])
        out_indices[chosen].add_(start)


def sampled_one_at_a_time(
    sampled_topk: Callable[..., None],
    values: torch.Tensor,
    segments: SegmentedTopK,
    *,
    sample_ratio: float,
    scratch: SelectionScratch | None,
    **placing: Any,
) -> None:
    """:func:`sampled_topk_segments_` through an implementation's ``sampled_topk_``, one segment at a
    time, each call with ``sample_ratio`` and ``scratch``; ``placing``: :func:`for_each_segment`'s
    ``step_salt``, ``out_indices`` and ``out_values``."""

    def select_one(part: torch.Tensor, k: int, salt: int, indices: torch.Tensor, picked: torch.Tensor) -> None:
        sampled_topk(
            part, k, sample_ratio=sample_ratio, salt=salt, scratch=scratch, out_indices=indices, out_values=picked
        )

    for_each_segment(select_one, values, segments, **placing)


def sampled_topk_segments_(values: torch.Tensor, segments: SegmentedTopK, **selecting: Any) -> None:
    """:func:`sampled_topk_` for every segment of a bucket: ``out_indices`` / ``out_values`` (each
    ``segments.total_k`` long) receive each segment's pairs at its slots, indices as bucket
    positions. Same contract as :func:`sampled_topk_` per segment (a pair is a selected element
    or a no-op of value 0); here, one tensor at a time. ``selecting``: the keywords of
    :func:`sampled_one_at_a_time` (``sample_ratio``, ``step_salt``, ``scratch``, ``out_indices``,
    ``out_values``), which the Triton twin names one by one."""
    sampled_one_at_a_time(sampled_topk_, values, segments, **selecting)


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
