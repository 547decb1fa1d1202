"""The per-run choices of the comm hook, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gc.common.validation import check_int
from lightning_gc.runtime.policy import CompressionPolicy


@dataclass(frozen=True)
class HookOptions:
    """What :class:`~lightning_gc.runtime.hook.CompressionHookState` does besides its codec and
    memory (the session derives it from :class:`~lightning_gc.runtime.settings.CompressionSettings`
    and the DDP module).

    Attributes:
        min_wire_ratio: buckets on which the compressor would not reach this wire ratio (dense
            bytes / bytes sent) are sent exactly through one all-reduce instead. The decision
            depends on the layout and the compressor's settings only, so every rank agrees.
        pays: optional further rule ``pays(compressor, layout, element_size) -> bool``; buckets
            where it is false are sent exactly (e.g. :class:`lightning_gc.runtime.selective.CompressWhenFaster`).
            It must decide the same on every rank.
        nonfinite: what a NaN/Inf in a local gradient does, ``"raise"`` or ``"skip"`` (see
            :mod:`lightning_gc.core.guard`); :meth:`settle_step` ends each step.
        find_unused_parameters: the DDP setting of the same name. Then a parameter without a
            gradient on this rank may still have one on another: each bucket first all-reduces
            which of its parameters got a gradient (a few bytes). One unused on every rank keeps
            its residual and momentum untouched and sends nothing (DDP leaves its ``grad`` alone);
            one unused here only enters memory with a zero local gradient, as DDP averages a zero
            from this rank into its gradient.
        delay: hand DDP the average of the exchange launched ``delay`` steps earlier and let this
            step's exchange run during the next step's compute (:mod:`lightning_gc.exchanges.delay`); 0:
            every step waits for its own exchange.
        local_update: with ``delay``, apply this rank's own contribution at once and swap it for
            the average when that arrives (OD-SGD).
        sync_warmup_steps: with ``delay``, the first steps are synchronous.
        defer_rounds: a multi-round compressor's earlier round (the two-phase exchange's
            all-to-all, PowerSGD's first all-reduce) is waited for at the next bucket's hook, after
            that bucket's first round is launched, instead of at its own, so it travels while
            backward computes and the next bucket encodes (flat exchange, without
            ``local_update``; :mod:`lightning_gc.exchanges.pipeline`). The result is the same bit for bit.

    """

    min_wire_ratio: float = 1.0
    pays: CompressionPolicy | None = None
    nonfinite: str = "raise"
    find_unused_parameters: bool = False
    delay: int = 0
    local_update: bool = False
    sync_warmup_steps: int = 0
    defer_rounds: bool = True

    def __post_init__(self) -> None:
        """The checks the hook needs itself; the front ends validated every setting already
        (:class:`~lightning_gc.runtime.settings.CompressionSettings`)."""
        check_int("delay", self.delay, 0)
        check_int("sync_warmup_steps", self.sync_warmup_steps, 0)
        if self.local_update and not self.delay:
            raise ValueError("`local_update=True` needs `delay` >= 1, got delay=0")


DEFAULT_OPTIONS = HookOptions()
"""Every option at its default (frozen, so one instance serves every hook state)."""
