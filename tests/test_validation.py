"""Bad arguments fail at construction with a ValueError naming the argument, the value and what is allowed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from lightning_gc import (
    DGCCompressor,
    DGCStrategy,
    FabricCompressionStrategy,
    GradientCompressionStrategy,
    SparsityWarmup,
)
from lightning_gc.compressors import (
    FFTCompressor,
    OneBitCompressor,
    PowerSGDCompressor,
    QSGDCompressor,
    RandomKCompressor,
    SignSGDCompressor,
    TopKCompressor,
)

CASES: list[tuple[type, dict[str, Any], str, str]] = [
    # (constructor, kwargs, argument named in the message, allowed range/choices named in the message)
    (DGCStrategy, {"compress_ratio": 0.0}, "compress_ratio", "(0, 1]"),
    (DGCStrategy, {"compress_ratio": 1.5}, "compress_ratio", "(0, 1]"),
    (DGCStrategy, {"compress_ratio": -0.1}, "compress_ratio", "(0, 1]"),
    (DGCStrategy, {"compress_ratio": float("nan")}, "compress_ratio", "(0, 1]"),
    (DGCStrategy, {"compress_ratio": "0.01"}, "compress_ratio", "(0, 1]"),
    (DGCStrategy, {"momentum": -0.9}, "momentum", "[0, 1)"),
    (DGCStrategy, {"momentum": 1.0}, "momentum", "[0, 1)"),
    (DGCStrategy, {"clip_norm": 0.0}, "clip_norm", "(0, inf]"),
    (DGCStrategy, {"clip_norm": -1.0}, "clip_norm", "(0, inf]"),
    (DGCStrategy, {"value_dtype": "int8"}, "value_dtype", "['float32', 'float16', 'bfloat16']"),
    (DGCStrategy, {"index_encoding": "delta"}, "index_encoding", "['int32', 'elias_fano']"),
    (DGCStrategy, {"dense_dtype": "int8"}, "dense_dtype", "['float32', 'float16', 'bfloat16', None]"),
    (DGCStrategy, {"sample_ratio": 0.0}, "sample_ratio", "(0, 1]"),
    (DGCStrategy, {"sample_ratio": -0.01}, "sample_ratio", "(0, 1]"),
    (DGCStrategy, {"min_compress_numel": 0}, "min_compress_numel", ">= 1"),
    (DGCStrategy, {"momentum": 0.9, "momentum_correction": False}, "momentum", "momentum_correction=True"),
    (DGCStrategy, {"ddp_comm_hook": print}, "ddp_comm_hook", "own DDP comm hook"),
    (DGCStrategy, {"min_wire_ratio": 0.0}, "min_wire_ratio", "(0, inf]"),
    (DGCStrategy, {"bucket_cap": 4}, "bucket_cap", "DDP takes"),
    (DGCStrategy, {"nonfinite": "ignore"}, "nonfinite", "['raise', 'skip']"),
    (DGCStrategy, {"verify_every_n_steps": 0}, "verify_every_n_steps", ">= 1"),
    (DGCStrategy, {"timeout": -5}, "timeout", "(0, inf]"),
    (FabricCompressionStrategy, {"timeout": -1}, "timeout", "(0, inf]"),
    (FabricCompressionStrategy, {"timeout": "30"}, "timeout", "(0, inf]"),
    (GradientCompressionStrategy, {"compress_when": "yes"}, "compress_when", "CompressWhenFaster"),
    (RandomKCompressor, {"rescale": "false"}, "rescale", "True or False"),
    (GradientCompressionStrategy, {"compressor": "zstd"}, "compressor", "'powersgd'"),
    (DGCStrategy, {"momentum_masking": "no"}, "momentum_masking", "True, False or 'auto'"),
    (GradientCompressionStrategy, {"momentum_correction": 1}, "momentum_correction", "True or False"),
    (GradientCompressionStrategy, {"log_stats": "yes"}, "log_stats", "True or False"),
    (GradientCompressionStrategy, {"error_feedback": 0}, "error_feedback", "True or False"),
    (PowerSGDCompressor, {"warm_start": "false"}, "warm_start", "True or False"),
    (
        GradientCompressionStrategy,
        {"compressor": "qsgd", "error_feedback": False, "momentum_correction": True},
        "error_feedback",
        "momentum correction",
    ),
    (DGCCompressor, {"compress_ratio": 2.0}, "compress_ratio", "(0, 1]"),
    (PowerSGDCompressor, {"rank": 0}, "rank", ">= 1"),
    (PowerSGDCompressor, {"min_compression_rate": -1.0}, "min_compression_rate", "(0, inf]"),
    (PowerSGDCompressor, {"start_iter": -1}, "start_iter", ">= 0"),
    (PowerSGDCompressor, {"seed": -1}, "seed", ">= 0"),
    (FFTCompressor, {"bits": 5}, "bits", "[4, 8, 16]"),
    (FFTCompressor, {"compress_ratio": 0.0}, "compress_ratio", "(0, 1]"),
    (SignSGDCompressor, {"chunk_size": 2}, "chunk_size", ">= 8"),
    (OneBitCompressor, {"chunk_size": 0}, "chunk_size", ">= 8"),
    (TopKCompressor, {"value_dtype": "float64"}, "value_dtype", "['float32', 'float16', 'bfloat16']"),
    (TopKCompressor, {"index_encoding": "Elias-Fano"}, "index_encoding", "['int32', 'elias_fano']"),
    (TopKCompressor, {"dense_dtype": "float64"}, "dense_dtype", "['float32', 'float16', 'bfloat16', None]"),
    (DGCCompressor, {"dense_dtype": "half"}, "dense_dtype", "['float32', 'float16', 'bfloat16', None]"),
    (QSGDCompressor, {"levels": 1}, "levels", "in [2, 127]"),
    (QSGDCompressor, {"levels": 128}, "levels", "in [2, 127]"),
    (RandomKCompressor, {"compress_ratio": 1.0}, "compress_ratio", "(0, 1)"),
    (SparsityWarmup, {"densities": [0.5, 0.0]}, "densities[1]", "(0, 1]"),
    (SparsityWarmup, {"interval": "batch"}, "interval", "['epoch', 'step']"),
    (SparsityWarmup, {"interval": "step"}, "steps_per_stage", "required"),
    (SparsityWarmup, {"interval": "step", "steps_per_stage": 0}, "steps_per_stage", ">= 1"),
    (SparsityWarmup, {"steps_per_stage": 10}, "steps_per_stage", "interval='step'"),
    (SparsityWarmup, {"epochs_per_stage": 0}, "epochs_per_stage", "(0, inf]"),
    (
        SparsityWarmup,
        {"interval": "step", "steps_per_stage": 5, "epochs_per_stage": 0.5},
        "epochs_per_stage",
        "interval='epoch'",
    ),
]


def _shown_value(kwargs: dict[str, Any], argument: str) -> str | None:
    """The text under which the bad value must appear in the message (None: nothing printable)."""
    value = kwargs.get(argument.split("[")[0], next(iter(kwargs.values())))
    if callable(value):
        return None
    if isinstance(value, list):
        return repr(next(v for v in value if not 0 < v <= 1))
    return repr(value)


@pytest.mark.parametrize(("constructor", "kwargs", "argument", "allowed"), CASES, ids=lambda c: repr(c)[:40])
def test_bad_argument_is_rejected_at_construction(constructor: type, kwargs: dict, argument: str, allowed: str) -> None:
    shown = _shown_value(kwargs, argument)
    with pytest.raises(ValueError) as error:
        constructor(**kwargs)
    message = str(error.value)
    assert argument in message
    assert allowed in message
    if shown is not None:
        assert shown in message


def test_momentum_correction_turns_error_feedback_on_for_unbiased_compressors() -> None:
    """It needs error feedback (refused when set False), so by default it gets it, not silently off."""
    assert GradientCompressionStrategy("qsgd").memory.error_feedback is False  # unbiased: off by default
    assert GradientCompressionStrategy("qsgd", momentum_correction=True).memory.error_feedback is True


def test_timeouts_in_seconds_become_timedeltas_on_every_front_end() -> None:
    """Configs write seconds; torch takes a timedelta (Fabric's DDP passed an int through and
    failed at launch)."""
    for strategy in (DGCStrategy(timeout=30), FabricCompressionStrategy("dgc", timeout=30)):
        assert strategy._timeout == timedelta(seconds=30)


def test_good_arguments_are_kept() -> None:
    strategy = DGCStrategy(0.01, clip_norm=1.0, sample_ratio=0.05, value_dtype="float16", bucket_cap_mb=1)
    assert strategy.compress_ratio == 0.01
    strategy.compress_ratio = 0.25
    assert strategy.compressor.compress_ratio == 0.25
    with pytest.raises(ValueError, match="compress_ratio"):
        strategy.compress_ratio = 0
