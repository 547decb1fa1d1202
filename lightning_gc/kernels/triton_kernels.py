"""Triton kernels for the compression hot path; each must equal its torch twin in ``reference.py``.

Imported lazily by :mod:`lightning_gc.kernels` (only when the Triton backend is chosen), so CPU
users never pay Triton's import or compile cost.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.dispatch import interpreting

BLOCK = 1024
_INTERPRETER_LOCK = threading.Lock()


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel``; serialised under TRITON_INTERPRET=1, whose interpreter keeps global grid
    state (DDP runs hooks and communication callbacks on different threads). The kernels index
    their tensors as flat arrays, so a strided view would be read or written wrongly: refused."""
    strided = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_contiguous()]
    if strided:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        raise ValueError(f"{name}: tensor arguments {strided} are not contiguous")
    if interpreting():
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


@triton.jit
def _compensate_kernel(
    grad_ptr,
    velocity_ptr,
    momentum_ptr,
    scale_ptr,
    param_ptr,
    numel,
    momentum,
    weight_decay,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One pass: read g (and p), u, v; write u, v. Arithmetic in fp32 whatever the storage dtype.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    d = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32)
    if HAS_SCALE:
        d = d * tl.load(scale_ptr).to(tl.float32)
    if HAS_DECAY:
        d = d + weight_decay * tl.load(param_ptr + offsets, mask=inside).to(tl.float32)
    v = tl.load(velocity_ptr + offsets, mask=inside).to(tl.float32)
    if HAS_MOMENTUM:
        u = tl.load(momentum_ptr + offsets, mask=inside).to(tl.float32)
        if NESTEROV:
            u = momentum * (u + d)
            v = v + u + d
        else:
            u = momentum * u + d
            v = v + u
        tl.store(momentum_ptr + offsets, u.to(momentum_ptr.dtype.element_ty), mask=inside)
    else:
        v = v + d
    tl.store(velocity_ptr + offsets, v.to(velocity_ptr.dtype.element_ty), mask=inside)


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
    """Fused :func:`lightning_gc.kernels.reference.compensate_` (contiguous 1-D slices; ``grad`` is not written)."""
    numel = grad.numel()
    if numel == 0:
        return
    has_momentum = momentum != 0.0
    has_decay = weight_decay != 0.0
    _launch(
        _compensate_kernel,
        (triton.cdiv(numel, BLOCK),),
        grad,
        velocity,
        momentum_buf if has_momentum else velocity,  # unused pointer when HAS_MOMENTUM is false
        grad_scale if grad_scale is not None else velocity,
        param if has_decay else velocity,
        numel,
        float(momentum),
        float(weight_decay),
        HAS_MOMENTUM=has_momentum,
        NESTEROV=nesterov,
        HAS_SCALE=grad_scale is not None,
        HAS_DECAY=has_decay,
        BLOCK=BLOCK,
    )


# ---------------------------------------------------------------------------------------------
# Top-k selection without a host sync: sample -> threshold -> count -> compact -> exact top-k
# ---------------------------------------------------------------------------------------------
CANDIDATE_HEADROOM = 4
"""Candidate buffer capacity, in multiples of the expected candidate count (which is ~2k)."""


@triton.jit
def _sample_abs_kernel(values_ptr, out_ptr, key, stride, samples, BLOCK: tl.constexpr):
    # Twin of reference.sample_positions: one jittered element per block of ``stride``.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < samples
    block = i.to(tl.int64)
    hashed = (block * tl.full([], 0x9E3779B1, tl.int64) + key) & tl.full([], 0xFFFFFFFF, tl.int64)
    jitter = (hashed * stride) >> 32
    x = tl.load(values_ptr + block * stride + jitter, mask=inside)
    tl.store(out_ptr + i, tl.abs(x.to(tl.float32)), mask=inside)


@triton.jit
def _count_kernel(values_ptr, numel, threshold_ptr, counts_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    magnitude = tl.abs(tl.load(values_ptr + offsets, mask=inside, other=0.0).to(tl.float32))
    hit = (magnitude >= tl.load(threshold_ptr)) & inside
    tl.store(counts_ptr + tl.program_id(0), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(
    values_ptr, numel, threshold_ptr, block_start_ptr, cand_index_ptr, cand_magnitude_ptr, capacity, BLOCK: tl.constexpr
):
    # Block b writes its hits, in position order, from slot block_start[b] on (exclusive prefix sum).
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    magnitude = tl.abs(tl.load(values_ptr + offsets, mask=inside, other=0.0).to(tl.float32))
    hit = (magnitude >= tl.load(threshold_ptr)) & inside
    slot = tl.load(block_start_ptr + tl.program_id(0)) + tl.cumsum(hit.to(tl.int32), axis=0) - 1
    keep = hit & (slot < capacity)
    tl.store(cand_index_ptr + slot, offsets.to(tl.int64), mask=keep)
    tl.store(cand_magnitude_ptr + slot, magnitude, mask=keep)


def sampled_topk_(
    values: torch.Tensor,
    k: int,
    *,
    sample_ratio: float,
    salt: int,
    scratch: object | None,
    out_indices: torch.Tensor,
    out_values: torch.Tensor,
) -> None:
    """Sync-free :func:`lightning_gc.kernels.reference.sampled_topk_`.

    Candidates ``|x| >= thr`` are compacted into a buffer of fixed capacity, then an exact top-k
    runs over it. When fewer than ``k`` elements pass the threshold, the missing pairs are no-ops
    (value 0); when more than the capacity pass, the first ones by position are kept. Both cases
    only make a step send less than the exact top-k; nothing is lost, since memory keeps all that
    was not sent. With the default 2x margin and 4x headroom both are rare.
    """
    from lightning_gc.kernels.reference import sample_plan

    numel = values.numel()
    device = values.device
    plan = None if k >= numel else sample_plan(numel, k, sample_ratio, salt)
    if plan is None:
        indices = torch.topk(values.abs(), min(k, numel), sorted=False).indices
        out_indices.copy_(indices)
        torch.index_select(values, 0, indices, out=out_values)
        return
    sample = torch.empty(plan.samples, dtype=torch.float32, device=device)
    _launch(_sample_abs_kernel, (triton.cdiv(plan.samples, BLOCK),), values, sample, plan.key, plan.stride,
            plan.samples, BLOCK=BLOCK)  # fmt: skip
    threshold = torch.topk(sample, plan.rank, sorted=False).values.min().reshape(1)

    blocks = triton.cdiv(numel, BLOCK)
    counts = torch.empty(blocks, dtype=torch.int32, device=device)
    _launch(_count_kernel, (blocks,), values, numel, threshold, counts, BLOCK=BLOCK)
    block_start = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    expected = -(-plan.rank * numel // plan.samples)
    capacity = max(k, min(numel, CANDIDATE_HEADROOM * expected + BLOCK))
    cand_index = torch.zeros(capacity, dtype=torch.int64, device=device)
    cand_magnitude = torch.full((capacity,), -1.0, dtype=torch.float32, device=device)
    _launch(
        _compact_kernel,
        (blocks,),
        values,
        numel,
        threshold,
        block_start,
        cand_index,
        cand_magnitude,
        capacity,
        BLOCK=BLOCK,
    )

    best = torch.topk(cand_magnitude, k, sorted=False)
    indices = cand_index[best.indices]
    out_indices.copy_(indices)
    chosen = torch.index_select(values, 0, indices)
    torch.where(best.values >= 0, chosen, torch.zeros((), dtype=values.dtype, device=device), out=out_values)


# ---------------------------------------------------------------------------------------------
# Memory commit (with momentum factor masking) and decompression: scatters over k pairs
# ---------------------------------------------------------------------------------------------
@triton.jit
def _commit_sparse_kernel(
    velocity_ptr, momentum_ptr, index_ptr, sent_ptr, pairs, MASK: tl.constexpr, BLOCK: tl.constexpr
):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = j < pairs
    i = tl.load(index_ptr + j, mask=inside, other=0).to(tl.int64)
    sent = tl.load(sent_ptr + j, mask=inside, other=0.0).to(tl.float32)
    # atomic: indices may repeat; relaxed: a pure accumulation, ordered by the kernel's end alone
    tl.atomic_add(velocity_ptr + i, -sent, mask=inside, sem="relaxed")
    if MASK:
        zero = tl.zeros([BLOCK], dtype=tl.float32).to(momentum_ptr.dtype.element_ty)
        tl.store(momentum_ptr + i, zero, mask=inside & (sent != 0.0))


def commit_sparse_(
    velocity: torch.Tensor, momentum_buf: torch.Tensor | None, indices: torch.Tensor, sent: torch.Tensor
) -> None:
    """Fused :func:`lightning_gc.kernels.reference.commit_sparse_`: one pass over the sent pairs."""
    pairs = indices.numel()
    if pairs == 0:
        return
    masking = momentum_buf is not None
    _launch(
        _commit_sparse_kernel,
        (triton.cdiv(pairs, BLOCK),),
        velocity,
        momentum_buf if masking else velocity,
        indices,
        sent,
        pairs,
        MASK=masking,
        BLOCK=BLOCK,
    )


@triton.jit
def _scatter_average_kernel(out_ptr, index_ptr, values_ptr, pairs, scale, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = j < pairs
    i = tl.load(index_ptr + j, mask=inside, other=0).to(tl.int64)
    v = tl.load(values_ptr + j, mask=inside, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + i, v * scale, mask=inside, sem="relaxed")  # a pure accumulation: no ordering


def scatter_average_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, world_size: int) -> None:
    """Fused :func:`lightning_gc.kernels.reference.scatter_average_` (atomics: sums in any order)."""
    pairs = indices.numel()
    if pairs == 0:
        return
    indices, values = indices.contiguous(), values.contiguous()  # e.g. one pair per rank's row
    _launch(
        _scatter_average_kernel,
        (triton.cdiv(pairs, BLOCK),),
        out,
        indices,
        values,
        pairs,
        1.0 / world_size,
        BLOCK=BLOCK,
    )


# ---------------------------------------------------------------------------------------------
# Bit packing and stochastic quantisation: each program owns BLOCK output bytes
# ---------------------------------------------------------------------------------------------
PACK_BLOCK = 256


@triton.jit
def _pack_tile(codes, WIDTH: tl.constexpr, PER_BYTE: tl.constexpr):
    # codes: [PACK_BLOCK, PER_BYTE] int32 -> [PACK_BLOCK] bytes, code j at bits [j*WIDTH, (j+1)*WIDTH).
    shifts = (tl.arange(0, PER_BYTE) * WIDTH)[None, :]
    return tl.sum(codes << shifts, axis=1).to(tl.uint8)


@triton.jit
def _pack_codes_kernel(
    codes_ptr, out_ptr, numel, n_bytes, WIDTH: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr
):
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    element = byte[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]
    codes = tl.load(codes_ptr + element, mask=element < numel, other=0).to(tl.int32)
    tl.store(out_ptr + byte, _pack_tile(codes, WIDTH, PER_BYTE), mask=byte < n_bytes)


@triton.jit
def _unpack_codes_kernel(
    packed_ptr, out_ptr, numel, n_bytes, WIDTH: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr
):
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    shifts = (tl.arange(0, PER_BYTE) * WIDTH)[None, :]
    codes = (packed[:, None] >> shifts) & ((1 << WIDTH) - 1)
    element = byte[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]
    tl.store(out_ptr + element, codes.to(tl.uint8), mask=element < numel)


@triton.jit
def _pack_signs_kernel(values_ptr, out_ptr, numel, n_bytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    element = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    # Compared in float32: the sign is exact, and Triton's interpreter mis-compares bfloat16.
    x = tl.load(values_ptr + element, mask=element < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + byte, _pack_tile((x < 0).to(tl.int32), 1, 8), mask=byte < n_bytes)


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _counter_uniform(key, offsets):
    # Twin of reference.counter_uniform: key = seed_key(seed), computed on the host.
    x = offsets.to(tl.uint32) ^ key.to(tl.uint32)
    bits = _lowbias32(_lowbias32(x) ^ tl.full([], 0x9E3779B9, tl.uint32))
    return (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)


# Triton specialises integer arguments equal to 1 into compile-time constants, which have no
# ``.to``: ``levels`` is 1 for TernGrad and ``key`` can be 1, so neither is specialised.
@triton.jit(do_not_specialize=["key", "levels", "chunk"])
def _stochastic_quantize_kernel(
    values_ptr, factor_ptr, out_ptr, numel, n_bytes, key, levels, chunk,
    WIDTH: tl.constexpr, PER_BYTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Element i is scaled by factor[i // chunk] (chunk = numel: one factor for the whole tensor).
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    element = byte[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]
    inside = element < numel
    x = tl.load(values_ptr + element, mask=inside, other=0.0).to(tl.float32)
    factor = tl.load(factor_ptr + element // chunk, mask=inside, other=0.0)
    r = tl.minimum(tl.abs(x) * factor, levels.to(tl.float32))
    floor = tl.floor(r)
    level = (floor + (_counter_uniform(key, element) < (r - floor)).to(tl.float32)).to(tl.int32)
    codes = tl.where(inside, (level << 1) | (x < 0).to(tl.int32), 0)
    tl.store(out_ptr + byte, _pack_tile(codes, WIDTH, PER_BYTE), mask=byte < n_bytes)


def _byte_grid(n_bytes: int) -> tuple[int]:
    return (triton.cdiv(n_bytes, PACK_BLOCK),)


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.reference.pack_codes`."""
    from lightning_gc.kernels.reference import packed_bytes

    n_bytes = packed_bytes(codes.numel(), width)
    codes = codes.contiguous()
    out = torch.empty(n_bytes, dtype=torch.uint8, device=codes.device)
    if n_bytes:
        _launch(_pack_codes_kernel, _byte_grid(n_bytes), codes, out, codes.numel(), n_bytes,
                WIDTH=width, PER_BYTE=8 // width, BLOCK=PACK_BLOCK)  # fmt: skip
    return out


def unpack_codes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.reference.unpack_codes`."""
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    packed = packed.contiguous()
    if numel:
        _launch(_unpack_codes_kernel, _byte_grid(packed.numel()), packed, out, numel, packed.numel(),
                WIDTH=width, PER_BYTE=8 // width, BLOCK=PACK_BLOCK)  # fmt: skip
    return out


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.reference.pack_signs`: reads values, writes bits."""
    from lightning_gc.kernels.reference import packed_bytes

    n_bytes = packed_bytes(values.numel(), 1)
    out = torch.empty(n_bytes, dtype=torch.uint8, device=values.device)
    if n_bytes:
        _launch(_pack_signs_kernel, _byte_grid(n_bytes), values, out, values.numel(), n_bytes, BLOCK=PACK_BLOCK)
    return out


def stochastic_quantize(
    values: torch.Tensor, scales: torch.Tensor, levels: int, seed: int, chunk_size: int | None = None
) -> torch.Tensor:
    """Fused :func:`lightning_gc.kernels.reference.stochastic_quantize`: quantise and pack in one pass."""
    from lightning_gc.kernels.reference import code_width, packed_bytes, quantize_factor, seed_key

    width = code_width(levels)
    n_bytes = packed_bytes(values.numel(), width)
    out = torch.empty(n_bytes, dtype=torch.uint8, device=values.device)
    if n_bytes:
        factors = quantize_factor(scales, levels).reshape(-1).contiguous()
        chunk = values.numel() if chunk_size is None else chunk_size
        _launch(_stochastic_quantize_kernel, _byte_grid(n_bytes), values, factors, out, values.numel(), n_bytes,
                seed_key(seed), levels, chunk, WIDTH=width, PER_BYTE=8 // width, BLOCK=PACK_BLOCK)  # fmt: skip
    return out
