"""How long the Adam hand-over's phases are: the dense warm-up resolved from the run's length
(``adam_warmup_steps="auto"``), and the density floor that lets every element leave several times
in a short compressed phase. Both are set when a fit starts (:meth:`CompressionSession.start_fit
<lightning_gc.runtime.session.CompressionSession.start_fit>`), only where the Adam hand-over runs
(``torch.optim.Adam``/``AdamW`` with momentum correction): an SGD run never needs its length.

**Warm-up.** ``"auto"`` is ``max(1, round(f N))`` of the run's ``N`` optimizer steps, ``f`` =
``adam_warmup_fraction`` (0.2: 1-bit Adam freezes after 15-25 % of training). ``N`` is what the
front end knows when the fit starts: the Trainer's ``estimated_stepping_batches``, the
``total_steps`` given to ``attach`` or to Fabric's strategy, counted from step 0 (a resumed run's
too). An unknown ``N`` (a Trainer with ``max_steps=-1`` and ``max_epochs=-1``, or an iterable
dataset without a length and no ``max_steps``; ``attach`` without ``total_steps``) is refused in
one line rather than guessed: any fixed guess is the whole of a short run (nothing compressed: a
fixed 1,000 did that to a 600-step fine-tune) or a sliver of a long one. A fixed
``adam_warmup_steps >= N`` is allowed (plain Adam throughout) with one warning naming both numbers.
Checkpoints record the resolved warm-up, and a resumed ``"auto"`` run keeps it whatever its own
``N``: its memory holds the state of that freeze.

**Density floor.** With ``r`` = ``compress_ratio``, a sparsifier sends ``r n`` of a tensor's ``n``
elements per step, so over the ``T = N - W`` compressed steps (``W`` the warm-up) it makes
``r T n`` sends: on average each element leaves ``r T`` times (random-k exactly; top-k favours
large elements, so small ones leave less). Between two sends an element's Adam steps wait in the
memory for about ``1 / r`` steps, and what is still there when training stops is never applied:
with sends spread over the phase, about half an interval, ``1 / (2 r T)`` of the phase's update.
At 0.1 % and 480 compressed steps (a 600-step fine-tune) ``r T = 0.48``: most elements never
leave after the freeze, which cost DGC +24 % perplexity where onebit, which moves every element
every step, lost 1.7 %. Asking every element to leave at least ``c`` times (``c`` =
``adam_min_sends``, default 8) gives the density after the freeze::

    rho = max(r, min(1, c / T))

which leaves about ``1 / (2c)`` of the phase's update unapplied at the end (6 % at ``c = 8``) and
delays an element's steps by about ``T / (2c)`` on average. It equals ``r`` once ``T >= c / r``
(8,000 compressed steps at 0.1 %, a 10,000-step run frozen at 20 %), so ``compress_ratio`` stays
the long-run density. ``rho`` is constant over the phase, computed once from the planned ``T``: a
density decaying after the freeze would starve the end of the run, whose residual is never
applied, and one rising as the steps left shrink would spend most where it helps least. It is a
function of ``(N, W, r, c)`` alone, the same on every rank and again after a resume.

Cost: a sent element costs about two elements of dense traffic (index and value at 32 bits), so
over the phase the floor adds about ``2 (c - r T)`` dense steps' worth of bytes, at most ``2c`` =
16, next to the ``W`` dense steps of the warm-up itself (120 of a 600-step run: about +12 % bytes
over the run, 4.4x instead of 4.9x; 400 of 2,000: +3 %). Those bytes are measured like any others: ``gc/bytes_sent``,
``gc/wire_ratio``, ``gc/density`` and the run's ``totals`` count them, and ``gc/density_floor``
names the floor on the steps it is in force.

Between steps the compressor shows the ratio its user set (``compress_ratio``, or a
:class:`~lightning_gc.SparsityWarmup` stage, which the floor never lowers): :class:`RatioFloor`
raises it for each step's exchange only and gives it back after the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_gc.common.log import notify_on_rank_zero, warn_on_rank_zero
from lightning_gc.compressors.base import AdjustableRatio, Compressor

AUTO = "auto"
"""``adam_warmup_steps="auto"``: a fraction of the run's optimizer steps (module docstring)."""

DEFAULT_MIN_SENDS = 8.0
"""``adam_min_sends``' default: every element leaves about 8 times after the freeze."""

RunLength = int | float | None | Callable[[], int | float | None]
"""A run's optimizer steps as a front end gives them: a number (``inf`` or below 1: unknown),
``None`` (unknown), or a function returning one, asked only where the Adam hand-over needs it."""


def check_warmup_steps(value: Any) -> int | str:
    """``value`` if it is ``"auto"`` or an integer >= 1 (the freeze needs a second moment)."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`adam_warmup_steps` must be 'auto' or an integer >= 1, got {value!r}")
    return value


def known_length(total: RunLength) -> int | None:
    """``total`` optimizer steps as an integer, or ``None`` where unknown (``None``, ``inf``, or
    Lightning's ``-1``); a function is called first."""
    value = total() if callable(total) else total
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value >= 1 else None
    if not isinstance(value, int):
        raise ValueError(f"`total_steps` must be a number of optimizer steps, got {value!r}")
    return value if value >= 1 else None  # Lightning's -1: unknown


def auto_warmup_steps(total_steps: int, fraction: float) -> int:
    """``"auto"``'s warm-up: ``max(1, round(fraction * total_steps))``."""
    return max(1, round(fraction * total_steps))


def density_floor(compress_ratio: float, compressed_steps: int | None, min_sends: float) -> float:
    """The density after the freeze: ``max(r, min(1, c / T))`` (module docstring); ``r`` itself
    when ``c`` is 0 or ``T`` is unknown or not positive (nothing is compressed)."""
    if not min_sends or compressed_steps is None or compressed_steps <= 0:
        return compress_ratio
    return max(compress_ratio, min(1.0, min_sends / compressed_steps))


@dataclass(frozen=True)
class AdamPlan:
    """A fit's Adam hand-over: ``warmup_steps`` dense steps of the run's ``total_steps`` (``None``:
    unknown), and where they came from (``"auto"``, ``"fixed"``, ``"checkpoint"``)."""

    warmup_steps: int
    total_steps: int | None
    source: str

    @property
    def compressed_steps(self) -> int | None:
        """``T``: the steps after the freeze (``None`` when the run's length is unknown)."""
        return None if self.total_steps is None else max(0, self.total_steps - self.warmup_steps)


def plan_adam(
    setting: int | str, fraction: float, total: RunLength, *, recorded: int | None, length_hint: str
) -> AdamPlan:
    """The warm-up of a fit whose Adam hand-over starts now: a fixed ``setting`` as it is; ``"auto"``
    the warm-up a checkpoint ``recorded`` or else ``fraction`` of the run's length ``total``.
    Warns once a fixed warm-up is at least the run's length.

    Raises:
        ValueError: ``"auto"`` with neither a recorded warm-up nor a known length (``length_hint``
            says how to give one).
    """
    if setting != AUTO:
        steps = int(setting)
        plan = AdamPlan(steps, known_length(total), "fixed")
        if plan.total_steps is not None and steps >= plan.total_steps:
            warn_on_rank_zero(
                f"lightning_gc: adam_warmup_steps={steps} is not below this run's {plan.total_steps} optimizer "
                "steps: the whole run is plain Adam and nothing is compressed; use adam_warmup_steps='auto' "
                f"({100 * fraction:g} % of the run's steps) or fewer steps",
                stacklevel=4,
            )
        return plan
    if recorded is not None:
        return AdamPlan(recorded, known_length(total), "checkpoint")
    length = known_length(total)
    if length is None:
        raise ValueError(
            f"adam_warmup_steps='auto' freezes Adam's variance after {100 * fraction:g} % of the run's optimizer "
            f"steps, but this run's length is unknown: {length_hint}, or set a fixed adam_warmup_steps"
        )
    return AdamPlan(auto_warmup_steps(length, fraction), length, "auto")


class RatioFloor:
    """Keeps an :class:`~lightning_gc.compressors.base.AdjustableRatio` compressor's ratio at least
    ``floor`` for the exchanges of steps ``since`` and later, and gives its own ratio back after
    each step (:meth:`release`): between steps the compressor shows the ratio its user set, which a
    :class:`~lightning_gc.SparsityWarmup` or ``gc.compress_ratio = ...`` reads and sets."""

    def __init__(self, compressor: AdjustableRatio, floor: float, since: int) -> None:
        ceiling = 1.0 if compressor.sends_all_at_one else math.nextafter(1.0, 0.0)
        self.compressor, self.floor, self.since = compressor, min(floor, ceiling), since
        self._given: float | None = None  # the user's ratio while the floor is in force

    def hold(self, step: int) -> None:
        """Before step ``step``'s backward pass (again before each accumulated micro-batch)."""
        current = self.compressor.compress_ratio
        base = self._given if self._given is not None and current == self.floor else current
        self._given = None
        if step >= self.since and base < self.floor:
            self._given = base
            self.compressor.compress_ratio = self.floor
        elif current != base:
            self.compressor.compress_ratio = base

    def release(self) -> float | None:
        """After the step: the user's ratio back; the floor, if it was in force (else ``None``)."""
        if self._given is None:
            return None
        if self.compressor.compress_ratio == self.floor:
            self.compressor.compress_ratio = self._given
        self._given = None
        return self.floor


def floor_for(compressor: Compressor, plan: AdamPlan, min_sends: float) -> RatioFloor | None:
    """The density floor of ``plan``'s compressed phase (``None`` where there is none: a compressor
    without ``compress_ratio``, ``min_sends=0``, an unknown length, or a floor at or below the
    ratio), announced with its numbers on rank zero."""
    if not isinstance(compressor, AdjustableRatio) or not min_sends:
        return None
    ratio, steps = compressor.compress_ratio, plan.compressed_steps
    if steps is None:
        notify_on_rank_zero(
            "lightning_gc: Adam hand-over: the run's length is unknown, so after the freeze every step sends "
            f"compress_ratio={ratio:g}, without the floor that lets each element leave {min_sends:g} times in a "
            "short run (give the run's length: total_steps=N to attach or Fabric's strategy)"
        )
        return None
    if steps <= 0:
        return None
    floor = density_floor(0.0, steps, min_sends)  # the ratio in force may change (SparsityWarmup): held per step
    if floor > ratio:
        notify_on_rank_zero(
            f"lightning_gc: Adam hand-over: {steps} compressed steps after the freeze at step {plan.warmup_steps}; "
            f"at compress_ratio={ratio:g} each element would leave about {ratio * steps:.2g} times, so they send "
            f"{100 * floor:.3g} % of each tensor (each element about {min_sends:g} times: adam_min_sends); "
            f"compress_ratio applies from {math.ceil(min_sends / ratio)} compressed steps on"
        )
    return RatioFloor(compressor, floor, plan.warmup_steps)
