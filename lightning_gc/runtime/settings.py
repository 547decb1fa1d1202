"""The settings of a compressed DDP run, checked once, shared by every front end.

:class:`CompressionSettings` holds what the user chose besides the compressor itself: the
compensation memory (momentum correction, masking, clipping, error feedback), which buckets are
compressed, what happens to a non-finite gradient, the cross-rank checks, and delayed
synchronisation. Every value is validated at construction, so a bad one fails where it was
written, naming the value and the valid choices. Combinations that depend on the compressor
(``local_update`` with a compressor that commits only after decoding, ``error_feedback`` left to
the compressor's bias) are settled by :meth:`CompressionSettings.memory_for` and
:meth:`CompressionSettings.check_compressor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_gc.common.validation import check_bool, check_choice, check_int, check_range
from lightning_gc.compressors.base import Compressor
from lightning_gc.core.guard import NONFINITE_POLICIES
from lightning_gc.core.handover import ADAM_WEIGHTINGS
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.exchanges.hierarchy import HIERARCHIES
from lightning_gc.exchanges.hierarchy_sparse import check_sparse_hierarchy
from lightning_gc.runtime.policy import CompressionPolicy


@dataclass(frozen=True)
class CompressionSettings:
    """What a compressed run does around its compressor (see ``GradientCompressionStrategy`` for
    the meaning of each field; the names and defaults are the strategy's arguments).

    Invariants after construction: ``momentum`` is set only with ``momentum_correction``;
    ``local_update`` only with ``delay >= 1``; every number is in its documented range.
    """

    momentum_correction: bool = False
    momentum: float | None = None
    momentum_masking: bool = True
    clip_norm: float | None = None
    error_feedback: bool | None = None
    min_wire_ratio: float = 1.0
    compress_when: CompressionPolicy | None = None
    log_stats: bool = True
    nonfinite: str = "raise"
    verify_every_n_steps: int | None = None
    delay: int = 0
    local_update: bool = False
    sync_warmup_steps: int | None = None
    adam_warmup_steps: int = 1000
    adam_weighting: str = "step"
    hierarchy: str = "flat"

    def __post_init__(self) -> None:
        for flag in ("momentum_correction", "momentum_masking", "log_stats", "local_update"):
            check_bool(flag, getattr(self, flag))
        if self.error_feedback is not None:
            check_bool("error_feedback", self.error_feedback)
        if self.momentum is not None:
            check_range("momentum", self.momentum, 0.0, 1.0, high_inclusive=False)
            if not self.momentum_correction:
                raise ValueError(
                    f"`momentum={self.momentum!r}` needs momentum_correction=True, got momentum_correction=False"
                )
        if self.clip_norm is not None:
            check_range("clip_norm", self.clip_norm, 0.0, None, low_inclusive=False)
        check_range("min_wire_ratio", self.min_wire_ratio, 0.0, None, low_inclusive=False)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.verify_every_n_steps is not None:
            check_int("verify_every_n_steps", self.verify_every_n_steps, 1)
        check_int("delay", self.delay, 0)
        if self.sync_warmup_steps is not None:
            check_int("sync_warmup_steps", self.sync_warmup_steps, 0)
        check_int("adam_warmup_steps", self.adam_warmup_steps, 1)  # Adam's second moment must exist to freeze
        check_choice("adam_weighting", self.adam_weighting, ADAM_WEIGHTINGS)
        check_choice("hierarchy", self.hierarchy, HIERARCHIES)
        if self.compress_when is not None and not callable(self.compress_when):
            raise ValueError(
                f"`compress_when` must be None or a policy called with (compressor, layout, element_size),"
                f" e.g. lightning_gc.runtime.selective.CompressWhenFaster; got {self.compress_when!r}"
            )
        if self.hierarchy != "flat" and self.local_update:
            raise ValueError(
                f"`hierarchy={self.hierarchy!r}` does not combine with local_update=True: a rank's own contribution "
                "is a piece of its node's sum, not its own gradient; use local_update=False or hierarchy='flat'"
            )
        if self.local_update and not self.delay:
            raise ValueError("`local_update=True` needs `delay` >= 1, got delay=0")
        if self.local_update and self.verify_every_n_steps:
            raise ValueError(
                f"`verify_every_n_steps={self.verify_every_n_steps}` compares the ranks' parameters, which with "
                "local_update=True differ by design (each rank holds its own latest contributions until their "
                "averages arrive); use verify_every_n_steps=None or local_update=False"
            )
        if self.momentum_correction and self.error_feedback is False:
            raise ValueError(
                "`error_feedback=False` drops what was not sent, which momentum correction needs; "
                "got momentum_correction=True"
            )

    def check_compressor(self, compressor: Compressor) -> None:
        """Raise ``ValueError`` for a setting the compressor cannot honour."""
        if self.hierarchy == "node_sparse":
            check_sparse_hierarchy(compressor)
        if self.hierarchy != "flat" and compressor.needs_whole_tensors:
            raise ValueError(
                f"`hierarchy={self.hierarchy!r}` cuts every tensor into one piece per device of a node, but "
                f"compressor {compressor.name!r} needs each tensor whole (its matrices); use hierarchy='flat'"
            )
        if self.local_update and compressor.commits_after_decode:
            raise ValueError(
                f"`local_update=True` applies this rank's own contribution before the exchange, but compressor "
                f"{compressor.name!r} knows what it sent only from the average; use local_update=False"
            )

    def memory_for(self, compressor: Compressor) -> CompensationMemory:
        """The compensation memory these settings describe; error feedback defaults to on for a
        biased compressor and with momentum correction (which needs it)."""
        error_feedback = self.error_feedback
        if error_feedback is None:
            error_feedback = compressor.biased or self.momentum_correction
        return CompensationMemory(
            momentum_correction=self.momentum_correction,
            momentum_masking=self.momentum_masking,
            clip_norm=self.clip_norm,
            error_feedback=error_feedback,
        )

    def shared(self) -> dict[str, Any]:
        """The settings outside the memory that every rank must agree on (plain data)."""
        return {
            "min_wire_ratio": self.min_wire_ratio,
            "nonfinite": self.nonfinite,
            "delay": self.delay,
            "local_update": self.local_update,
            "sync_warmup_steps": self.sync_warmup_steps,
            "adam_warmup_steps": self.adam_warmup_steps,
            "adam_weighting": self.adam_weighting,
            "hierarchy": self.hierarchy,
        }
