"""The outer loop's settings (:class:`OuterSGD`, :class:`Streaming`) and its unit of exchange, the
:class:`Fragment`: a contiguous group of a module's trainable parameters with its own ``theta_g``,
residual (a :class:`~lightning_gc.exchanges.averager.CompressedAverager`), outer SGD state and
exchange in flight.

Streaming (Streaming DiLoCo, arXiv:2501.18512), with ``P = fragments``, ``tau = sync_delay``,
``alpha = mix`` and ``s`` the inner steps done (1, 2, ...)::

    fragment p launches at the steps s with (s - offset_p) % H == 0,  offset_p = p H // P
        delta_p = theta_g[p] - theta_r[p]; its compressed average y_p goes out (not waited for)
    it lands tau inner steps later, at s + tau (the rank trains theta_r meanwhile, all of it):
        theta_g[p] <- OuterSGD_p(theta_g[p], y_p)
        theta_r[p] <- lerp(theta_g[p], theta_r[p], alpha) = theta_g[p] + alpha (theta_r[p] - theta_g[p])

so with ``alpha = 0`` the ``tau`` local steps a fragment took while its exchange was in flight are
dropped at landing (the rank restarts the fragment from ``theta_g``), with ``alpha > 0`` part of
them is kept. ``P = 1, tau = 0, alpha = 0`` is the plain DiLoCo sync. At one step, launches (in
fragment order) come before landings (in launch order): the same collectives in the same order on
every rank.

Since ``tau < H / P`` (:mod:`lightning_gc.common.outer_schedule`), a fragment lands at the latest
at the step the next fragment launches (the offsets are ``floor`` or ``ceil`` of ``H / P`` apart),
long before its own next launch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future

from lightning_gc.common.outer_schedule import check_sync_delay
from lightning_gc.common.validation import check_bool, check_int, check_range
from lightning_gc.compressors.base import Compressor
from lightning_gc.exchanges.averager import CompressedAverager


@dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer, ``torch.optim.SGD`` on ``theta_g`` with the averaged pseudo-gradient as
    its gradient: ``lr`` > 0 (``outer_lr``), ``momentum`` in [0, 1) (``outer_momentum``),
    ``nesterov`` only with momentum > 0 (``outer_nesterov``). DiLoCo's: 0.7, 0.9, Nesterov."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        check_range("outer_lr", self.lr, 0.0, None, low_inclusive=False)
        check_range("outer_momentum", self.momentum, 0.0, 1.0, high_inclusive=False)
        check_bool("outer_nesterov", self.nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError("`outer_nesterov=True` needs `outer_momentum` > 0, got 0.0; set outer_nesterov=False")

    def build(self, parameters: list[torch.Tensor]) -> torch.optim.SGD:
        return torch.optim.SGD(parameters, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)


@dataclass(frozen=True)
class Streaming:
    """Streaming settings (module docstring): ``fragments`` (P >= 1, at most the number of trainable
    parameter tensors), ``sync_delay`` (tau >= 0, below ``sync_every / fragments``), ``mix``
    (alpha in [0, 1)). The defaults (1, 0, 0.0) are the plain sync of every parameter at once."""

    fragments: int = 1
    sync_delay: int = 0
    mix: float = 0.0

    def __post_init__(self) -> None:
        check_int("fragments", self.fragments, 1)
        check_int("sync_delay", self.sync_delay, 0)
        check_range("mix", self.mix, 0.0, 1.0, high_inclusive=False)

    def check(self, sync_every: int, tensors: int | None = None) -> Streaming:
        """This, if it fits ``sync_every`` (and a module of ``tensors`` trainable tensors)."""
        check_sync_delay(sync_every, self.fragments, self.sync_delay)
        if tensors is not None and self.fragments > tensors:
            raise ValueError(
                f"`fragments={self.fragments}` must be at most the module's {tensors} trainable parameter tensors"
            )
        return self


def check_error_decay(error_decay: float, compressor: Compressor, error_feedback: bool | None = None) -> float:
    """``error_decay`` if it has an effect: ``beta`` in (0, 1], and ``beta != 1`` only where error
    feedback is kept (by default, for biased codecs); an unbiased codec keeps no residual to decay.

    Raises:
        ValueError: in one line, naming the value, the codec and the choices.
    """
    error_decay = check_range("error_decay", error_decay, 0.0, 1.0, low_inclusive=False)
    kept = compressor.biased if error_feedback is None else error_feedback
    if error_decay != 1.0 and not kept:
        raise ValueError(
            f"`error_decay={error_decay}` needs error feedback, which compressor {compressor.name!r} (unbiased) does "
            "not keep: set error_decay=1.0, or choose a biased compressor (e.g. 'topk', 'chunk_topk', 'dgc')"
        )
    return error_decay


def partition(numels: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty ranges ``[start, stop)`` of tensors with these element counts,
    balanced by elements: cut ``k`` falls on the tensor boundary nearest to ``k / parts`` of all
    elements (the earlier boundary on a tie)."""
    cumulative = [0]
    for n in numels:
        cumulative.append(cumulative[-1] + n)
    cuts = [0]
    for k in range(1, parts):
        target = cumulative[-1] * k / parts
        choices = range(cuts[-1] + 1, len(numels) - (parts - k) + 1)
        cuts.append(min(choices, key=lambda i: (abs(cumulative[i] - target), i)))
    cuts.append(len(numels))
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class InFlight:
    """A launched exchange: the inner step it was launched at and its future average (flat)."""

    launched_at: int
    average: Future[torch.Tensor]


def resolved(tensor: torch.Tensor) -> Future[torch.Tensor]:
    future: Future[torch.Tensor] = Future()
    future.set_result(tensor)
    return future


class Fragment:
    """Parameters ``[start, stop)`` of the outer loop: their ``theta_g``, averager and outer SGD.

    ``dirty`` says, the same on every rank, whether ``theta_r`` may differ from ``theta_g``: set by
    an inner step, cleared when ``theta_r`` is set to ``theta_g`` (a landing without mix, a full sync).
    """

    def __init__(
        self, index: int, offset: int, params: list[torch.Tensor], averager: CompressedAverager, outer: OuterSGD
    ) -> None:
        self.index = index
        self.offset = offset
        self.params = params
        self.numels = [p.numel() for p in params]
        dtype = params[0].dtype
        for p in params[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        self.dtype = dtype
        check_error_decay(averager.memory.error_decay, averager.compressor, averager.memory.error_feedback)
        self.averager = averager
        # theta_g (and the outer momentum) at least in float32: outer steps below a half-precision
        # parameter's spacing would round away, every sync
        self.globals = [p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True) for p in params]
        self.outer_optimizer = outer.build(self.globals)
        self.in_flight: InFlight | None = None
        self.syncs = 0
        self.dirty = False

    def due(self, step: int, sync_every: int) -> bool:
        """Whether this fragment launches at inner step ``step``."""
        return (step - self.offset) % sync_every == 0

    def launch(self, step: int) -> None:
        """Send ``theta_g - theta_r`` (compressed, error-fed) without waiting for the average.

        Raises:
            RuntimeError: an exchange of this fragment is still in flight (it must land first: one
                average per fragment at a time, or the second would overwrite the first).
        """
        if self.in_flight is not None:
            raise RuntimeError(
                f"fragment {self.index} launched at step {self.in_flight.launched_at} is still in flight; "
                f"land it before launching again (at step {step})"
            )
        with torch.no_grad():
            delta = torch.empty(sum(self.numels), dtype=self.dtype, device=self.params[0].device)
            for piece, theta_g, theta_r in zip(delta.split(self.numels), self.globals, self.params):
                # against theta_g as the module held it (rounded to theta_r's dtype): where theta_r started
                torch.sub(theta_g.to(theta_r.dtype), theta_r, out=piece.view(theta_g.shape))
            self.in_flight = InFlight(step, self.averager.average(delta))

    def land(self, mix: float, *, final: bool = False) -> None:
        """Wait for the exchange in flight, take the outer step, set ``theta_r`` to the mix.

        ``final``: the end-of-run sync of a partial pseudo-gradient (fewer than ``H`` inner steps):
        ``theta_g <- theta_g - lr y`` with the outer lr and no momentum, the momentum buffer
        untouched (a momentum step would replay the last full sync's velocity on top of it).
        """
        assert self.in_flight is not None
        with torch.no_grad():
            average = self.in_flight.average.wait()
            self.in_flight = None
            pieces = [piece.view(g.shape).to(g.dtype) for piece, g in zip(average.split(self.numels), self.globals)]
            if final:
                for theta_g, y in zip(self.globals, pieces):
                    theta_g.add_(y, alpha=-self.outer_optimizer.param_groups[0]["lr"])
            else:
                for theta_g, y in zip(self.globals, pieces):
                    theta_g.grad = y
                self.outer_optimizer.step()
                self.outer_optimizer.zero_grad(set_to_none=True)
            for theta_g, theta_r in zip(self.globals, self.params):
                theta_r.copy_(theta_g if mix == 0 else torch.lerp(theta_g, theta_r.to(theta_g.dtype), mix))
        self.syncs += 1
        self.dirty = mix != 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Outer SGD, averager, counters and the exchange in flight (waited for: its average)."""
        in_flight = None
        if self.in_flight is not None:
            average = self.in_flight.average.wait().detach().clone()
            self.in_flight = InFlight(self.in_flight.launched_at, resolved(average))
            in_flight = {"launched_at": self.in_flight.launched_at, "average": average.clone()}
        return {
            "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "averager": self.averager.state_dict(),
            "syncs": self.syncs,
            "dirty": self.dirty,
            "in_flight": in_flight,
        }

    def load_state_dict(self, state: dict[str, Any], outer: OuterSGD) -> None:
        self.averager.load_state_dict(state["averager"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for settings in self.outer_optimizer.param_groups:  # this run's settings, not the checkpoint's
            settings.update(lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov)
        self.syncs = int(state["syncs"])
        self.dirty = bool(state["dirty"])
        saved = state["in_flight"]
        self.in_flight = None
        if saved is not None:
            device = self.params[0].device
            average = saved["average"].to(device=device, dtype=self.dtype, copy=True)
            self.in_flight = InFlight(int(saved["launched_at"]), resolved(average))
