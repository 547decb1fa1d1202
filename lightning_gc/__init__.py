"""lightning_gc: gradient compression for PyTorch Lightning's DDP.

Importing the package registers the strategy names (``"dgc_ddp"``, ``"dgc_ddp_spawn"``) with
``lightning.pytorch``'s strategy registry, so ``Trainer(strategy="dgc_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc.callbacks import PAPER_WARMUP_DENSITIES, SparsityWarmup
from lightning_gc.compressors import Compressor, DGCCompressor
from lightning_gc.strategy import DGCStrategy, GradientCompressionStrategy

__version__ = "0.1.0.dev0"

# Registration is idempotent: Lightning's popen launcher re-imports the user's script.
DGCStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "PAPER_WARMUP_DENSITIES",
    "Compressor",
    "DGCCompressor",
    "DGCStrategy",
    "GradientCompressionStrategy",
    "SparsityWarmup",
]
