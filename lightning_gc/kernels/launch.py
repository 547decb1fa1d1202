"""Where every Triton kernel is launched from: contiguity check, interpreter lock, block size.

Imported only by the Triton modules (``*_triton.py``), themselves imported lazily by
:mod:`lightning_gc.kernels`, so CPU users never pay Triton's import or compile cost. Launches go
through :func:`launch`, which :func:`intercepted` can redirect (:mod:`.aot` records launches so).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl

from lightning_gc.kernels.dispatch import interpreting

BLOCK = 1024
"""Elements per program of the elementwise and scatter kernels."""


@triton.jit
def program_block(numel, BLOCK: tl.constexpr):
    """This program's block of a flat run of ``numel`` items: ``(base, offsets, inside)``, where
    ``base = program_id * BLOCK`` is int64, ``offsets = arange(BLOCK)`` int32 relative to it, and
    ``inside`` masks ``base + offsets < numel``.

    ``program_id`` is int32, and ``program_id * BLOCK`` in int32 wraps negative past 2**31 items (one
    8.6 GB fp32 tensor, or a DDP bucket holding one), which a mask ``offsets < numel`` lets through.
    Kernels add ``base`` to their pointers once instead, so the per-element index math stays 32-bit.
    (Kernels over samples, segments or output slots, all far fewer, index in int32 directly.)
    """
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = tl.arange(0, BLOCK)
    return base, offsets, offsets < items_left(numel, base, BLOCK)


@triton.jit
def items_left(count, first, CAP: tl.constexpr):
    """``count - first`` capped at ``CAP``, as int32: the bound of a mask on int32 offsets relative
    to ``first`` (an int64 position)."""
    return tl.minimum(count - first, CAP).to(tl.int32)


_INTERPRETER_LOCK = threading.Lock()
_interceptor: Callable[..., None] | None = None


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch ``kernel``; serialised under TRITON_INTERPRET=1, whose interpreter keeps global grid
    state (DDP runs hooks and communication callbacks on different threads). The kernels index
    their tensors as flat arrays, so a strided view would be read or written wrongly: refused."""
    if _interceptor is not None:
        _interceptor(kernel, grid, *args, **meta)
        return
    strided = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.is_contiguous()]
    if strided:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        raise ValueError(f"{name}: tensor arguments {strided} are not contiguous")
    if interpreting():
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


@contextmanager
def intercepted(instead: Callable[..., None]) -> Iterator[None]:
    """Within the block, :func:`launch` calls ``instead(kernel, grid, *args, **meta)`` and launches
    nothing (not thread-safe: for :mod:`.aot`, which runs the wrappers on made-up data)."""
    global _interceptor
    previous, _interceptor = _interceptor, instead
    try:
        yield
    finally:
        _interceptor = previous
