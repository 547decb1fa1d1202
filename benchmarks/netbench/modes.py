"""How gradients are exchanged in each benchmark mode, as a Lightning strategy.

* ``ddp`` -- plain DDP all-reduce (torch's C++ reducer);
* ``noop`` -- DDP with a comm hook that exchanges nothing: the floor, everything but the exchange;
* ``torch_fp16`` -- torch's ``fp16_compress_hook``;
* ``torch_powersgd1`` / ``torch_powersgd4`` -- torch's ``powerSGD_hook`` at rank 1 / 4, with ONE
  DDP bucket (``bucket_cap_mb=1024``): torch's hook chains its all-reduces from future callbacks
  and crashes on gloo with more than one bucket (DESIGN.md §4);
* ``gc_<name>`` -- ``lightning_gc`` with compressor ``<name>``, any registered compressor
  (``gc_dgc`` is ``DGCStrategy(compress_ratio=0.001)`` with momentum correction);
* ``gc_dgc_compact`` -- the same with the compact wire: Elias--Fano indices, bfloat16 values and
  bfloat16 dense tensors (the ResNet-50 recipe's settings);
* ``<gc mode>_2p`` / ``<gc mode>_gtopk`` -- a ``gc_*`` mode with ``exchange="two_phase"`` (the
  quantisers' compressed all-reduce) / ``exchange="global_topk"`` (topk and DGC);
* ``<gc mode>_delay1`` -- any ``gc_*`` mode with ``delay=1`` (:mod:`lightning_gc.exchanges.delay`): each
  step applies the previous step's average and its own exchange overlaps the next step;
* ``<gc mode>_node`` -- any ``gc_*`` mode with ``hierarchy="node"`` (:mod:`lightning_gc.exchanges.hierarchy`):
  dense within a node, compressed across nodes (with ``--devices-per-node`` > 1);
  ``<gc mode>_delay1_node`` both; ``<gc mode>_nodesparse`` -- ``hierarchy="node_sparse"``
  (:mod:`lightning_gc.exchanges.hierarchy_sparse`, DGC and top-k): global top-k within a node, the node's
  pairs gathered across nodes;
* ``ideal`` -- one process, no distributed strategy at all (handled by the launcher).
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_gc import DGCStrategy, GradientCompressionStrategy, available
from lightning_gc.compressors.chunks import two_phase_compressors

IDEAL = "ideal"
TORCH_MODES = ("ddp", "noop", "torch_fp16", "torch_powersgd1", "torch_powersgd4")
DGC_RATIO = 0.001
DGC_MODES: dict[str, dict[str, Any]] = {
    "gc_dgc": {"compress_ratio": DGC_RATIO},
    "gc_dgc_compact": {
        "compress_ratio": DGC_RATIO,
        "index_encoding": "elias_fano",
        "value_dtype": "bfloat16",
        "dense_dtype": "bfloat16",
    },
}
"""``DGCStrategy`` / ``DGCCompressor`` arguments of the DGC modes."""


DELAYED = "_delay1"
"""Suffix of a ``gc_*`` mode run with ``delay=1``."""


HIERARCHIES = {"_node": "node", "_nodesparse": "node_sparse"}
"""Suffixes of a ``gc_*`` mode run with a two-level ``hierarchy``."""


EXCHANGE_SUFFIXES = {"_2p": "two_phase", "_gtopk": "global_topk"}
"""Suffixes of a ``gc_*`` mode run with another ``exchange`` than the gather."""


def split_exchange(mode: str) -> tuple[str, str | None]:
    """``("gc_onebit", "two_phase")`` for ``"gc_onebit_2p"``; ``(mode, None)`` without such a suffix."""
    for suffix, exchange in EXCHANGE_SUFFIXES.items():
        if mode.startswith("gc_") and mode.endswith(suffix):
            return mode.removesuffix(suffix), exchange
    return mode, None


def split_mode(mode: str) -> tuple[str, str | None, int, str]:
    """A ``gc_*`` mode's base, exchange, delay and hierarchy, its suffixes read in the order
    ``<base>[_2p|_gtopk][_delay1][_node]``."""
    base, hierarchy = split_hierarchy(mode)
    base, delay = split_delay(base)
    base, exchange = split_exchange(base)
    return base, exchange, delay, hierarchy


def split_delay(mode: str) -> tuple[str, int]:
    """``("gc_fp16", 1)`` for ``"gc_fp16_delay1"``; ``(mode, 0)`` for any other mode."""
    if mode.startswith("gc_") and mode.endswith(DELAYED):
        return mode.removesuffix(DELAYED), 1
    return mode, 0


def split_hierarchy(mode: str) -> tuple[str, str]:
    """``("gc_dgc", "node")`` for ``"gc_dgc_node"``, ``("gc_dgc", "node_sparse")`` for
    ``"gc_dgc_nodesparse"``; ``(mode, "flat")`` for any other mode."""
    for suffix, hierarchy in HIERARCHIES.items():
        if mode.startswith("gc_") and mode.endswith(suffix):
            return mode.removesuffix(suffix), hierarchy
    return mode, "flat"


def all_modes() -> list[str]:
    """Every mode, references first, then torch's hooks, then ours (one per registered compressor,
    then each of those with ``delay=1``, then the DGC modes with each two-level ``hierarchy``,
    without and with ``delay=1``, then the quantisers two-phase and DGC by global top-k)."""
    ours = [*DGC_MODES, *(mode for mode in (f"gc_{name}" for name in available()) if mode not in DGC_MODES)]
    two_level = [m + delay + level for level in HIERARCHIES for delay in ("", DELAYED) for m in DGC_MODES]
    exchanges = [f"gc_{name}_2p" for name in two_phase_compressors()] + [m + "_gtopk" for m in DGC_MODES]
    return [IDEAL, *TORCH_MODES, *ours, *(mode + DELAYED for mode in ours), *two_level, *exchanges]


class HookedDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers its comm hook on every device (Lightning: CUDA only)."""

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            assert self.model is not None
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def noop_hook(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Exchange nothing: each rank keeps its own gradient."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def make_strategy(mode: str) -> Strategy:
    """The Lightning strategy of ``mode`` (gloo backend)."""
    common = {"process_group_backend": "gloo"}
    if mode == "ddp":
        return DDPStrategy(**common)
    if mode == "noop":
        return HookedDDPStrategy(ddp_comm_hook=noop_hook, **common)
    if mode == "torch_fp16":
        return HookedDDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, **common)
    if mode.startswith("torch_powersgd"):
        rank = int(mode.removeprefix("torch_powersgd"))
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        return HookedDDPStrategy(
            ddp_comm_state=state, ddp_comm_hook=powersgd.powerSGD_hook, bucket_cap_mb=1024, **common
        )
    base, exchange, delay, hierarchy = split_mode(mode)
    ours = {"delay": delay, "hierarchy": hierarchy, **({} if exchange is None else {"exchange": exchange}), **common}
    if base in DGC_MODES:
        return DGCStrategy(**DGC_MODES[base], **ours)
    if base.startswith("gc_") and base.removeprefix("gc_") in available():
        return GradientCompressionStrategy(base.removeprefix("gc_"), **ours)
    raise ValueError(f"unknown mode {mode!r}; modes are {all_modes()}")
