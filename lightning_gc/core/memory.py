"""What a rank remembers between steps: the velocity (residual) and DGC's corrected momentum.

Per parameter, with local gradient ``g`` (DGC §3, Lin et al. 2018)::

    g <- clip(g, clip_norm / sqrt(N))            optional, per tensor
    g <- g + wd * p                              only where momentum moved here (see momentum.py)
    g <- (1 - dampening) * g                     Adam's first moment: dampening = beta1
    u <- m*u + g                                 torch.optim.SGD's momentum buffer
    v <- beta*v                                  error decay (beta = 1 unless set; SparseLoCo's 0.95)
    v <- v + u            (Nesterov: v <- v + (g + m*u))  with m == 0: v <- v + g (error feedback)

after which the compressor sends part of ``v`` and the memory is told what left:

* sparse pairs: ``v[idx] <- v[idx] - sent`` (0 unless the wire dtype rounded the value),
  and with momentum factor masking ``u[idx] <- 0`` where a non-zero value left;
* dense positions (tensors sent whole): ``v <- 0`` and ``u`` is kept, so a tensor that is always
  sent dense follows exactly ``torch.optim.SGD``'s momentum recurrence.

Invariant (``beta = 1``): for every element, ``v + (everything sent so far) == sum of the inputs
to v``: nothing is lost, only delayed. With ``beta < 1`` an input ``t`` steps old that was never
sent is weighed ``beta**t``.

State is *keyed by parameter name* but *stored flat per bucket* (:mod:`lightning_gc.common.flatstate`):
one contiguous velocity (and momentum) buffer per bucket, so the update is a few vectorised passes
(one kernel call per piece of the bucket: :mod:`lightning_gc.core.compensation_pieces`), carried
over by name when DDP rebuilds its buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_gc import kernels
from lightning_gc.common.flatstate import FlatState
from lightning_gc.common.layout import BucketLayout, Segment, bucket_order
from lightning_gc.common.validation import check_range
from lightning_gc.compressors.encoded import Sent
from lightning_gc.core.compensation_pieces import CompensationPiece, ParamsCopy, plan_pieces
from lightning_gc.core.momentum import NO_MOMENTUM, MomentumSpec

_STATE_NAMES = ("velocity", "momentum")


def clip_factor(g: torch.Tensor, threshold: float) -> torch.Tensor:
    """``min(1, threshold / ||g||)``, the factor that clips ``g`` to L2 norm ``threshold``; it stays
    on the device (no host sync)."""
    return (threshold / (torch.linalg.vector_norm(g) + 1e-12)).clamp_(max=1.0)


@dataclass
class BucketMemory:
    """Flat state for one bucket layout; per-parameter state are views into these buffers."""

    layout: BucketLayout
    velocity: torch.Tensor
    momentum: torch.Tensor | None
    spec_version: int = -1
    pieces: list[CompensationPiece] = field(default_factory=list)
    merges_decay: bool = False  # whether pieces merge segments with weight decay (see CompensationPiece)
    params_copy: ParamsCopy | None = None  # the parameters of merged decayed pieces, made on first use
    aside: list[tuple[Segment, list[torch.Tensor]]] = field(default_factory=list)  # see set_aside

    def state(self) -> list[torch.Tensor]:
        """The flat buffers that hold this bucket's state: velocity, and momentum if any."""
        return [t for t in (self.velocity, self.momentum) if t is not None]


class CompensationMemory:
    """Velocity/momentum state of one rank, and the compensate/commit steps around compression.

    Args:
        momentum_correction: accumulate momentum-corrected updates (DGC) for parameters whose
            optimizer momentum was handed over; other parameters use plain error feedback.
        momentum_masking: zero the momentum where values were sent sparsely (DGC's momentum
            factor masking).
        clip_norm: local gradient clipping threshold before accumulation; each tensor's gradient
            is clipped to L2 norm ``clip_norm / sqrt(world_size)``. ``None`` disables clipping.
        error_feedback: keep what was not sent for later steps. Without it the velocity is
            dropped after every send (:meth:`commit`): right for unbiased compressors, whose
            errors average out, and the momentum recurrence is unaffected.
            Clipping is per tensor because a comm hook sees one bucket at a time, never the
            whole model's gradient.
        error_decay: ``beta`` in ``v <- beta*v`` before each accumulation, in (0, 1]: 1 keeps the
            residual whole (plain error feedback); below 1 old, unsent residual fades (SparseLoCo
            uses 0.95 on pseudo-gradients).
    """

    def __init__(
        self,
        *,
        momentum_correction: bool,
        momentum_masking: bool,
        clip_norm: float | None,
        error_feedback: bool = True,
        error_decay: float = 1.0,
    ) -> None:
        self.momentum_correction = momentum_correction
        self.error_feedback = error_feedback
        self.error_decay = check_range("error_decay", error_decay, 0.0, 1.0, low_inclusive=False)
        self.momentum_masking = momentum_masking
        self.clip_norm = clip_norm
        self._specs: dict[str, MomentumSpec] = {}
        self._spec_version = 0
        self._buckets: dict[int, BucketMemory] = {}
        self._state = FlatState(_STATE_NAMES)
        self.seed_view: Callable[[torch.Tensor], torch.Tensor] | None = None
        """What of a whole parameter's flattened momentum this rank's memory holds, as
        :meth:`seed_momentum` stores it (a hierarchical exchange's piece of a node sum); ``None``: all."""

    # ------------------------------------------------------------------ configuration
    def config(self) -> dict[str, object]:
        """The settings every rank must share (plain data); ``error_decay`` only where it is not 1,
        so that a checkpoint written before it existed describes the same memory."""
        config: dict[str, object] = {
            "momentum_correction": self.momentum_correction,
            "momentum_masking": self.momentum_masking,
            "clip_norm": self.clip_norm,
            "error_feedback": self.error_feedback,
        }
        if self.error_decay != 1.0:
            config["error_decay"] = self.error_decay
        return config

    def set_specs(self, specs: dict[str, MomentumSpec]) -> None:
        """Set each parameter's momentum recurrence (by name); ignored without momentum correction."""
        specs = specs if self.momentum_correction else {}
        if specs != self._specs:
            self._specs = dict(specs)
            self._spec_version += 1

    def spec(self, name: str) -> MomentumSpec:
        return self._specs.get(name, NO_MOMENTUM)

    # ------------------------------------------------------------------ bucket state
    def bucket(self, layout: BucketLayout, like: torch.Tensor) -> BucketMemory:
        """The flat state for ``layout``, (re)built when DDP's bucket behind ``layout.index`` changed."""
        memory = self._buckets.get(layout.index)
        if memory is None or memory.layout is not layout:
            memory = self._bind(layout, like)
            self._buckets[layout.index] = memory
        merges_decay = kernels.backend_for(like) == "triton"
        if memory.spec_version != self._spec_version or memory.merges_decay != merges_decay:
            self._plan_pieces(memory, merges_decay)
        return memory

    def _bind(self, layout: BucketLayout, like: torch.Tensor) -> BucketMemory:
        needs_momentum = any(self.spec(s.name).momentum != 0.0 for s in layout.segments)
        flat = self._state.bind(layout, like, _STATE_NAMES if needs_momentum else _STATE_NAMES[:1])
        return BucketMemory(layout=layout, velocity=flat["velocity"], momentum=flat.get("momentum"))

    def _plan_pieces(self, memory: BucketMemory, merges_decay: bool) -> None:
        memory.pieces = plan_pieces(
            memory.layout.segments, self.spec, clipping=self.clip_norm is not None, merges_decay=merges_decay
        )
        memory.merges_decay = merges_decay
        memory.params_copy = None
        if memory.momentum is None and any(piece.recurrence.momentum != 0.0 for piece in memory.pieces):
            memory.momentum = self._state.add(memory.layout, "momentum", memory.velocity)
        memory.spec_version = self._spec_version

    # ------------------------------------------------------------------ the update
    def compensate(
        self,
        memory: BucketMemory,
        grad: torch.Tensor,
        params: list[torch.Tensor],
        world_size: int,
        *,
        absent: list[Segment] | None = None,
        loss_scale: float | None = None,
        summed_ranks: int = 1,
        clip: bool = True,
    ) -> torch.Tensor:
        """Fold the local gradient ``grad`` into the velocity and return it (``grad`` may be overwritten).

        ``summed_ranks``: ``grad`` is the sum of that many ranks' gradients (a node's, in a
        hierarchical exchange), so weight decay, which each rank adds once, is added that many times.
        ``clip=False``: no local clipping here (the ranks clipped before summing, :meth:`clip_local_`).

        ``loss_scale``: the gradient is ``s * g`` (mixed precision); memory works on ``g`` (exact:
        ``s`` is a power of 2) and :meth:`restore_loss_scale` scales the decoded average back.
        ``absent``: segments of parameters that got no gradient on any rank; their state is set
        aside (:meth:`set_aside`) until :meth:`commit`, and nothing of them is sent.
        """
        if loss_scale is not None:
            grad.div_(loss_scale)
        memory.aside = self.set_aside(memory, absent) if absent else []
        if self.error_decay != 1.0:
            memory.velocity.mul_(self.error_decay)
        velocity = self._accumulate(memory, grad, params, world_size, summed_ranks, clip)
        for segment, _ in memory.aside:
            segment.of(velocity).zero_()
        return velocity

    @staticmethod
    def restore_loss_scale(averaged: torch.Tensor, loss_scale: float | None) -> None:
        """Undo :meth:`compensate`'s unscaling on the decoded average, so that a grad scaler's own
        unscaling and overflow checks see the scaled gradient they expect."""
        if loss_scale is not None:
            averaged.mul_(loss_scale)

    def clip_threshold(self, world_size: int) -> float | None:
        """DGC's local clipping threshold, ``clip_norm / sqrt(world_size)`` (``None``: no clipping)."""
        return None if self.clip_norm is None else self.clip_norm / math.sqrt(world_size)

    def clip_local_(
        self, grad: torch.Tensor, layout: BucketLayout, world_size: int, loss_scale: float | None = None
    ) -> None:
        """Clip each tensor of a bucket's local gradient in place to :meth:`clip_threshold`, as
        :meth:`compensate` would (``loss_scale``: ``grad`` is scaled by it). For an exchange that
        sums gradients before they reach the memory (a node's, :mod:`lightning_gc.exchanges.hierarchy`)."""
        threshold = self.clip_threshold(world_size)
        if threshold is None:
            return
        threshold *= 1.0 if loss_scale is None else loss_scale
        for segment in layout.segments:
            g = segment.of(grad)
            g.mul_(clip_factor(g, threshold))

    def _accumulate(
        self,
        memory: BucketMemory,
        grad: torch.Tensor,
        params: list[torch.Tensor],
        world_size: int,
        summed_ranks: int,
        clip: bool,
    ) -> torch.Tensor:
        """The DGC update (module docstring) of every piece of the bucket, in place on the velocity."""
        threshold = self.clip_threshold(world_size) if clip else None
        for piece in memory.pieces:
            g = grad[piece.start : piece.stop]
            spec = piece.recurrence
            scale = None
            if threshold is not None:
                scale = clip_factor(g, threshold)
            keep = 1.0 - spec.dampening  # folded into the gradient's scale and the decay: (1 - d)(g s + wd p)
            if keep != 1.0:
                scale = torch.tensor(keep, device=g.device) if scale is None else scale.mul_(keep)
            param = None
            if spec.weight_decay != 0.0 and piece.segment is not None:
                param = bucket_order(params[piece.segment].detach())
            elif spec.weight_decay != 0.0:
                param = self._params_copy(memory).refresh(piece, memory.layout.segments, params)
            kernels.compensate_(
                g,
                memory.velocity[piece.start : piece.stop],
                None if memory.momentum is None else memory.momentum[piece.start : piece.stop],
                momentum=spec.momentum,
                nesterov=spec.nesterov,
                grad_scale=scale,
                weight_decay=spec.weight_decay * keep * summed_ranks,
                param=param,
            )
        return memory.velocity

    @staticmethod
    def _params_copy(memory: BucketMemory) -> ParamsCopy:
        """``memory``'s copy of the parameters of its merged decayed pieces, made on first use."""
        if memory.params_copy is None:
            memory.params_copy = ParamsCopy(memory.velocity)
        return memory.params_copy

    def commit(self, memory: BucketMemory, sent: Sent, own: torch.Tensor | None = None) -> None:
        """Record what left this rank for one bucket, as ``sent`` (the codec's last round's
        :class:`~lightning_gc.compressors.encoded.Sent`) describes it, then end the bucket's step: drop
        the residual without error feedback, restore set-aside state.

        ``own`` (bucket-sized) receives this rank's contribution as receivers decode it: for a
        whole bucket, ``sent.dense_values`` (or the velocity, sent exactly); otherwise the
        velocity before the commit minus the velocity after it (before any zeroing).
        """
        # Without error feedback, momentum (to mask) or ``own``, subtracting what left would only be
        # undone by the zeroing below: a pass over the bucket saved.
        emptied = False
        if self.error_feedback or own is not None or memory.momentum is not None:
            emptied = self._subtract_sent(memory, sent, own)
        if not self.error_feedback and not emptied:
            memory.velocity.zero_()
        self.put_back(memory, memory.aside)
        memory.aside = []

    def _subtract_sent(self, memory: BucketMemory, sent: Sent, own: torch.Tensor | None) -> bool:
        """Remove what ``sent`` says left from the velocity (and mask momentum); ``own`` gets the
        difference. When the whole bucket left, that is what left as receivers decode it (or the
        velocity itself, sent exactly), copied at once rather than subtracted after the commit.
        Returns whether the velocity is now zero (the whole bucket left exactly)."""
        if sent.dense_all and sent.indices is None:
            if own is not None:
                own.copy_(memory.velocity if sent.dense_values is None else sent.dense_values)
            self.commit_dense(memory, None, sent.dense_values)
            return sent.dense_values is None
        if own is not None:
            own.copy_(memory.velocity)
        if sent.indices is not None:
            assert sent.values is not None
            self.commit_sparse(memory, sent.indices, sent.values)
        if sent.dense_all or sent.dense_positions is not None:
            positions = None if sent.dense_all else sent.dense_positions
            self.commit_dense(memory, positions, sent.dense_values)
        if own is not None:
            own.sub_(memory.velocity)
        return False

    def commit_sparse(self, memory: BucketMemory, indices: torch.Tensor, sent: torch.Tensor) -> None:
        """Record that the pairs ``(indices, sent)`` left: ``v[i] -= sent``, and with masking
        ``u[i] <- 0`` where a non-zero value left. Keeps what wire rounding dropped; (i, 0) is a no-op."""
        masked = memory.momentum if self.momentum_masking else None
        kernels.commit_sparse_(memory.velocity, masked, indices, sent)

    def commit_dense(self, memory: BucketMemory, positions: torch.Tensor | None, sent: torch.Tensor | None) -> None:
        """Record that ``v`` left whole at ``positions`` (``None``: the whole bucket); momentum is kept.

        ``sent`` is what receivers decode when the wire rounded the values (``None``: exact), in
        which case ``v <- v - sent`` keeps the rounding error instead of ``v <- 0``.
        """
        velocity = memory.velocity
        if sent is None:
            if positions is None:
                velocity.zero_()
            else:
                velocity.index_fill_(0, positions, 0.0)
        elif positions is None:
            velocity.sub_(sent)
        else:
            velocity.index_add_(0, positions, sent.to(velocity.dtype), alpha=-1)

    # ------------------------------------------------------------------ parameters without a gradient
    def set_aside(self, memory: BucketMemory, segments: list[Segment]) -> list[tuple[Segment, list[torch.Tensor]]]:
        """Copies of the state of ``segments``: parameters that got no gradient this step (unused
        in the forward pass). :meth:`compensate` zeroes their velocity before encoding, so nothing
        of them is sent (DDP would drop it for a globally unused parameter), and :meth:`put_back`
        restores them in :meth:`commit`: like ``torch.optim.SGD`` skipping a parameter whose ``grad`` is
        ``None``, their residual and momentum are kept as they were, and no weight decay applies."""
        return [(s, [s.of(t).clone() for t in memory.state()]) for s in segments]

    def put_back(self, memory: BucketMemory, aside: list[tuple[Segment, list[torch.Tensor]]]) -> None:
        """Restore what :meth:`set_aside` copied."""
        for segment, copies in aside:
            for tensor, copy in zip(memory.state(), copies):
                segment.of(tensor).copy_(copy)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's state by name, as standalone CPU tensors (see :mod:`lightning_gc.common.flatstate`)."""
        return self._state.state_dict()

    def seed_momentum(self, moments: dict[str, torch.Tensor]) -> None:
        """Start each named parameter's momentum ``u`` from the given tensor (1-D, in bucket order:
        :func:`~lightning_gc.common.layout.bucket_order`), keeping its velocity (Adam's first moment at the
        freeze, :mod:`lightning_gc.core.adam`)."""
        state = self.state_dict()
        for name, moment in moments.items():
            flat = moment.detach().reshape(-1)
            flat = flat if self.seed_view is None else self.seed_view(flat)
            state.setdefault(name, {})["momentum"] = flat.cpu().clone()
        self.load_state_dict(state)

    def divide_nesterov_momentum(self) -> None:
        """``u <- u / m`` for every Nesterov parameter: momenta of a format 1 checkpoint, which
        kept ``m`` times SGD's buffer, become the buffer (``m`` as its parameter's group has it now)."""
        state = self.state_dict()
        for name, entry in state.items():
            spec = self.spec(name)
            if spec.nesterov and spec.momentum != 0.0 and "momentum" in entry:
                entry["momentum"] = entry["momentum"] / spec.momentum
        self.load_state_dict(state)

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace all state; it is copied into bucket buffers as buckets are next seen."""
        self._state.load_state_dict(state)
        self._buckets.clear()
