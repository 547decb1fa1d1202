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

The last four lines are :class:`~lightning_gc.exchanges.averager.CompressedAverager`. DiLoCo
(arXiv:2311.08105) uses no compression and Nesterov SGD with lr 0.7, momentum 0.9 (the defaults);
SparseLoCo (arXiv:2508.15706) uses top-k with ``error_decay < 1`` and plain outer SGD with lr 1.

Invariant: with ``sync_every=1``, compressor ``"none"``, ``outer_lr=1``, ``outer_momentum=0``,
``outer_nesterov=False`` and plain SGD inner steps (lr ``lr``) this is synchronous DDP:
``delta_r = lr g_r`` and ``theta <- theta - lr mean_r g_r`` (up to float rounding of the
subtraction and the mean).

Floating-point buffers (BatchNorm running statistics) are averaged exactly (all-reduce sum / N)
at every sync; integer buffers (``num_batches_tracked``) and frozen parameters
(``requires_grad=False``) are left alone: they are the same on every rank by construction.

Which weights the module holds: right after :meth:`OuterLoop.sync` it holds ``theta_g``; between
syncs it holds the rank's own ``theta_r``. ``theta_g`` (:attr:`OuterLoop.global_parameters`) is
what users evaluate and keep; a front end evaluates it, not ``theta_r``.

Memory per rank on top of training: ``theta_g``, the outer momentum and the residual ``e_r``
(about 3x the trainable parameters; no residual for unbiased codecs such as ``"none"``), plus one
flat pseudo-gradient at each sync.

A checkpoint (:meth:`OuterLoop.state_dict`, per rank: residuals differ) holds ``theta_g`` by
parameter name, the outer optimizer's state, the averager's state (residuals, codec state, bytes
sent) and the step counters. The caller saves the module (``theta_r``) and the inner optimizer;
with those, a run resumed between syncs continues bit for bit like an uninterrupted one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from lightning_gc.common.validation import check_bool, check_int, check_range
from lightning_gc.compressors.base import Compressor
from lightning_gc.exchanges.averager import CompressedAverager
from lightning_gc.exchanges.comm import ProcessGroup
from lightning_gc.runtime.consistency import verify_same_parameters

STATE_FORMAT = 1


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
            built :class:`~lightning_gc.compressors.base.Compressor`; ``"none"``: exact average.
        error_decay: ``beta`` in ``e <- beta e + delta``, in (0, 1].
        outer_lr, outer_momentum, outer_nesterov: the outer ``torch.optim.SGD`` (lr > 0, momentum
            in [0, 1), Nesterov only with momentum > 0). On resume these settings win over the
            checkpoint's.
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
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        group: ProcessGroup = None,
        **compressor_arguments: Any,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        error_decay = check_range("error_decay", error_decay, 0.0, 1.0, low_inclusive=False)
        self.outer_lr = check_range("outer_lr", outer_lr, 0.0, None, low_inclusive=False)
        self.outer_momentum = check_range("outer_momentum", outer_momentum, 0.0, 1.0, high_inclusive=False)
        self.outer_nesterov = check_bool("outer_nesterov", outer_nesterov)
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError("`outer_nesterov=True` needs `outer_momentum` > 0, got 0.0; set outer_nesterov=False")
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"`module` ({type(module).__name__}) has no trainable parameters: nothing to sync")
        devices = sorted({str(p.device) for _, p in named})
        if len(devices) != 1:
            raise ValueError(f"`module`'s trainable parameters must be on one device, got {devices}")
        self.module = module
        self.group = group
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._numels = [p.numel() for p in self._params]
        self._dtype = self._params[0].dtype
        for p in self._params[1:]:
            self._dtype = torch.promote_types(self._dtype, p.dtype)
        self.averager = CompressedAverager(
            compressor,
            [(name, tuple(p.shape)) for name, p in named],
            group=group,
            error_decay=error_decay,
            **compressor_arguments,
        )
        try:
            verify_same_parameters(module, group)
        except RuntimeError as error:
            raise RuntimeError(
                f"OuterLoop needs the same starting parameters on every rank (seed or broadcast the model): {error}"
            ) from error
        self._global = [p.detach().clone() for p in self._params]
        self.outer_optimizer = torch.optim.SGD(
            self._global, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_nesterov
        )
        self._inner_steps = 0
        self._since_sync = 0
        self._syncs = 0

    # ------------------------------------------------------------------ progress
    @property
    def inner_steps(self) -> int:
        """Inner steps counted by :meth:`inner_step_done` since the start of the run."""
        return self._inner_steps

    @property
    def syncs(self) -> int:
        """Syncs done since the start of the run."""
        return self._syncs

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank handed to the transport over all syncs (indices included)."""
        return self.averager.bytes_sent

    @property
    def global_parameters(self) -> dict[str, torch.Tensor]:
        """``theta_g`` by parameter name: the live tensors (read, do not modify)."""
        return dict(zip(self._names, self._global))

    def inner_step_done(self) -> bool:
        """Count one inner step (call after every inner ``optimizer.step()``, on every rank) and
        :meth:`sync` when ``sync_every`` steps have passed since the last sync; whether it synced."""
        self._inner_steps += 1
        self._since_sync += 1
        if self._since_sync >= self.sync_every:
            self.sync()
            return True
        return False

    # ------------------------------------------------------------------ the sync
    def sync(self) -> None:
        """One outer step now, on every rank of the group (the module then holds ``theta_g``);
        :meth:`inner_step_done` calls it, a caller may too (e.g. at the end of training)."""
        with torch.no_grad():
            delta = torch.empty(sum(self._numels), dtype=self._dtype, device=self._params[0].device)
            for piece, theta_g, theta_r in zip(delta.split(self._numels), self._global, self._params):
                torch.sub(theta_g, theta_r, out=piece.view(theta_g.shape))
            average = self.averager.average(delta).wait()
            for piece, theta_g in zip(average.split(self._numels), self._global):
                theta_g.grad = piece.view(theta_g.shape).to(theta_g.dtype)
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            for theta_g, theta_r in zip(self._global, self._params):
                theta_r.copy_(theta_g)
            self._average_buffers()
        self._since_sync = 0
        self._syncs += 1

    def _average_buffers(self) -> None:
        """Floating-point buffers <- their exact mean over the group (one all-reduce per dtype)."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            if buffer.is_floating_point():
                by_kind.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        world_size = dist.get_world_size(self.group)
        for buffers in by_kind.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            flat.div_(world_size)
            for buffer, piece in zip(buffers, flat.split([b.numel() for b in buffers])):
                buffer.copy_(piece.view(buffer.shape))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's resumable state (copies): ``theta_g`` by name, the outer optimizer, the
        averager (residuals differ per rank: save every rank's) and the step counters."""
        return {
            "format": STATE_FORMAT,
            "inner_steps": self._inner_steps,
            "since_sync": self._since_sync,
            "syncs": self._syncs,
            "global": {name: theta_g.clone() for name, theta_g in zip(self._names, self._global)},
            "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "averager": self.averager.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (same parameters, same codec settings); the
        caller restores the module and the inner optimizer itself."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"outer loop state format {state.get('format')!r} is not {STATE_FORMAT}")
        saved = state["global"]
        if list(saved) != self._names:
            raise ValueError(f"the state holds parameters {list(saved)}, this module trains {self._names}")
        for name, theta_g in zip(self._names, self._global):
            if saved[name].shape != theta_g.shape:
                shapes = f"{tuple(saved[name].shape)} in the state, {tuple(theta_g.shape)} here"
                raise ValueError(f"parameter {name!r} has shape {shapes}")
        self.averager.load_state_dict(state["averager"])
        with torch.no_grad():
            for name, theta_g in zip(self._names, self._global):
                theta_g.copy_(saved[name])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for settings in self.outer_optimizer.param_groups:  # this run's settings, not the checkpoint's
            settings.update(lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_nesterov)
        self._inner_steps = int(state["inner_steps"])
        self._since_sync = int(state["since_sync"])
        self._syncs = int(state["syncs"])
