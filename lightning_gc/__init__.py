"""lightning_gc: gradient compression for PyTorch Lightning's DDP.

Importing the package makes the strategy names (``"dgc_ddp"``, ``"dgc_ddp_spawn"``, and
``"<compressor>_ddp"`` for every compressor in :func:`lightning_gc.compressors.available`) known to
``lightning.pytorch``'s strategy registry, so ``Trainer(strategy="dgc_ddp")`` works, and the
``"<compressor>_ddp"`` presets to Lightning Fabric's (``Fabric(strategy="dgc_ddp")``,
:mod:`lightning_gc.integrations.fabric`). A plain ``DistributedDataParallel`` loop uses :func:`attach` instead.

Importing it imports no Lightning (nor torch): the names below load their module on first use
(PEP 562), and the strategies are registered when Lightning is imported, before or after this
package (:mod:`lightning_gc.integrations.registry`), so ``python -m lightning_gc.perfmodel`` and
:func:`attach` do not pay seconds for Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_gc.integrations.registry import register_when_lightning_loads

__version__ = "0.1.0.dev0"

__all__ = [
    "PAPER_WARMUP_DENSITIES",
    "AttachedCompression",
    "attach",
    "Compressor",
    "available",
    "DGCCompressor",
    "DGCStrategy",
    "FabricCompressionStrategy",
    "FabricOuterLoopStrategy",
    "GradientCompressionStrategy",
    "OuterLoopStrategy",
    "outer_loop",
    "fault_tolerant",
    "fault_tolerant_outer",
    "SparsityWarmup",
]

_SOURCES = {
    "PAPER_WARMUP_DENSITIES": "lightning_gc.integrations.callbacks",
    "SparsityWarmup": "lightning_gc.integrations.callbacks",
    "AttachedCompression": "lightning_gc.integrations.attach",
    "attach": "lightning_gc.integrations.attach",
    "Compressor": "lightning_gc.compressors",
    "available": "lightning_gc.compressors",
    "DGCCompressor": "lightning_gc.compressors",
    "DGCStrategy": "lightning_gc.integrations.dgc",
    "FabricCompressionStrategy": "lightning_gc.integrations.fabric",
    "FabricOuterLoopStrategy": "lightning_gc.integrations.outer_fabric",
    "GradientCompressionStrategy": "lightning_gc.integrations.strategy",
    "OuterLoopStrategy": "lightning_gc.integrations.outer",
    "outer_loop": "lightning_gc.integrations.outer_attach",
    "fault_tolerant": "lightning_gc.integrations.ft",  # imports torchft (the [ft] extra) on first use
    "fault_tolerant_outer": "lightning_gc.integrations.ft_outer",
}
"""Where each public name is defined."""
_SUBPACKAGES = ("common", "kernels", "compressors", "core", "exchanges", "perfmodel", "runtime", "integrations")
"""Reachable as attributes (``lightning_gc.compressors.available()``), as when everything was imported eagerly."""

if TYPE_CHECKING:
    from lightning_gc.compressors import Compressor, DGCCompressor, available
    from lightning_gc.integrations.attach import AttachedCompression, attach
    from lightning_gc.integrations.callbacks import PAPER_WARMUP_DENSITIES, SparsityWarmup
    from lightning_gc.integrations.dgc import DGCStrategy
    from lightning_gc.integrations.fabric import FabricCompressionStrategy
    from lightning_gc.integrations.ft import fault_tolerant
    from lightning_gc.integrations.ft_outer import fault_tolerant_outer
    from lightning_gc.integrations.outer import OuterLoopStrategy
    from lightning_gc.integrations.outer_attach import outer_loop
    from lightning_gc.integrations.outer_fabric import FabricOuterLoopStrategy
    from lightning_gc.integrations.strategy import GradientCompressionStrategy


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562) and keep the name here."""
    if name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))


register_when_lightning_loads()
