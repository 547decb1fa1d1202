"""Seconds per phase of one flat tensor's step through the pipeline, without device syncs in the
hook (host time) and with them for calibration and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

EXCHANGE = "exchange"
"""The phase of waiting for an earlier round's collectives: not the codec's own work."""
ENCODE_SIDE = ("screen", "compensate", "encode", "commit")
"""The phases before the last round's launch that are the codec's work on this rank."""
COMMIT_AFTER_DECODE = "commit after decode"
DECODE_SIDE = ("decode", COMMIT_AFTER_DECODE)
"""The phases after the exchange completed."""


@dataclass
class Timeline:
    """Seconds per phase of one bucket, in the order the phases ran.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each reading, so that asynchronous
    device work is charged to the phase that launched it; the hook passes none (no host syncs in
    the hot path) and so measures host time.
    """

    sync: Callable[[], None] | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)
    _last: float = 0.0

    def start(self) -> None:
        """Start (or restart, e.g. when decode begins on another thread) the clock."""
        if self.sync is not None:
            self.sync()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the last reading to ``phase`` (added to the last entry when that
        is the same phase: a deferred round's launch and its wait are one exchange)."""
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        if self.phases and self.phases[-1][0] == phase:
            self.phases[-1] = (phase, self.phases[-1][1] + now - self._last)
        else:
            self.phases.append((phase, now - self._last))
        self._last = now

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Charge the time spent inside to :data:`EXCHANGE`, outside the clock's run: for a wait on
        collectives between phases (a node's reduction, a two-level bucket's cross-node exchange).
        Phases recorded meanwhile (a decode callback on the backend's thread) keep their own time."""
        if self.sync is not None:
            self.sync()
        began, recorded = time.perf_counter(), self._total()
        yield
        if self.sync is not None:
            self.sync()
        waited = time.perf_counter() - began - (self._total() - recorded)
        self.phases.append((EXCHANGE, max(0.0, waited)))

    def _total(self) -> float:
        return sum(s for _, s in self.phases)

    def seconds(self, *phases: str) -> float:
        """Total seconds of ``phases`` (all phases but :data:`EXCHANGE` waits when none are named)."""
        return sum(s for name, s in self.phases if (name in phases if phases else name != EXCHANGE))
