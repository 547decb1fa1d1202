"""The outer loop's predicted step time and link use: ``H`` inner steps of pure compute, then one
compressed sync of the pseudo-gradient (:class:`~lightning_gc.runtime.outer.OuterLoop`).

Notation as in :mod:`lightning_gc.perfmodel` and :mod:`lightning_gc.perfmodel.step`, plus ``H``
(``sync_every``, as in DiLoCo; the host's bandwidth enters here only through ``T_host``), ``P``
(``fragments``) and ``tau`` (``sync_delay``). The model is cut into ``P`` fragments of ``M/P``
bytes each (:mod:`lightning_gc.runtime.outer_fragments` balances them by elements, on tensor
boundaries), each synced once every ``H`` inner steps at staggered offsets (``H/P`` steps apart), so
a sync moves ``1/P`` of the pseudo-gradient. One fragment's sync is one flat tensor through the
same pipeline as a DDP bucket (:class:`~lightning_gc.exchanges.averager.CompressedAverager`): its
:class:`~lightning_gc.perfmodel.CodecCost` ``c_f`` (bytes from the codec's wire format, seconds from
calibration) gives ``T_comm,f``, ``T_host,f`` and ``T_enc,f + T_dec,f`` with one collective
round. Its exchange is launched and waited for ``tau`` inner steps later, so ``tau C`` of compute
runs beside it; encode, decode and the transport's host time run on the compute core and are never
hidden::

    exposed_f = max(0, T_comm,f - T_host,f - tau C)
    period    = H C + P (T_enc,f + T_dec,f + T_host,f + exposed_f)      (H inner steps)
    step      = period / H
    link use  = P * wire_f / B / period       wire_f: bytes one rank sends per fragment sync
                                              (CodecCost.wire_bytes: lightning_gc.exchanges.traffic)
    bytes per inner step = P * m_f / H        m_f: the fragment's encoded payload (CodecCost.bytes_sent)
    speedup   = step(dense DDP, per step) / step

``tau < H/P`` (``tau P < H``, :mod:`lightning_gc.common.outer_schedule`): a fragment's exchange is
waited for at the latest at the step the next fragment launches, and ``link use <= 1``
(``P wire_f / B <= P T_comm,f < period``). Exchanges can still share the link: where ``tau`` equals
the gap to the next launch (``floor(H/P)``), that launch comes first within the step, so the next
exchange starts while the exposed part of this one (``exposed_f > 0``) still runs; at most two are
in flight at once. The model times each exchange as if it had the link alone, so it is exact when
``exposed_f = 0`` (all of ``T_comm,f`` hidden, the usual aim of ``tau``) or ``tau < floor(H/P)``,
and optimistic by up to the overlapped part of ``exposed_f`` otherwise.

Check: ``H = 1``, ``P = 1``, ``tau = 0`` and the identity codec at no codec cost give
``step = C + T_ar(M)``, the per-step dense prediction with no overlap (``f = 0``): the outer loop
syncs after the inner optimizer step, where DDP overlaps its all-reduce with backward.

Left out, being small beside ``H C``: ``delta = theta_g - theta_r`` and the outer SGD step (a few
passes over the fragment, per sync), the exact all-reduce of floating-point buffers (BatchNorm
statistics), and the final sync at the end of a fit whose step count is not a multiple of ``H``.
``mix`` (the lerp after a fragment lands) changes no time worth counting.

The outer loop changes the optimisation (``H`` local steps, then an outer step on the averaged,
compressed pseudo-gradient): it is not synchronous SGD, and a prediction says nothing about the
accuracy it reaches; the per-step modes keep synchronous SGD's maths (up to compression).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gc.common.markdown import markdown_table
from lightning_gc.common.outer_schedule import check_sync_delay
from lightning_gc.common.validation import check_int
from lightning_gc.perfmodel import DENSE, CodecCost, Network, exchange_cost_s
from lightning_gc.perfmodel.step import Prediction, Workload, predict


@dataclass(frozen=True)
class OuterSchedule:
    """When the outer loop syncs.

    Attributes:
        sync_every: inner steps ``H`` between two syncs of a fragment, >= 1.
        fragments: fragments ``P`` the model is synced in, staggered over the ``H`` steps, >= 1.
        sync_delay: inner steps ``tau`` a fragment's exchange overlaps before it is waited for,
            >= 0 and below ``H / P``.
    """

    sync_every: int
    fragments: int = 1
    sync_delay: int = 0

    def __post_init__(self) -> None:
        check_int("sync_every", self.sync_every, 1)
        check_int("fragments", self.fragments, 1)
        check_int("sync_delay", self.sync_delay, 0)
        check_sync_delay(self.sync_every, self.fragments, self.sync_delay)

    def fragment_numel(self, numel: int) -> int:
        """Elements of one fragment of a ``numel``-element model: ``ceil(numel / P)`` (the
        largest, when they differ by one)."""
        return math.ceil(check_int("numel", numel, 1) / self.fragments)


@dataclass(frozen=True)
class OuterPrediction:
    """Predicted inner step of one outer-loop scheme (module docstring for the maths).

    Attributes:
        name: the scheme (an outer-loop preset's name).
        schedule: its ``H``, ``P`` and ``tau``.
        comm_s: ``T_comm,f``, one fragment's collectives.
        codec_s: ``T_enc,f + T_dec,f`` of one fragment.
        host_s: ``T_host,f``, one fragment's transport time on the compute core.
        exposed_s: ``max(0, T_comm,f - T_host,f - tau C)``, what compute does not hide, per fragment.
        step_s: time per inner step, ``period / H``.
        link_use: fraction of the time the link carries this rank's bytes, ``P wire_f / B / period``.
        speedup: dense DDP's per-step time / ``step_s``.
        bytes_sent: encoded payload bytes of one fragment's sync, per rank.
        bytes_per_step: ``P bytes_sent / H``, per rank and inner step.
        wire_ratio: dense DDP's bytes per step ``M`` / ``bytes_per_step``.
    """

    name: str
    schedule: OuterSchedule
    comm_s: float
    codec_s: float
    host_s: float
    exposed_s: float
    step_s: float
    link_use: float
    speedup: float
    bytes_sent: int
    bytes_per_step: float
    wire_ratio: float


def predict_outer(
    fragment: CodecCost, schedule: OuterSchedule, workload: Workload, network: Network
) -> OuterPrediction:
    """The outer loop syncing ``fragment`` (one fragment's cost) on ``schedule``, named as
    ``fragment``; ``workload.compute_s`` is ``C`` of one inner step, and dense DDP per step on
    ``workload`` (its overlap, rounds and delay) is the reference of ``speedup``."""
    hidden = schedule.sync_delay * workload.compute_s
    t_comm, t_host, exposed = exchange_cost_s(fragment, network, hidden, rounds=1)
    codec = fragment.encode_s + fragment.decode_s
    p, h = schedule.fragments, schedule.sync_every
    period = h * workload.compute_s + p * (codec + t_host + exposed)
    per_step = fragment.bytes_sent * p / h
    dense_step = predict(workload, network, [])[0].step_s
    return OuterPrediction(
        name=fragment.name,
        schedule=schedule,
        comm_s=t_comm,
        codec_s=codec,
        host_s=t_host,
        exposed_s=exposed,
        step_s=period / h,
        link_use=p * fragment.wire_bytes(network.world_size) / network.bandwidth / period if period > 0 else 0.0,
        speedup=dense_step * h / period if period > 0 else 1.0,
        bytes_sent=fragment.bytes_sent,
        bytes_per_step=per_step,
        wire_ratio=workload.dense_bytes / per_step if per_step else math.inf,
    )


def format_outer_table(predictions: Sequence[OuterPrediction]) -> str:
    """Markdown table of outer-loop predictions (times of one fragment's sync, and per inner step)."""
    header = (
        "outer loop",
        "sync_every",
        "fragments",
        "sync_delay",
        "MB per sync",
        "MB per step",
        "wire ratio",
        "sync comm (ms)",
        "encode+decode (ms)",
        "host (ms)",
        "exposed (ms)",
        "step (ms)",
        "link use",
        "speedup",
    )
    return markdown_table(
        header,
        (
            (
                o.name,
                o.schedule.sync_every,
                o.schedule.fragments,
                o.schedule.sync_delay,
                f"{o.bytes_sent / 1e6:.3f}",
                f"{o.bytes_per_step / 1e6:.4f}",
                f"{o.wire_ratio:.0f}",
                f"{o.comm_s * 1e3:.1f}",
                f"{o.codec_s * 1e3:.1f}",
                f"{o.host_s * 1e3:.1f}",
                f"{o.exposed_s * 1e3:.1f}",
                f"{o.step_s * 1e3:.1f}",
                f"{o.link_use:.1%}",
                f"{o.speedup:.2f}",
            )
            for o in predictions
        ),
    )


def recommendation(per_step: Prediction, outer: Sequence[OuterPrediction]) -> str | None:
    """The ``use:`` line when an outer-loop scheme is strictly faster than ``per_step`` (the best
    per-step scheme, dense included), saying that it changes the optimisation; ``None`` otherwise."""
    if not outer:
        return None
    fastest = min(outer, key=lambda o: o.step_s)
    if fastest.step_s >= per_step.step_s:
        return None
    s = fastest.schedule
    beside = (
        "" if per_step.name == DENSE else f", {per_step.step_s / fastest.step_s:.2f}x over {per_step.name} per step"
    )
    return (
        f"use: {fastest.name} outer loop, sync_every={s.sync_every}, fragments={s.fragments}, "
        f"sync_delay={s.sync_delay} (expected speedup {fastest.speedup:.2f}x over dense all-reduce{beside}). "
        "It changes the optimisation: "
        f"{s.sync_every} local steps, then an outer step on the averaged compressed pseudo-gradient, not "
        "synchronous SGD's maths; check the accuracy it reaches"
    )
