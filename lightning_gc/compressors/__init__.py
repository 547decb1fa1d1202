"""Gradient compressors behind one interface (:class:`Compressor`), registered by name."""

from lightning_gc.compressors.base import Compressor, EncodeContext
from lightning_gc.compressors.chunk_topk import ChunkTopKCompressor
from lightning_gc.compressors.dense import DensePart
from lightning_gc.compressors.dgc import DGCCompressor
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.fft import FFTCompressor
from lightning_gc.compressors.powersgd import PowerSGDCompressor
from lightning_gc.compressors.quantize import (
    Int8Compressor,
    OneBitCompressor,
    QSGDCompressor,
    SignSGDCompressor,
    TernGradCompressor,
)
from lightning_gc.compressors.randomk import RandomKCompressor
from lightning_gc.compressors.registry import available, create
from lightning_gc.compressors.simple import BF16Compressor, FP16Compressor, NoCompressor, TopKCompressor
from lightning_gc.compressors.sparse import SparseCompressor

__all__ = [
    "BF16Compressor",
    "ChunkTopKCompressor",
    "Compressor",
    "DGCCompressor",
    "DensePart",
    "EncodeContext",
    "Encoded",
    "FFTCompressor",
    "FP16Compressor",
    "Int8Compressor",
    "NoCompressor",
    "OneBitCompressor",
    "Payload",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "SignSGDCompressor",
    "Sent",
    "SparseCompressor",
    "TernGradCompressor",
    "TopKCompressor",
    "available",
    "create",
]
