"""lightning_gc: gradient compression for PyTorch Lightning's DDP.

Importing the package registers the strategy names (``"dgc_ddp"``, ``"dgc_ddp_spawn"``, and
``"<compressor>_ddp"`` for every compressor in :func:`lightning_gc.compressors.available`) with
``lightning.pytorch``'s strategy registry, so ``Trainer(strategy="dgc_ddp")`` works, and the
``"<compressor>_ddp"`` presets with Lightning Fabric's (``Fabric(strategy="dgc_ddp")``,
:mod:`lightning_gc.integrations.fabric`). A plain ``DistributedDataParallel`` loop uses :func:`attach` instead.
"""

from lightning_gc.compressors import Compressor, DGCCompressor, available
from lightning_gc.integrations.attach import AttachedCompression, attach
from lightning_gc.integrations.callbacks import PAPER_WARMUP_DENSITIES, SparsityWarmup
from lightning_gc.integrations.dgc import DGCStrategy
from lightning_gc.integrations.fabric import FabricCompressionStrategy
from lightning_gc.integrations.registry import register_strategies
from lightning_gc.integrations.strategy import GradientCompressionStrategy

__version__ = "0.1.0.dev0"

register_strategies()

__all__ = [
    "PAPER_WARMUP_DENSITIES",
    "AttachedCompression",
    "attach",
    "Compressor",
    "available",
    "DGCCompressor",
    "DGCStrategy",
    "FabricCompressionStrategy",
    "GradientCompressionStrategy",
    "SparsityWarmup",
]
