"""Compressed gradient exchange in a plain ``DistributedDataParallel`` loop (torchrun, SLURM).

The same :class:`~lightning_gc.runtime.session.CompressionSession` as the Lightning strategy, driven by
a hand-written loop::

    model = DistributedDataParallel(net)                     # after init_process_group
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    gc = lightning_gc.attach(model, optimizer, "dgc", compress_ratio=0.001)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()                      # the comm hook compresses here
        gc.step()                                            # instead of optimizer.step()
    gc.finish()                                              # owed delayed averages; lets go of the model

Checkpoints: :meth:`AttachedCompression.state_dict` gathers every rank's state (residuals,
momenta, warm-start factors, running totals) on rank 0, so it must be called on every rank; put it
beside the model's and optimizer's state and load it back with
:meth:`AttachedCompression.load_state_dict` on every rank after attaching again (at another world
size the per-rank state is re-sharded, :mod:`lightning_gc.runtime.reshard`).

What the session needs before each backward pass (the optimizer's current momentum, a grad
scaler's scale) it takes in a forward pre-hook on the DDP module, so a scheduler that rewrites
momentum between steps is followed, as under the Trainer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.common.validation import check_int
from lightning_gc.compressors.base import AdjustableRatio, Compressor
from lightning_gc.runtime.build import build_session, preset_for
from lightning_gc.runtime.session import CompressionSession
from lightning_gc.runtime.teardown import shut_down_process_group_at_exit


class AttachedCompression:
    """The handle :func:`attach` returns: steps the optimizer, keeps statistics and state.

    Attributes:
        session: the run's :class:`~lightning_gc.runtime.session.CompressionSession`.
        last_metrics: the last step's ``gc/*`` metrics (``None`` before the first exchange).
    """

    def __init__(
        self,
        ddp: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        session: CompressionSession,
        scaler: torch.amp.GradScaler | None,
        devices_per_node: int | None = None,
        total_steps: int | None = None,
        length_hint: str = "pass total_steps=N (the run's optimizer steps) to attach",
    ) -> None:
        self.ddp, self.optimizer, self.session, self.scaler = ddp, optimizer, session, scaler
        self.total_steps = None if total_steps is None else check_int("total_steps", total_steps, 1)
        self._length_hint = length_hint
        self.last_metrics: dict[str, float] | None = None
        self._before_forward = ddp.register_forward_pre_hook(self._prepare)
        find_unused = bool(getattr(ddp, "find_unused_parameters", False))
        session.attach(ddp, find_unused_parameters=find_unused, devices_per_node=devices_per_node)
        session.start_fit([optimizer], self.total_steps, length_hint=self._length_hint)
        self._finished = False

    def _prepare(self, *_: Any) -> None:
        scale = None if self.scaler is None or not self.scaler.is_enabled() else float(self.scaler.get_scale())
        self.session.before_step([self.optimizer], scale)

    # ------------------------------------------------------------------ each step
    def step(self) -> dict[str, float] | None:
        """After ``backward()``: settle the step on every rank (a non-finite gradient under
        ``nonfinite="skip"`` skips it everywhere), step the optimizer (through the grad scaler when
        one was given, which then also updates its scale), and return the step's ``gc/*`` metrics."""
        skip = self.session.settle(self.optimizer)
        if not skip:
            with self.session.stepping([self.optimizer]):
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                else:
                    self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        metrics = self.session.after_step()
        if metrics is not None:
            self.last_metrics = metrics
        self.session.verify(self.ddp)
        return metrics

    def finish(self) -> None:
        """Apply what delayed synchronisation still owes (ranks then hold the same parameters) and
        remove the hand-over's gradient hooks. Call once training ends."""
        if not self._finished:
            self.session.finish(self.ddp, [self.optimizer])
            self._before_forward.remove()
            self._finished = True
            shut_down_process_group_at_exit()  # gloo's threads must stop before finalization

    # ------------------------------------------------------------------ knobs and statistics
    @property
    def compressor(self) -> Compressor:
        return self.session.compressor

    @property
    def compress_ratio(self) -> float:
        """The compressor's current ratio; set it (on every rank) for a warm-up, e.g.
        ``gc.compress_ratio = SparsityWarmup().ratio_at(epoch, 0.001)``."""
        return self._adjustable().compress_ratio

    @compress_ratio.setter
    def compress_ratio(self, value: float) -> None:
        self._adjustable().compress_ratio = value

    def _adjustable(self) -> AdjustableRatio:
        if not isinstance(self.compressor, AdjustableRatio):
            raise AttributeError(f"compressor {self.compressor.name!r} has no compress_ratio")
        return self.compressor

    @property
    def totals(self) -> dict[str, float]:
        """Running sums over the run: ``steps``, ``bytes_sent``, ``dense_bytes``, ``skipped_steps``."""
        return self.session.totals

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every rank's compression state, complete on rank 0 (a collective: call it on every rank)."""
        optimizer_states = [self.optimizer.state_dict()] if self.session.settings.local_update else []
        entry = self.session.checkpoint_entry(
            self.ddp.module, optimizer_states, rank=dist.get_rank(self.ddp.process_group), world_size=_world(self.ddp)
        )
        assert entry is not None  # attached: the hook state exists
        return entry

    def load_state_dict(self, entry: dict[str, Any], source: Any = "the state given") -> None:
        """Continue from :meth:`state_dict`'s output (rank 0's copy, loaded on every rank): this
        rank's residuals, momenta and counters, and with ``local_update`` its own parameters and
        optimizer state, re-sharded at another world size. Raises ``ValueError`` for another format or
        state that cannot be re-sharded (naming ``source``)."""
        own_optimizer_states = self.session.resume(
            entry, source=source, rank=dist.get_rank(self.ddp.process_group), world_size=_world(self.ddp)
        )
        self.session.take_over_pending(self.ddp)
        if own_optimizer_states:
            self.optimizer.load_state_dict(own_optimizer_states[0])
        self.session.start_fit([self.optimizer], self.total_steps, length_hint=self._length_hint)


def _world(ddp: DistributedDataParallel) -> int:
    return dist.get_world_size(ddp.process_group)


def attach(
    ddp_model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    compressor: str | Compressor = "dgc",
    *,
    scaler: torch.amp.GradScaler | None = None,
    devices_per_node: int | None = None,
    total_steps: int | None = None,
    **kwargs: Any,
) -> AttachedCompression:
    """Register compressed gradient exchange on ``ddp_model`` and hand ``optimizer``'s momentum over.

    Args:
        ddp_model: a ``DistributedDataParallel`` module (no comm hook registered yet).
        optimizer: the one optimizer of the model's parameters; step it with the handle's
            :meth:`~AttachedCompression.step`, not directly.
        compressor: a registered name (its arguments in ``kwargs``) or a Compressor object.
        scaler: a ``torch.amp.GradScaler`` for mixed precision (the handle steps through it).
        devices_per_node: ranks per node, for a two-level ``hierarchy`` (default: torchrun's
            ``LOCAL_WORLD_SIZE``); ranks are numbered node by node.
        total_steps: the run's optimizer steps (``gc.step()`` calls from step 0, also when
            resuming). Needed with Adam/AdamW under momentum correction (``"dgc"``) when
            ``adam_warmup_steps="auto"`` (the default: a fifth of them are plain Adam), and gives
            the compressed phase its density floor (``adam_min_sends``); SGD runs never need it.
        **kwargs: the compressor's arguments (e.g. ``compress_ratio``) and any
            :class:`~lightning_gc.runtime.settings.CompressionSettings` field (``momentum_correction``,
            ``clip_norm``, ``nonfinite``, ``delay``, ``adam_warmup_steps``, ...); ``"dgc"`` turns
            momentum correction on by default, as ``DGCStrategy`` does.

    Raises:
        ValueError: an unknown argument (with the close name), a bad value, or a model that is
            not wrapped in ``DistributedDataParallel``.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"attach needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    session = build_session(compressor, kwargs, owner="attach", preset=preset_for(compressor))
    return AttachedCompression(ddp_model, optimizer, session, scaler, devices_per_node, total_steps)
