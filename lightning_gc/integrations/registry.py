"""The strategy names, registered with Lightning's Trainer and Fabric registries."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc.integrations.dgc import DGCStrategy
from lightning_gc.integrations.fabric import register_fabric_strategies
from lightning_gc.integrations.strategy import GradientCompressionStrategy


def register_strategies() -> None:
    """Register ``"dgc_ddp"``, ``"dgc_ddp_spawn"`` and ``"<compressor>_ddp"`` with the Trainer's
    registry, and the ``"<compressor>_ddp"`` presets with Fabric's. Idempotent: Lightning's popen
    launcher re-imports the user's script."""
    GradientCompressionStrategy.register_strategies(StrategyRegistry)
    DGCStrategy.register_strategies(StrategyRegistry)
    register_fabric_strategies(FABRIC_STRATEGY_REGISTRY)
