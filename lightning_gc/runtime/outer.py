"""The DiLoCo-family outer loop: each rank trains alone for ``sync_every`` inner steps, then the
ranks exchange compressed pseudo-gradients once and take one outer step together.

The maths (``docs``: DESIGN.md section 9), per rank ``r`` over a process group of ``N`` ranks::

    theta_g                          the last synchronised parameters (same bits on every rank)
    theta_r <- H inner steps         the rank's own optimizer, no gradient communication
    delta_r  = theta_g - theta_r     the pseudo-gradient (one flat tensor, parameter order)
    e_r     <- beta e_r + delta_r    error-feedback memory (beta = error_decay)
    s_r      = C(e_r);  e_r -= s_r   what the codec sends; the rest stays for the next sync
    y        = (1/N) sum_r s_r       every rank decodes the same y
    theta_g <- OuterSGD(theta_g, y)  SGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_nesterov)
    theta_r <- theta_g               every rank restarts from the same bits

The lines for ``e_r``, ``s_r`` and ``y`` are
:class:`~lightning_gc.exchanges.averager.CompressedAverager`. DiLoCo (arXiv:2311.08105) uses no
compression and Nesterov SGD with lr 0.7, momentum 0.9 (the defaults); SparseLoCo
(arXiv:2508.15706) uses top-k with ``error_decay < 1`` and plain outer SGD with lr 1.

The final sync (:meth:`OuterLoop.sync`, at the end of a run whose steps are not a multiple of
``H``): the pseudo-gradient of the ``h < H`` steps since the last sync is averaged as above and
applied as ``theta_g <- theta_g - outer_lr y``, with no momentum and the momentum buffer left as it
was. A momentum step would add ``outer_momentum`` times the last full sync's velocity on top of a
partial ``y`` (with ``y = 0``, ``theta_g`` would still move); the final rule keeps ``y = 0`` a
no-op. Exchanges in flight (launched at a scheduled step, with a full pseudo-gradient) land first
with the regular outer step.

Invariant: with ``sync_every=1``, compressor ``"none"``, ``outer_lr=1``, ``outer_momentum=0``,
``outer_nesterov=False`` and plain SGD inner steps (lr ``lr``) this is synchronous DDP:
``delta_r = lr g_r`` and ``theta <- theta - lr mean_r g_r`` (up to float rounding of the
subtraction and the mean).

Which codecs run on ``delta_r``: every registered one. The pseudo-gradient is one flat tensor of
whole parameter tensors, averaged through the same pipeline as a DDP bucket, and nothing a codec
needs is per-step only (DGC's momentum correction is off: the outer SGD holds the momentum).
Per-step options of gradient compression (``delay``, ``local_update``, the Adam hand-over) are
refused by the front ends (:func:`~lightning_gc.integrations.outer_arguments.outer_arguments`).

Floating-point buffers (BatchNorm running statistics) are averaged exactly (all-reduce sum / N)
at every sync; integer buffers (``num_batches_tracked``) and frozen parameters
(``requires_grad=False``) are left alone: they are the same on every rank by construction. The
averaged buffers of the last sync (``buffers_g``, :attr:`OuterLoop.global_buffers`) go with
``theta_g``: between syncs each rank's own statistics follow its own ``theta_r``, so evaluating or
saving ``theta_g`` takes ``buffers_g`` too (the same on every rank), never a rank's own.

Streaming (``streaming=Streaming(fragments, sync_delay, mix)``; Streaming DiLoCo,
arXiv:2501.18512): the trainable parameters are cut into ``fragments`` contiguous groups in
parameter order, balanced by elements; each has its own ``theta_g``, residual and outer momentum,
launches its exchange every ``sync_every`` steps at its own offset, lands it ``sync_delay`` steps
later (training goes on meanwhile) and then sets its ``theta_r`` to
``lerp(theta_g, theta_r, mix)`` (:mod:`lightning_gc.runtime.outer_fragments` has the schedule). The
defaults (1, 0, 0.0) are the sync above. Buffers are averaged when fragment 0 lands (once every
``sync_every`` steps).

Which weights the module holds: right after :meth:`OuterLoop.sync` it holds ``theta_g``; between
syncs it holds the rank's own ``theta_r``. ``theta_g`` (:attr:`OuterLoop.global_parameters`,
every fragment's latest) with ``buffers_g`` is what users evaluate and keep; a front end evaluates
it, not ``theta_r`` (:meth:`OuterLoop.global_weights` swaps both in for a block).

``theta_g`` and the outer momentum are kept in float32 (or the parameter's dtype if wider): a
half-precision module (``bf16-true``) would lose every outer step below its spacing. The module
gets ``theta_g`` rounded to its dtype, and ``delta_r`` is taken from that rounded ``theta_g`` (where
``theta_r`` started), in the parameters' dtype.

Memory per rank on top of training: ``theta_g``, the outer momentum and the residual ``e_r``
(about 3x the trainable parameters; no residual for unbiased codecs such as ``"none"``), plus one
flat pseudo-gradient per exchange in flight (a fragment's, kept ``sync_delay`` steps).

A checkpoint (:meth:`OuterLoop.state_dict`, per rank: residuals differ) holds ``theta_g`` and
``buffers_g`` by name, and per fragment the outer optimizer's state, the averager's state (residuals, codec
state, bytes sent), its counters and its exchange in flight (waited for at save: the average, which
a resumed run applies at the same step), and the inner step count. The caller saves the module
(``theta_r``) and the inner optimizer; with those, a run resumed between syncs continues bit for
bit like an uninterrupted one.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_gc.common.log import notify_on_rank_zero
from lightning_gc.common.validation import check_int, check_range
from lightning_gc.compressors.base import Compressor
from lightning_gc.exchanges.averager import CompressedAverager
from lightning_gc.exchanges.comm import ProcessGroup
from lightning_gc.runtime.consistency import verify_same_parameters
from lightning_gc.runtime.outer_buffers import LocalWeights, average_buffers
from lightning_gc.runtime.outer_fragments import Fragment, OuterSGD, Streaming, partition

__all__ = ["LocalWeights", "OuterLoop", "OuterSGD", "Streaming"]

STATE_FORMAT = 3  # 3: the schedule's settings (sync_every, fragments, sync_delay, mix) and buffers_g


class OuterLoop:
    """Sync a module's trainable parameters every ``sync_every`` inner steps through a compressed,
    error-fed average of pseudo-gradients and an outer SGD step (module docstring for the maths).

    Build it on every rank of ``group`` after the module is on its device and before the first
    inner step; call :meth:`inner_step_done` after every inner ``optimizer.step()``. The inner
    optimizer's state is kept across syncs (as DiLoCo does); only the parameters are reset.

    Args:
        module: the model; its trainable parameters must all be on one device, and all its
            parameters (frozen ones too) equal on every rank (checked here with one collective).
        sync_every: inner steps between syncs (``H``), >= 1.
        compressor: a registered compressor name (its arguments in ``compressor_arguments``) or a
            built :class:`~lightning_gc.compressors.base.Compressor`, a template: every fragment
            runs its own codec (a copy), so that its plans and state are its own (a shared codec
            keyed both fragments' plans by the same bucket index and rebuilt them at every sync);
            ``"none"``: exact average.
        error_decay: ``beta`` in ``e <- beta e + delta``, in (0, 1].
        outer: the outer SGD's settings (default :class:`OuterSGD`: lr 0.7, momentum 0.9,
            Nesterov). On resume these settings win over the checkpoint's.
        streaming: fragments, sync delay and mix (default :class:`Streaming`: one fragment, no
            delay, no mix); ``fragments`` at most the trainable tensors, ``sync_delay`` below
            ``sync_every / fragments``.
        group: the process group to sync over (``None``: the default group).
        **compressor_arguments: the named compressor's arguments (e.g. ``compress_ratio``).

    Raises:
        ValueError: a bad setting, an unknown compressor or argument, or a module without
            trainable parameters, naming it.
        RuntimeError: the ranks' starting parameters differ, naming the first that does.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        sync_every: int,
        compressor: str | Compressor = "none",
        error_decay: float = 1.0,
        outer: OuterSGD | None = None,
        streaming: Streaming | None = None,
        group: ProcessGroup = None,
        **compressor_arguments: Any,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        error_decay = check_range("error_decay", error_decay, 0.0, 1.0, low_inclusive=False)
        self.outer = OuterSGD() if outer is None else outer
        streaming = Streaming() if streaming is None else streaming
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"`module` ({type(module).__name__}) has no trainable parameters: nothing to sync")
        self.streaming = streaming.check(self.sync_every, len(named))
        devices = sorted({str(p.device) for _, p in named})
        if len(devices) != 1:
            raise ValueError(f"`module`'s trainable parameters must be on one device, got {devices}")
        self.module = module
        self.group = group
        self._names = [name for name, _ in named]
        self.fragments: list[Fragment] = []
        """The fragments in parameter order (one by default)."""
        ranges = partition([p.numel() for _, p in named], streaming.fragments)
        for index, (start, stop) in enumerate(ranges):
            part = named[start:stop]
            averager = CompressedAverager(
                copy.deepcopy(compressor) if isinstance(compressor, Compressor) else compressor,
                [(name, tuple(p.shape)) for name, p in part],
                group=group,
                error_decay=error_decay,
                first_order=start,  # the fragment's first parameter's index: fragments draw independent rounding
                **compressor_arguments,
            )
            offset = index * self.sync_every // streaming.fragments
            self.fragments.append(Fragment(index, offset, [p for _, p in part], averager, self.outer))
        try:
            verify_same_parameters(module, group)
        except RuntimeError as error:
            raise RuntimeError(
                f"OuterLoop needs the same starting parameters on every rank (seed or broadcast the model): {error}"
            ) from error
        self._buffers_g = {name: b.detach().clone() for name, b in self._float_buffers().items()}
        self._inner_steps = 0

    # ------------------------------------------------------------------ progress
    @property
    def inner_steps(self) -> int:
        """Inner steps counted by :meth:`inner_step_done` since the start of the run."""
        return self._inner_steps

    @property
    def syncs(self) -> int:
        """Exchanges landed on ``theta_g`` since the start of the run, over all fragments (with ``P``
        fragments, ``P`` per ``sync_every`` steps)."""
        return sum(f.syncs for f in self.fragments)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank handed to the transport over all syncs (indices included)."""
        return sum(f.averager.bytes_sent for f in self.fragments)

    @property
    def compressor(self) -> Compressor:
        """The codec of fragment 0 (every fragment runs its own, with the same settings)."""
        return self.fragments[0].averager.compressor

    @property
    def global_parameters(self) -> dict[str, torch.Tensor]:
        """``theta_g`` by parameter name: the live tensors (read, do not modify)."""
        return dict(zip(self._names, (t for f in self.fragments for t in f.globals)))

    @property
    def global_buffers(self) -> dict[str, torch.Tensor]:
        """``buffers_g`` by name: the floating-point buffers as averaged at the last sync (at
        construction: the module's), the same on every rank; the live tensors (read only)."""
        return dict(self._buffers_g)

    @property
    def in_flight(self) -> list[int]:
        """The fragments whose exchange is launched and not landed yet."""
        return [f.index for f in self.fragments if f.in_flight is not None]

    @property
    def pending(self) -> bool:
        """Whether :meth:`sync` would do anything: an exchange in flight, or a fragment whose
        ``theta_r`` may differ from its ``theta_g`` (the same answer on every rank)."""
        return any(f.in_flight is not None or f.dirty for f in self.fragments)

    def inner_step_done(self) -> bool:
        """Count one inner step (call after every inner ``optimizer.step()``, on every rank), launch
        the exchanges due at it, land those due; whether ``theta_g`` changed (an exchange landed)."""
        self._inner_steps += 1
        step = self._inner_steps
        for fragment in self.fragments:
            fragment.dirty = True
        launching = [f for f in self.fragments if f.due(step, self.sync_every)]
        if launching:
            self._check_trainable()
        for fragment in launching:  # in fragment order: the same collectives' order on every rank
            fragment.launch(step)
        due = [f for f in self._flying() if f.in_flight.launched_at + self.streaming.sync_delay <= step]
        for fragment in due:
            fragment.land(self.streaming.mix)
            if fragment.index == 0:
                self._average_buffers()
        return bool(due)

    # ------------------------------------------------------------------ the sync
    def sync(self) -> bool:
        """A full sync now, on every rank of the group, e.g. at the end of training: the exchanges
        in flight land without mix (``theta_r <- theta_g``: the run ends on ``theta_g``, so such a
        fragment is not sent again), then every fragment whose ``theta_r`` may differ from
        ``theta_g`` is exchanged and applied at once by the final rule (module docstring:
        ``theta_g <- theta_g - outer_lr y``, no momentum); the module then holds ``theta_g`` and buffers
        are averaged. Each fragment takes at most one outer step here. The schedule of
        :meth:`inner_step_done` does not move. Whether anything was done (nothing when
        :attr:`pending` is false)."""
        self._check_trainable()
        flying = self._flying()
        for fragment in flying:
            fragment.land(0.0)
        todo = [f for f in self.fragments if f.dirty]
        for fragment in todo:
            fragment.launch(self._inner_steps)
        for fragment in todo:
            fragment.land(0.0, final=True)
        if flying or todo:
            self._average_buffers()
        return bool(flying or todo)

    def finish(self) -> bool:
        """The end of a run, on every rank of the group: :meth:`sync` when :attr:`pending` (with a
        notice naming the inner step, on rank zero), so that every rank's module holds ``theta_g``;
        whether it synced. Every front end ends its run through this."""
        if not self.pending:
            return False
        notify_on_rank_zero(f"lightning_gc: final outer sync after inner step {self._inner_steps}")
        return self.sync()

    def _check_trainable(self) -> None:
        """Raise if the trainable parameters are not those of construction (checked at each sync:
        a parameter unfrozen later would never be synced, a frozen one synced from stale values)."""
        trainable = [name for name, p in self.module.named_parameters() if p.requires_grad]
        if trainable != self._names:
            changed = sorted(set(trainable) ^ set(self._names))
            raise RuntimeError(
                f"the module's trainable parameters changed since construction: {changed}; the outer loop syncs the "
                "ones trainable when it was built, so build it after (un)freezing, or resume from a checkpoint"
            )

    def _flying(self) -> list[Fragment]:
        """The fragments in flight, in launch order (by step, then fragment)."""
        flying = [f for f in self.fragments if f.in_flight is not None]
        return sorted(flying, key=lambda f: (f.in_flight.launched_at, f.index))  # type: ignore[union-attr]

    def _float_buffers(self) -> dict[str, torch.Tensor]:
        return {name: b for name, b in self.module.named_buffers() if b.is_floating_point()}

    def _average_buffers(self) -> None:
        """Floating-point buffers <- their exact mean over the group (one all-reduce per dtype);
        ``buffers_g`` <- the same."""
        average_buffers(list(self._float_buffers().values()), self.group)
        self._buffers_g = {name: b.detach().clone() for name, b in self._float_buffers().items()}

    @contextmanager
    def global_weights(self) -> Iterator[LocalWeights]:
        """Hold ``theta_g`` and ``buffers_g`` in the module inside the block (to evaluate or save
        them), this rank's ``theta_r`` and own buffers again after it; the block gets those (copies).
        No collective; exchanges in flight stay in flight."""
        named = dict(self.module.named_parameters())
        buffers = self._float_buffers()
        own = LocalWeights(
            {name: named[name].detach().clone() for name in self._names},
            {name: b.detach().clone() for name, b in buffers.items()},
        )
        with torch.no_grad():
            for name, theta_g in self.global_parameters.items():
                named[name].copy_(theta_g)
            for name, buffer_g in self._buffers_g.items():
                buffers[name].copy_(buffer_g)
        try:
            yield own
        finally:
            with torch.no_grad():
                for name, theta_r in own.parameters.items():
                    named[name].copy_(theta_r)
                for name, buffer in own.buffers.items():
                    buffers[name].copy_(buffer)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's resumable state (copies): ``theta_g`` by name, per fragment its outer
        optimizer, averager (residuals differ per rank: save every rank's), counters and the
        average of its exchange in flight (waited for here), and the inner step count."""
        return {
            "format": STATE_FORMAT,
            "settings": self._settings(),
            "inner_steps": self._inner_steps,
            "fragments": [f.state_dict() for f in self.fragments],
            "global": {name: theta_g.clone() for name, theta_g in self.global_parameters.items()},
            "global_buffers": {name: b.clone() for name, b in self._buffers_g.items()},
        }

    def _settings(self) -> dict[str, Any]:
        """The settings a state only resumes under (the schedule and the fragments' cut)."""
        streaming = self.streaming
        return {
            "sync_every": self.sync_every,
            "fragments": streaming.fragments,
            "sync_delay": streaming.sync_delay,
            "mix": streaming.mix,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (same parameters, same ``sync_every``,
        ``fragments``, ``sync_delay`` and ``mix``, same codec settings); the caller restores the
        module and the inner optimizer itself. An exchange that was in flight lands ``sync_delay``
        steps after its launch, as it would have."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"outer loop state format {state.get('format')!r} is not {STATE_FORMAT}")
        for name, here in self._settings().items():
            if state["settings"][name] != here:
                raise ValueError(
                    f"{name}={state['settings'][name]!r} in the state, {name}={here!r} here: the schedule, residuals "
                    "and exchanges in flight only resume under the same sync_every, fragments, sync_delay and mix"
                )
        saved = state["global"]
        if list(saved) != self._names:
            raise ValueError(f"the state holds parameters {list(saved)}, this module trains {self._names}")
        for name, theta_g in self.global_parameters.items():
            if saved[name].shape != theta_g.shape:
                shapes = f"{tuple(saved[name].shape)} in the state, {tuple(theta_g.shape)} here"
                raise ValueError(f"parameter {name!r} has shape {shapes}")
        with torch.no_grad():
            for name, theta_g in self.global_parameters.items():
                theta_g.copy_(saved[name])
        if set(state["global_buffers"]) != set(self._buffers_g):
            raise ValueError(
                f"the state holds buffers {sorted(state['global_buffers'])}, this module has {sorted(self._buffers_g)}"
            )
        self._buffers_g = {name: b.to(self._buffers_g[name], copy=True) for name, b in state["global_buffers"].items()}
        for fragment, fragment_state in zip(self.fragments, state["fragments"]):
            fragment.load_state_dict(fragment_state, self.outer)
        self._inner_steps = int(state["inner_steps"])
