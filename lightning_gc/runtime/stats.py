"""Per-step communication statistics, accumulated inside the hook and logged by the strategy.

The hook may run on DDP's autograd threads, where logging is unsafe, so it only adds numbers
here; the strategy turns them into ``gc/*`` metrics after the optimizer step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CompressionStats:
    """Totals over the buckets of one synchronising backward pass, for one rank.

    ``bytes_sent`` counts every byte this rank hands to a collective (values, indices, padding);
    ``dense_bytes`` is what plain DDP would have handed over for the same buckets.
    ``compress_seconds`` is the host time of the codec's own work (screen, compensate, encode,
    commit, decode); ``wait_seconds`` the host time the hook spent blocked on collectives: earlier
    rounds, merges, a node's reduction, the previous step's delayed exchange. Neither counts DDP's
    own wait, after backward, for the futures the hook returned.
    """

    bytes_sent: int = 0
    dense_bytes: int = 0
    elements_sent: int = 0
    elements_total: int = 0
    compress_seconds: float = 0.0
    wait_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self,
        *,
        bytes_sent: int = 0,
        dense_bytes: int = 0,
        elements_sent: int = 0,
        elements_total: int = 0,
        seconds: float = 0.0,
        waited: float = 0.0,
    ) -> None:
        with self._lock:  # decode callbacks can run on a communication thread
            self.bytes_sent += bytes_sent
            self.dense_bytes += dense_bytes
            self.elements_sent += elements_sent
            self.elements_total += elements_total
            self.compress_seconds += seconds
            self.wait_seconds += waited

    def pop_metrics(self) -> dict[str, float] | None:
        """The ``gc/*`` metrics since the last call (``None`` if no bucket was seen), then reset."""
        with self._lock:
            if self.elements_total == 0:
                return None
            metrics = {
                "gc/bytes_sent": float(self.bytes_sent),
                "gc/dense_bytes": float(self.dense_bytes),
                "gc/wire_ratio": self.dense_bytes / max(self.bytes_sent, 1),
                "gc/density": self.elements_sent / self.elements_total,
                "gc/compress_s": self.compress_seconds,
                "gc/wait_s": self.wait_seconds,
            }
            self.bytes_sent = self.dense_bytes = self.elements_sent = self.elements_total = 0
            self.compress_seconds = self.wait_seconds = 0.0
            return metrics
