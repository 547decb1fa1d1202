"""Gradient compressors behind one interface (:class:`Compressor`)."""

from lightning_gc.compressors.base import Compressor, Encoded
from lightning_gc.compressors.dgc import DGCCompressor
from lightning_gc.compressors.sparse import SparseCompressor

__all__ = ["Compressor", "DGCCompressor", "Encoded", "SparseCompressor"]
