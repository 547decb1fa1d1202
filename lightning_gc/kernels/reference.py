"""Torch implementations of the compression hot path (the reference the Triton kernels must match).

Top-k selection by sampled threshold (DGC §3.1)
------------------------------------------------
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
a pure function of its inputs: reruns and resumed runs choose identical indices.

On the CPU the pass over the whole tensor is the cost (it is memory-bound), so ``C`` is found
without materialising ``|x|`` or a mask: the tensor is viewed as rows of :data:`ROW` elements,
one ``amax`` and one ``amin`` pass give each row's largest magnitude ``r_j = max(max x, -min x)``,
and only rows with ``r_j >= thr`` are read again (at most ``|C|`` of them). That is two
vectorised read-only passes instead of ``abs`` + compare + ``nonzero`` (two writes, three reads),
about 3x faster on one core, and it yields ``C`` in ascending order exactly as ``nonzero`` does.
A NaN in a row makes ``r_j`` NaN, which no threshold admits (NaN never reaches the hook: it
screens gradients first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_SAMPLE_HITS = 16
"""The sample is made large enough that at least this many sampled elements are expected above the
true k-th magnitude (``k * s / n >= MIN_SAMPLE_HITS``)."""

_CANDIDATE_MARGIN = 2
_SALT_MULTIPLIER = 0x9E3779B1  # Knuth's multiplicative hash: spreads consecutive salts over 32 bits


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


_JITTER_MUL = 0x9E3779B1  # Fibonacci hashing: the block number's product spreads over 32 bits


def sample_positions(plan: SamplePlan, device: torch.device | str) -> torch.Tensor:
    """The sampled positions (int64): block ``i`` contributes ``i * stride + jitter_i`` with
    ``jitter_i = ((i * 0x9E3779B1 + key) mod 2^32) * stride >> 32``, uniform in ``[0, stride)``.
    Integer arithmetic only, identical in the Triton kernel."""
    block = torch.arange(plan.samples, device=device, dtype=torch.int64)
    jitter = (((block * _JITTER_MUL + plan.key) & 0xFFFFFFFF) * plan.stride) >> 32
    return block * plan.stride + jitter


def sample_plan(numel: int, k: int, sample_ratio: float, salt: int) -> SamplePlan | None:
    """The sample for keeping ``k`` of ``numel`` (``k < numel``); ``None`` when the sample would be
    a large part of the tensor and an exact top-k is as cheap. Shared by every implementation."""
    samples = sample_size(numel, k, sample_ratio)
    if 4 * samples >= numel:
        return None
    stride = numel // samples
    rank = min(samples, _CANDIDATE_MARGIN * math.ceil(k * samples / numel) + 2)
    return SamplePlan(samples=samples, stride=stride, key=(salt * _SALT_MULTIPLIER) & 0xFFFFFFFF, rank=rank)


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


# ---------------------------------------------------------------------------------------------
# Counter-based random numbers, bit-identical in torch (any device) and in the Triton kernels
# ---------------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
_HASH_MUL = (0x7FEB352D, 0x846CA68B)  # "lowbias32" (C. Wellons), a 32-bit integer hash with low bias
_ROUND_SALT = 0x9E3779B9
_SEED_HI_SALT = 0x68E31DA4


def lowbias32(x: int) -> int:
    """The 32-bit hash on a Python int (for keys computed on the host)."""
    x ^= x >> 16
    x = (x * _HASH_MUL[0]) & _MASK32
    x ^= x >> 15
    x = (x * _HASH_MUL[1]) & _MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 32-bit key mixing all 64 bits of ``seed``."""
    return lowbias32(seed & _MASK32) ^ lowbias32(((seed >> 32) & _MASK32) ^ _SEED_HI_SALT)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    # Low 32 bits of x * constant for uint32 x held in int64; 16-bit halves keep products < 2**49.
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & _MASK32


def _lowbias32_tensor(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _HASH_MUL[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _HASH_MUL[1])
    return x ^ (x >> 16)


def counter_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) for each offset: ``hash(hash(offset ^ key(seed)) ^ salt) >> 8``
    scaled by 2**-24 (exact in float32). A pure function of (seed, offset), so reproducible, and
    identical to the Triton kernels' ``_counter_uniform``. Offsets must be below 2**32."""
    x = offsets.to(torch.int64) ^ seed_key(seed)
    bits = _lowbias32_tensor(_lowbias32_tensor(x) ^ _ROUND_SALT)
    return (bits >> 8).to(torch.float32) * (1.0 / 16777216.0)


# ---------------------------------------------------------------------------------------------
# Bit packing and stochastic quantisation
# ---------------------------------------------------------------------------------------------
CODE_WIDTHS = (1, 2, 4, 8)
CHUNK = 1 << 18
"""Elements per step of the chunked torch quantiser (a multiple of 8, so chunks start on bytes)."""


def code_width(levels: int) -> int:
    """Bits per code ``(level << 1) | negative`` for ``levels`` quantisation levels (a power of 2)."""
    needed = 1 + int(levels).bit_length()
    for width in CODE_WIDTHS[1:]:
        if width >= needed:
            return width
    raise ValueError(f"`levels` must be in [1, 127] to fit 8-bit codes, got {levels!r}")


def packed_bytes(numel: int, width: int) -> int:
    return -(-numel * width // 8)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack ``width``-bit codes (uint8, each < 2**width) little-end first: code j of byte b sits
    at bits ``[j*width, (j+1)*width)`` of byte b. The tail is zero-padded. Chunked (:data:`CHUNK`)."""
    per_byte = 8 // width
    out = torch.empty(packed_bytes(codes.numel(), width), dtype=torch.uint8, device=codes.device)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * width
    for start in range(0, codes.numel(), CHUNK):
        chunk = codes[start : start + CHUNK]
        padded = torch.zeros(packed_bytes(chunk.numel(), width) * per_byte, dtype=torch.int32, device=codes.device)
        padded[: chunk.numel()] = chunk
        first = start // per_byte
        out[first : first + padded.numel() // per_byte] = (padded.view(-1, per_byte) << shifts).sum(1)
    return out


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``numel`` codes as uint8. Chunked (:data:`CHUNK`)."""
    per_byte = 8 // width
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * width
    for start in range(0, numel, CHUNK):
        stop = min(numel, start + CHUNK)
        chunk = packed[start // per_byte : packed_bytes(stop, width)].to(torch.int32)
        codes = (chunk.view(-1, 1) >> shifts) & ((1 << width) - 1)
        out[start:stop] = codes.reshape(-1)[: stop - start]
    return out


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per element, 1 where ``values < 0`` (so 0 counts as positive), 8 per byte."""
    return pack_codes((values < 0).to(torch.uint8), 1)


def quantize_factor(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """``levels / scales`` as float32 (0 where a scale is 0), computed once so both implementations
    multiply by the same correctly rounded factors (GPU division may be approximate)."""
    scales = scales.to(torch.float32)
    positive = scales > 0
    safe = torch.where(positive, scales, torch.ones_like(scales))
    return torch.where(positive, levels / safe, torch.zeros_like(scales))


def per_element(per_block: torch.Tensor, chunk_size: int | None, start: int, count: int) -> torch.Tensor:
    """Each of elements ``start .. start + count``'s entry of ``per_block``: entry ``i // chunk_size``,
    or the single entry (broadcast) when ``chunk_size`` is ``None``."""
    if chunk_size is None:
        return per_block.reshape(1)
    return per_block[torch.arange(start, start + count, device=per_block.device) // chunk_size]


def stochastic_quantize(
    values: torch.Tensor, scales: torch.Tensor, levels: int, seed: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Unbiased stochastic rounding of ``|values| / scale * levels`` to an integer level, packed.

    ``level = floor(r) + [uniform < r - floor(r)]`` with ``r = |x| / scale * levels`` (clamped to
    ``levels``) and the uniform drawn by :func:`counter_uniform` at offset = element index, so
    ``E[sign * level / levels * scale] = x`` and the result is reproducible. ``scales`` holds one
    scale for the whole tensor (``chunk_size=None``) or one per ``chunk_size`` consecutive elements.
    QSGD uses ``scale = ||x||_2`` of the chunk; TernGrad is ``levels = 1`` with ``scale = max |x|``.
    Codes are ``(level << 1) | negative`` at :func:`code_width` bits.

    Works in chunks of :data:`CHUNK` elements: the integer temporaries then stay small, instead of
    several gradient-sized int64 buffers that each fault their pages in again.
    """
    width = code_width(levels)
    factors = quantize_factor(scales, levels)
    flat = values.reshape(-1)
    out = torch.empty(packed_bytes(flat.numel(), width), dtype=torch.uint8, device=flat.device)
    per_byte = 8 // width
    for start in range(0, flat.numel(), CHUNK):  # CHUNK is a multiple of 8: chunks start on byte boundaries
        x = flat[start : start + CHUNK].to(torch.float32)
        r = torch.clamp(x.abs() * per_element(factors, chunk_size, start, x.numel()), max=float(levels))
        floor = torch.floor(r)
        uniform = counter_uniform(seed, torch.arange(start, start + x.numel(), device=x.device))
        level = (floor + (uniform < (r - floor)).to(torch.float32)).to(torch.int32)
        codes = (level << 1) | (x < 0).to(torch.int32)
        out[start // per_byte : start // per_byte + packed_bytes(x.numel(), width)] = pack_codes(
            codes.to(torch.uint8), width
        )
    return out


def stochastic_dequantize(
    packed: torch.Tensor, scales: torch.Tensor, levels: int, numel: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Values (float32) of :func:`stochastic_quantize`'s codes: ``sign * level / levels * scale``."""
    steps = scales.to(torch.float32).reshape(-1) / levels
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    codes = unpack_codes(packed, code_width(levels), numel)
    for start in range(0, numel, CHUNK):
        chunk = codes[start : start + CHUNK].to(torch.int32)
        magnitude = (chunk >> 1).to(torch.float32) * per_element(steps, chunk_size, start, chunk.numel())
        out[start : start + chunk.numel()] = torch.where((chunk & 1).bool(), -magnitude, magnitude)
    return out
