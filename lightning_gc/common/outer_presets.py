"""The outer loop's presets as plain data: one table for every layer that names them.

The front ends (:mod:`lightning_gc.integrations.outer_attach`, the Trainer strategy, Hydra) build
an :class:`~lightning_gc.runtime.outer.OuterLoop` from these settings; the performance model
(:mod:`lightning_gc.perfmodel.outer`, the ``--outer`` rows of ``python -m lightning_gc.perfmodel``)
predicts their step time. The model sits below the runtime and the front ends, so the table sits
here, in the layer every other imports, and holds only names and numbers (no torch).

Each entry's keys are outer-loop arguments (:data:`OUTER_ARGUMENTS`) or arguments of the entry's
compressor (``levels``, ``compress_ratio``); the user's arguments win over the preset's, and
:data:`STREAMING_DEFAULTS` over neither.
"""

from __future__ import annotations

from typing import Any

OUTER_PRESETS: dict[str, dict[str, Any]] = {
    "diloco": {  # DiLoCo (arXiv:2311.08105): exact average, outer Nesterov SGD; the paper syncs every 500 steps
        "sync_every": 500,
        "compressor": "none",
        "error_decay": 1.0,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "outer_nesterov": True,
    },
    # DiLoCo with 8-bit codes (INTELLECT-1-style): max-abs scaled int8 codes, one float32 scale per chunk of 512,
    # unbiased stochastic rounding (no error feedback needed); each chunk's largest value is level 127.
    # exchange "auto": two-phase (compressed all-reduce, bytes per rank flat in N) from 3 ranks.
    "diloco_int8": {
        "sync_every": 500,
        "compressor": "int8",
        "chunk_size": 512,
        "exchange": "auto",
        "error_decay": 1.0,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "outer_nesterov": True,
    },
    # SparseLoCo (arXiv:2508.15706): top-k of every 64x64 chunk, 2-bit values, 12-bit in-chunk indices
    # (lightning_gc.compressors.chunk_topk). Bytes per rank per sync, B chunks holding K = sum_b ceil(0.02 n_b)
    # sent values, D elements of 1-D/small tensors (float32, exact): aligned(4B) + aligned(ceil(K/4))
    # + aligned(ceil(12K/8)) + 4D, aligned(x) = x rounded up to 4; ~147.5 bytes per full chunk of
    # 4,096 values (16 KiB in float32): ~110x fewer bytes than diloco's 4 per value (tests/test_outer_bytes.py).
    "sparseloco": {
        "sync_every": 15,
        "compressor": "chunk_topk",
        "compress_ratio": 0.02,
        "error_decay": 0.95,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "outer_nesterov": False,
    },
}
"""The outer-loop presets by name: every entry is an argument of
:func:`~lightning_gc.integrations.outer_arguments.outer_arguments`, and the user's arguments win.
The compressor's own arguments (``levels``, ``compress_ratio``) apply only while the preset's
compressor is kept; another ``compressor`` brings its own defaults."""

STREAMING_DEFAULTS: dict[str, Any] = {"fragments": 1, "sync_delay": 0, "mix": 0.0}
"""Every preset's streaming settings unless given (:class:`~lightning_gc.runtime.outer.Streaming`):
one fragment, no delay, no mix: the plain DiLoCo sync."""

OUTER_ARGUMENTS = (
    "sync_every", "compressor", "error_decay", "outer_lr", "outer_momentum", "outer_nesterov",
    "fragments", "sync_delay", "mix",
)  # fmt: skip
"""The outer loop's own arguments, the same in every front end and Hydra config."""
