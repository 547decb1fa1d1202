"""lightning_gc: gradient compression for PyTorch Lightning's DDP.

Importing the package registers the strategy names (``"dgc_ddp"``, ``"dgc_ddp_spawn"``, and
``"<compressor>_ddp"`` for every compressor in :func:`lightning_gc.compressors.available`) with
``lightning.pytorch``'s strategy registry, so ``Trainer(strategy="dgc_ddp")`` works, and the
``"<compressor>_ddp"`` presets with Lightning Fabric's (``Fabric(strategy="dgc_ddp")``,
:mod:`lightning_gc.fabric`). A plain ``DistributedDataParallel`` loop uses :func:`attach` instead.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc.attach import AttachedCompression, attach
from lightning_gc.callbacks import PAPER_WARMUP_DENSITIES, SparsityWarmup
from lightning_gc.compressors import Compressor, DGCCompressor, available
from lightning_gc.fabric import FabricCompressionStrategy, register_fabric_strategies
from lightning_gc.strategy import DGCStrategy, GradientCompressionStrategy

__version__ = "0.1.0.dev0"

# Registration is idempotent: Lightning's popen launcher re-imports the user's script.
GradientCompressionStrategy.register_strategies(StrategyRegistry)
DGCStrategy.register_strategies(StrategyRegistry)
register_fabric_strategies(FABRIC_STRATEGY_REGISTRY)

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
