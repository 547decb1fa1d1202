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
from lightning_gc.core.adam import ADAM_WEIGHTINGS
from lightning_gc.core.guard import NONFINITE_POLICIES
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.exchanges.hierarchy import HIERARCHIES
from lightning_gc.exchanges.hierarchy_sparse import check_sparse_hierarchy
from lightning_gc.runtime.adam_plan import AUTO, DEFAULT_MIN_SENDS, check_warmup_steps
from lightning_gc.runtime.policy import CompressionPolicy


@dataclass(frozen=True)
class CompressionSettings:
    """What a compressed run does around its compressor. Every front end takes these fields as
    keyword arguments under the same names (the Trainer strategies, Fabric, ``attach``, the Hydra
    ``strategy.*`` options).

    Invariants after construction: ``momentum`` is set only with ``momentum_correction``;
    ``local_update`` only with ``delay >= 1``; every number is in its documented range.

    Attributes:
        momentum_correction: hand the momentum (and the weight decay inside it) of every
            ``torch.optim.SGD`` param group over to the compression memory, which accumulates
            momentum-corrected updates (DGC); the optimizer then takes momentum-free steps. With
            ``torch.optim.Adam``/``AdamW``: after ``adam_warmup_steps`` the second moment freezes
            and the first moment is handed over the same way. Parameters of other optimizers (or
            SGD without momentum) use plain error feedback.
        momentum: momentum applied by the memory for parameters whose optimizer has none to hand
            over (e.g. Adam, or SGD with ``momentum=0``); ``None`` takes it from SGD only.
        momentum_masking: zero the momentum where values were sent sparsely (DGC §3.3): ``True``,
            ``False``, or ``"auto"`` (default): on with SGD's momentum (the paper's rule: a sent
            element's stale momentum would push it on after the update it already made), off under
            the Adam hand-over, whose handed-over momentum is Adam's first moment ``m``: masking it
            moves an element sent at every step by ``(1 - beta1) g / d``, a tenth of Adam's ``m / d``
            (ptb_adamw, 600 steps: +24 % perplexity over dense with masking, +7 % without; at 2,000
            steps, DGC 1 % without masking +2.2 %, 0.1 % with masking +9.6 %).
        clip_norm: local gradient clipping before accumulation: each tensor's local gradient is
            clipped to L2 norm ``clip_norm / sqrt(world_size)`` (DGC §3.2). ``None``: off.
        error_feedback: keep what was not sent (the residual) for later steps; ``None`` (default)
            turns it on for biased compressors and with momentum correction, which requires it.
        min_wire_ratio: selective compression: a bucket whose wire ratio under the compressor
            (dense bytes / bytes sent) would be below this is sent exactly by one all-reduce.
            The default 1.0 never sends more bytes than plain DDP.
        compress_when: ``None`` (default): compress every bucket that passes ``min_wire_ratio``; or
            a :class:`~lightning_gc.runtime.policy.CompressionPolicy`, e.g.
            :class:`~lightning_gc.runtime.selective.CompressWhenFaster`: compress a bucket only where the
            performance model predicts a faster step. Rank 0's policy is used on all ranks.
        log_stats: log ``gc/bytes_sent``, ``gc/dense_bytes``, ``gc/wire_ratio``, ``gc/density``
            and ``gc/compress_s`` after every optimizer step. Running sums over all steps are kept
            in :attr:`totals` either way.
        nonfinite: a NaN/Inf in a local gradient: ``"raise"`` (default) stops with
            ``FloatingPointError`` naming the parameters before anything enters memory;
            ``"skip"`` skips the step on every rank and rolls memory back. Under a mixed-precision
            grad scaler ("16-mixed") such steps are always skipped and the scaler backs off.
        verify_every_n_steps: every so many optimizer steps, compare a checksum of every
            parameter across ranks and raise naming the first that differs (``None``: only the
            setup check of configuration and model layout, which always runs).
        delay: delayed synchronisation (:mod:`lightning_gc.exchanges.delay`): each step applies the average
            of the exchange launched ``delay`` steps earlier, and its own exchange runs during the
            next step's compute. 0 (default): every step waits for its own exchange. What is still
            owed when training ends is applied then, so every rank ends with the same parameters.
        local_update: with ``delay``, apply this rank's own contribution at once and swap it for
            the average when that arrives (OD-SGD); ranks then differ by their own recent terms
            during training. Needs ``torch.optim.SGD`` (a linear update) and a compressor that
            knows what it sent before the exchange (not PowerSGD).
        sync_warmup_steps: with ``delay``, the first optimizer steps are synchronous. ``None``
            (default): as many as a :class:`~lightning_gc.SparsityWarmup` callback's stages last, so
            the delay starts at the target density, where the update is small; 0 without one.
        adam_warmup_steps: with ``torch.optim.Adam``/``AdamW`` and ``momentum_correction``, the
            optimizer steps of plain Adam (gradients averaged exactly as DDP does) before the second
            moment freezes and the first moment is compressed (:mod:`lightning_gc.core.adam`;
            1-bit Adam freezes after 15-25 % of training). ``"auto"`` (default):
            ``adam_warmup_fraction`` of the run's optimizer steps, resolved when the fit starts
            (:mod:`lightning_gc.runtime.adam_plan`) and kept by a resumed run.
        adam_warmup_fraction: with ``adam_warmup_steps="auto"``, the fraction of the run's
            optimizer steps that are plain Adam, in (0, 1); default 0.2.
        adam_min_sends: with the Adam hand-over and a compressor with a ``compress_ratio``, the
            compressed phase sends at least ``adam_min_sends / T`` of each tensor per step (``T``
            its planned steps), so that every element leaves about that many times before the run
            ends; ``compress_ratio`` once ``T >= adam_min_sends / compress_ratio``
            (:mod:`lightning_gc.runtime.adam_plan`). 0: ``compress_ratio`` throughout. Default 8.
        adam_weighting: after the freeze, how the compressed momentum weights elements against each
            other (what top-k favours): ``"step"`` (default) by each element's pending Adam step,
            ``"decrease"`` by the first-order loss decrease of applying it (the step times
            ``sqrt(d)``, ``d`` the frozen denominator), ``"gradient"`` by its gradient sum (the step
            times ``d``, SGD's ranking). What is eventually applied is the same; see
            :mod:`lightning_gc.core.adam`.
        hierarchy: ``"flat"`` (default): one compressed exchange over all ranks. ``"node"``: two
            levels (:mod:`lightning_gc.exchanges.hierarchy`): a dense sum within each node over its fast link,
            the compressed exchange across nodes with every device carrying ``1/devices`` of each
            bucket, then a dense all-gather within the node; residuals stay exact on the device that
            owns each piece. ``"node_sparse"`` (``topk``, ``dgc``): two levels with nothing dense on
            any link (:mod:`lightning_gc.exchanges.hierarchy_sparse`): global top-k within each node, the
            node's agreed pairs gathered across nodes (``1/devices`` of them per device), every rank
            keeping its whole residual; for nodes whose link is not much faster than the network.
            ``"auto"``: ``"node"`` when there is more than one node and more than one device per
            node. Not with ``local_update`` nor PowerSGD (which needs whole matrices).
    """

    momentum_correction: bool = False
    momentum: float | None = None
    momentum_masking: bool | str = AUTO
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
    adam_warmup_steps: int | str = AUTO
    adam_warmup_fraction: float = 0.2
    adam_min_sends: float = DEFAULT_MIN_SENDS
    adam_weighting: str = "step"
    hierarchy: str = "flat"

    def __post_init__(self) -> None:
        for flag in ("momentum_correction", "log_stats", "local_update"):
            check_bool(flag, getattr(self, flag))
        if self.momentum_masking != AUTO and not isinstance(self.momentum_masking, bool):
            raise ValueError(f"`momentum_masking` must be True, False or {AUTO!r}, got {self.momentum_masking!r}")
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
        check_warmup_steps(self.adam_warmup_steps)  # "auto" or >= 1: the freeze needs Adam's second moment
        check_range(
            "adam_warmup_fraction", self.adam_warmup_fraction, 0.0, 1.0, low_inclusive=False, high_inclusive=False
        )
        check_range("adam_min_sends", self.adam_min_sends, 0.0, None)
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
            momentum_masking=self.momentum_masking is not False,  # "auto": as for SGD until a fit says (masking_for)
            clip_norm=self.clip_norm,
            error_feedback=error_feedback,
        )

    def masking_for(self, adam: bool) -> bool:
        """Whether to mask the momentum in a fit whose hand-over is Adam's (``adam``) or SGD's."""
        return (not adam) if self.momentum_masking == AUTO else bool(self.momentum_masking)

    def shared(self) -> dict[str, Any]:
        """The settings outside the memory that every rank must agree on (plain data)."""
        return {
            "min_wire_ratio": self.min_wire_ratio,
            "nonfinite": self.nonfinite,
            "delay": self.delay,
            "local_update": self.local_update,
            "sync_warmup_steps": self.sync_warmup_steps,
            "adam_warmup_steps": self.adam_warmup_steps,
            "adam_warmup_fraction": self.adam_warmup_fraction,
            "adam_min_sends": self.adam_min_sends,
            "adam_weighting": self.adam_weighting,
            "hierarchy": self.hierarchy,
        }
