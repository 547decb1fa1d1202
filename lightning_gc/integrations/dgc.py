"""Deep Gradient Compression as a Trainer strategy: ``"dgc_ddp"`` and ``"dgc_ddp_spawn"``."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_gc.integrations.strategy import GradientCompressionStrategy


class DGCStrategy(GradientCompressionStrategy):
    """Deep Gradient Compression over DDP (Lin et al., ICLR 2018).

    Keep a plain ``torch.optim.SGD(momentum=..., nesterov=..., weight_decay=...)``: its momentum
    and weight decay move into the compression memory (momentum correction), each large tensor
    sends exactly ``ceil(compress_ratio * numel)`` values chosen by a sampled threshold, the
    momentum is masked where values were sent, and the rest stays in the velocity for later steps.
    With ``compress_ratio=1`` training equals plain DDP with the same SGD.

    Args:
        compress_ratio: fraction of elements sent per compressed tensor, in (0, 1].
        momentum_correction: on by default (the ``"dgc"`` preset); ``momentum``,
            ``momentum_masking``, ``clip_norm``: see
            :class:`~lightning_gc.runtime.settings.CompressionSettings`.
        sample_ratio: fraction of each tensor sampled for the threshold, in (0, 1].
        min_compress_numel: tensors with fewer elements, and 1-D tensors, go dense.
        value_dtype: values on the wire, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        index_encoding: indices on the wire, ``"int32"`` or ``"elias_fano"`` (sorted,
            Elias--Fano coded: ~12 bits per index at ratio 0.001; same training result).
        dense_dtype: dtype of the tensors sent dense (1-D, small) next to compressed ones,
            ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``None`` (the gradient's); what
            rounding drops stays in the residual.
        exchange: ``"gather"`` (every rank's pairs all-gathered) or ``"global_topk"`` (ranks
            agree on ``k`` positions per tensor in ``log2 N`` pairwise merge rounds, then
            all-reduce their values: traffic per rank grows as ``log N``, not ``N``; see
            :mod:`lightning_gc.exchanges.global_topk`).
        **kwargs: :class:`GradientCompressionStrategy` / ``DDPStrategy`` arguments.
    """

    preset = "dgc"

    def __init__(self, compress_ratio: float = 0.001, **kwargs: Any) -> None:
        super().__init__("dgc", compress_ratio=compress_ratio, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"dgc_ddp"`` and ``"dgc_ddp_spawn"`` (no-op for names already present)."""
        for name, start_method in (("dgc_ddp", "popen"), ("dgc_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"Deep Gradient Compression over DDP, start_method={start_method!r}",
                    start_method=start_method,
                )
