"""A training step's predicted time, dense and compressed, and whether compression pays.

The exchange's own costs (``T_comm``, ``T_host``, the notation) are :mod:`lightning_gc.perfmodel`'s.

Overlap: DDP launches a bucket's collective while backward still computes earlier layers. With
per-step compute time ``C`` (forward + backward + optimizer of one worker, nothing exchanged) and
``f`` the fraction of ``C`` that can run concurrently with communication, the exposed part of
the exchange is ``max(0, T_comm - f C)``. Encoding and decoding run on the worker's compute
resource inside the hook, so they are never hidden::

    step(dense)      = C + max(0, T_ar(M) - f C)
    step(compressor) = C + T_enc + T_dec + max(0, T_comm - f C)
    speedup          = step(dense) / step(compressor)

With a host-bound transport (``T_host``, the exchange's time on the compute core) every step
gains ``T_host`` and only the rest of the exchange can hide::

    step = C + T_enc + T_dec + T_host + max(0, T_comm - T_host - f C)

Delayed synchronisation (``Workload.delay >= 1``, :mod:`lightning_gc.exchanges.delay`): the exchange of
step t runs while step t+1 computes, so all of ``C`` can hide it, not only ``f C``::

    step(delayed) = C + T_enc + T_dec + T_host + max(0, T_comm - T_host - C)
                  = max(C, T_comm - T_host) + T_enc + T_dec + T_host

Compression pays exactly when ``T_enc + T_dec + T_host + max(0, T_comm - T_host - f C)`` is
below the same sum for dense DDP (``T_enc = T_dec = 0``, ``T_comm = T_ar(M)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gc.common.validation import check_int, check_range
from lightning_gc.perfmodel import DENSE, CodecCost, Network, exchange_cost_s


@dataclass(frozen=True)
class Workload:
    """One worker's training step without communication.

    Attributes:
        gradient_numel: gradient elements per worker per step.
        compute_s: forward + backward + optimizer time ``C`` of one step, nothing exchanged.
        overlap: fraction ``f`` of ``compute_s`` that can run concurrently with communication
            (part of backward), in [0, 1].
        element_size: bytes per gradient element (4 for fp32).
        rounds: collective rounds per step ``n`` (DDP buckets), >= 1.
        delay: steps between a step's exchange and its use (:mod:`lightning_gc.exchanges.delay`), >= 0.
            With a delay the exchange of step t runs while step t+1 computes: the whole of ``C``
            can hide it, ``step = max(C, T_comm - T_host) + T_enc + T_dec + T_host``.
    """

    gradient_numel: int
    compute_s: float
    overlap: float = 0.5
    element_size: int = 4
    rounds: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        check_int("gradient_numel", self.gradient_numel, 1)
        check_range("compute_s", self.compute_s, 0.0, None)
        check_range("overlap", self.overlap, 0.0, 1.0)
        check_int("element_size", self.element_size, 1)
        check_int("rounds", self.rounds, 1)
        check_int("delay", self.delay, 0)

    @property
    def dense_bytes(self) -> int:
        """``M``: bytes plain DDP all-reduces per step."""
        return self.gradient_numel * self.element_size

    @property
    def hidden_s(self) -> float:
        """Communication time the step can hide: ``f C`` (backward), or all of ``C`` with a delay."""
        return self.compute_s if self.delay else self.overlap * self.compute_s


@dataclass(frozen=True)
class Prediction:
    """Predicted step of one exchange scheme.

    Attributes:
        name: compressor name or ``"dense"``.
        comm_s: ``T_comm``, the collectives alone.
        codec_s: ``T_enc + T_dec``.
        host_s: ``T_host``, the transport's time on the compute core (0 without ``host_bandwidth``).
        exposed_s: ``max(0, T_comm - T_host - f C)``, the rest of the exchange backward cannot hide
            (a host slower than the link, ``T_host > T_comm``, makes the exchange all host time).
        step_s: ``C + codec_s + host_s + exposed_s``.
        speedup: dense step time / this step time (> 1: faster than dense).
        bytes_sent: encoded payload bytes of this rank per step (what it puts on the wire:
            :meth:`CodecCost.wire_bytes`).
        wire_ratio: dense bytes / bytes sent.
    """

    name: str
    comm_s: float
    codec_s: float
    host_s: float
    exposed_s: float
    step_s: float
    speedup: float
    bytes_sent: int
    wire_ratio: float


def predict(workload: Workload, network: Network, costs: Sequence[CodecCost]) -> list[Prediction]:
    """Predictions for dense DDP (always first) and each of ``costs``; see the module docstring."""
    dense_cost = CodecCost(DENSE, summed_bytes=workload.dense_bytes, gathered_bytes=0)  # plain DDP
    rows = []
    for cost in [dense_cost, *[c for c in costs if c.name != DENSE]]:
        t_comm, t_host, exposed = exchange_cost_s(cost, network, workload.hidden_s, workload.rounds)
        codec = cost.encode_s + cost.decode_s
        rows.append((cost, t_comm, codec, t_host, exposed, workload.compute_s + codec + t_host + exposed))
    dense_step = rows[0][5]
    return [
        Prediction(
            name=cost.name,
            comm_s=t_comm,
            codec_s=codec,
            host_s=t_host,
            exposed_s=exposed,
            step_s=step,
            speedup=dense_step / step if step > 0 else 1.0,
            bytes_sent=cost.bytes_sent,
            wire_ratio=workload.dense_bytes / cost.bytes_sent if cost.bytes_sent else math.inf,
        )
        for cost, t_comm, codec, t_host, exposed, step in rows
    ]


def best(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest scheme; dense wins ties (no compression without a predicted gain)."""
    return min(predictions, key=lambda p: (p.step_s, p.name != DENSE))


def pays(cost: CodecCost, workload: Workload, network: Network) -> bool:
    """Whether ``cost``'s scheme is predicted strictly faster than dense all-reduce."""
    dense, compressed = predict(workload, network, [cost])
    return compressed.step_s < dense.step_s
