"""PowerSGD (Vogels et al., NeurIPS 2019): a rank-``r`` approximation by one power iteration.

Each compressed tensor is viewed as a matrix ``M`` (first dimension x the rest, ``n x m``) and
keeps a factor ``Q`` (``m x r``) from the previous step (warm start). Per step::

    Q <- orthonormalise(Q)
    P <- M Q                              round 1: all-reduce (sum) of every P of the bucket,
                                          together with the bucket's dense tensors
    P <- orthonormalise(P)                (identical on every rank: P was reduced)
    Q <- M^T P                            round 2: all-reduce of every Q;  Q <- Q / N
    M_hat <- P Q^T                        = P P^T mean_ranks(M): the average, projected on span(P)

Error feedback (on by default, PowerSGD is biased) keeps ``e = M - M_hat`` for the next step,
as torch's ``powerSGD_hook`` does, so residuals depend on the aggregate: memory is told after
decode. A tensor goes dense (all-reduced exactly in round 1) when it is 1-D or when
``(n + m) r * min_compression_rate >= n m``; for the first ``start_iter`` steps every bucket is
all-reduced exactly. Orthonormalisation is a reduced QR in float32; the approximation does not
depend on the signs QR picks for the columns.

Wire bytes per rank: ``(sum of n r + dense elements) + (sum of m r)`` elements of the gradient
dtype, in two all-reduces per bucket. ``Q`` is kept per parameter name, so it survives DDP's bucket
rebuild and is saved in checkpoints; its random start depends only on ``(seed, parameter)`` and
is identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.common.flatstate import copy_into
from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_bool, check_int, check_range
from lightning_gc.compressors.base import EncodeContext, PlannedCompressor
from lightning_gc.compressors.dense import DensePart, decode_whole_bucket, encode_whole_bucket
from lightning_gc.compressors.encoded import Encoded, Payload, Sent
from lightning_gc.compressors.registry import register

_SEED_PARAM, _SEED_STEP = 1_000_003, 7_919


def orthonormalise_(matrix: torch.Tensor) -> torch.Tensor:
    """Replace the columns of ``matrix`` (``rows >= cols``) by an orthonormal basis of their span
    (reduced QR, computed in float32; all-zero columns give valid unit columns, never NaN)."""
    matrix.copy_(torch.linalg.qr(matrix.float(), mode="reduced").Q)
    return matrix


@dataclass(frozen=True)
class _Factor:
    """One compressed tensor: its matrix shape, rank, and where its P and Q sit in the round buffers."""

    segment: Segment
    rows: int
    cols: int
    rank: int
    p_start: int
    q_start: int

    def matrix(self, flat: torch.Tensor) -> torch.Tensor:
        return self.segment.of(flat).view(self.rows, self.cols)

    def p(self, round1: torch.Tensor) -> torch.Tensor:
        return round1[self.p_start : self.p_start + self.rows * self.rank].view(self.rows, self.rank)

    def q(self, round2: torch.Tensor) -> torch.Tensor:
        return round2[self.q_start : self.q_start + self.cols * self.rank].view(self.cols, self.rank)


@dataclass
class _PowerPlan:
    """Sizes and reusable buffers for one bucket layout."""

    layout: BucketLayout
    factors: tuple[_Factor, ...]
    dense: DensePart | None  # its values are the tail of round1
    p_numel: int
    round1: torch.Tensor  # [P of every factor | dense values]
    round2: torch.Tensor  # [Q of every factor]
    sent: torch.Tensor  # what memory subtracts: M_hat where compressed, the velocity where dense


@register
class PowerSGDCompressor(PlannedCompressor[_PowerPlan]):
    """PowerSGD rank-``rank`` compression with warm start, two all-reduces per bucket.

    Args:
        rank: approximation rank ``r`` (>= 1); each tensor uses ``min(n, m, rank)``.
        min_compression_rate: a tensor is compressed only if ``n m > (n + m) r * rate``
            (torch's ``min_compression_rate``), > 0; below 1 a tensor may cost more than dense.
        start_iter: steps all-reduced exactly before compression starts (torch's
            ``start_powerSGD_iter``); PowerSGD needs a few dense steps on some models.
        warm_start: start each step's power iteration from last step's ``Q``; otherwise from a
            fresh random ``Q`` drawn from ``(seed, step, parameter)``.
        seed: seed of the random starting ``Q`` (the same on every rank).
    """

    name = "powersgd"
    commits_after_decode = True
    needs_whole_tensors = True
    arguments = ("rank", "min_compression_rate", "start_iter", "warm_start", "seed")

    def __init__(
        self,
        rank: int = 1,
        *,
        min_compression_rate: float = 2.0,
        start_iter: int = 0,
        warm_start: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.rank = check_int("rank", rank, 1)
        self.min_compression_rate = check_range(
            "min_compression_rate", min_compression_rate, 0.0, None, low_inclusive=False
        )
        self.start_iter = check_int("start_iter", start_iter, 0)
        self.warm_start = check_bool("warm_start", warm_start)
        self.seed = check_int("seed", seed, 0)
        self._q: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ planning
    def factor_shape(self, segment: Segment) -> tuple[int, int, int] | None:
        """``(n, m, r)`` if ``segment`` is compressed, else ``None`` (it is sent dense)."""
        if len(segment.shape) < 2 or segment.numel == 0:
            return None
        rows = segment.shape[0]
        cols = segment.numel // rows
        rank = min(rows, cols, self.rank)
        if (rows + cols) * rank * self.min_compression_rate >= rows * cols:
            return None
        return rows, cols, rank

    def wire_bytes(self, layout: BucketLayout, element_size: int) -> int:
        shapes = [self.factor_shape(s) for s in layout.segments]
        if not any(shapes):
            return layout.numel * element_size
        factor_elements = sum((n + m) * r for n, m, r in filter(None, shapes))
        dense_elements = sum(s.numel for s, shape in zip(layout.segments, shapes) if shape is None)
        return (factor_elements + dense_elements) * element_size

    def build_plan(self, layout: BucketLayout, like: torch.Tensor, world_size: int) -> _PowerPlan:
        factors, dense, p_numel, q_numel = [], [], 0, 0
        for segment in layout.segments:
            shape = self.factor_shape(segment)
            if shape is None:
                dense.append(segment)
                continue
            rows, cols, rank = shape
            factors.append(_Factor(segment, rows, cols, rank, p_start=p_numel, q_start=q_numel))
            p_numel += rows * rank
            q_numel += cols * rank
        round1 = like.new_empty(p_numel + sum(s.numel for s in dense))
        return _PowerPlan(
            layout=layout,
            factors=tuple(factors),
            dense=DensePart.of(dense, like, values=round1[p_numel:]),
            p_numel=p_numel,
            round1=round1,
            round2=like.new_empty(q_numel),
            sent=like.new_empty(layout.numel),
        )

    def initial_q(self, order: int, cols: int, rank: int, step: int = 0) -> torch.Tensor:
        """The random starting ``Q`` (``cols x rank``, float32, CPU) of the parameter at position
        ``order`` in ``named_parameters()``: a pure function of ``(seed, order)`` (and ``step``
        without warm start), identical on every rank."""
        salt = 0 if self.warm_start else step * _SEED_STEP
        generator = torch.Generator().manual_seed(self.seed * _SEED_PARAM + order + salt)
        return torch.randn(cols, rank, generator=generator)

    def _q_for(self, factor: _Factor, like: torch.Tensor, step: int) -> torch.Tensor:
        name = factor.segment.name
        q = self._q.get(name)
        if q is None or not self.warm_start or q.shape != (factor.cols, factor.rank):
            q = self.initial_q(factor.segment.order, factor.cols, factor.rank, step).to(like.device, like.dtype)
            self._q[name] = q
        elif q.device != like.device or q.dtype != like.dtype:
            q = self._q[name] = q.to(like.device, like.dtype)
        return q

    # ------------------------------------------------------------------ the two rounds
    def encode(self, velocity: torch.Tensor, out: torch.Tensor, context: EncodeContext) -> Encoded:
        plan = self.plan(context, velocity)
        if context.step < self.start_iter or not plan.factors:
            return encode_whole_bucket(velocity, out)
        for factor in plan.factors:
            q = orthonormalise_(self._q_for(factor, velocity, context.step))
            torch.matmul(factor.matrix(velocity), q, out=factor.p(plan.round1))
        if plan.dense is not None:
            plan.dense.gather(velocity)
        return Encoded(Payload.all_reduce(plan.round1), next_round=lambda: self._second_round(plan, velocity))

    def _second_round(self, plan: _PowerPlan, velocity: torch.Tensor) -> Encoded:
        """Round 2, once the P's are summed over ranks: ``Q = M^T orthonormalise(P)``."""
        for factor in plan.factors:
            p = orthonormalise_(factor.p(plan.round1))
            torch.matmul(factor.matrix(velocity).t(), p, out=factor.q(plan.round2))
        return Encoded(
            Payload.all_reduce(plan.round2),
            Sent.whole(plan.sent),  # filled by decode: M_hat, and the velocity where dense
            commit_after_decode=True,
            context=(plan, velocity),
        )

    def decode(self, encoded: Encoded, out: torch.Tensor, *, world_size: int) -> None:
        if decode_whole_bucket(encoded, out, world_size):
            return
        plan, velocity = encoded.context
        plan.round2.div_(world_size)
        for factor in plan.factors:
            q = factor.q(plan.round2)
            self._q[factor.segment.name].copy_(q)
            torch.matmul(factor.p(plan.round1), q.t(), out=factor.matrix(out))
        plan.sent.copy_(out)  # e = M - M_hat on compressed tensors ...
        if plan.dense is not None:
            plan.dense.write_mean(out, world_size)
            plan.sent.index_copy_(0, plan.dense.positions, velocity.index_select(0, plan.dense.positions))
            # ... and 0 on dense ones: they left exactly.

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The warm-start factors ``Q`` by parameter name (CPU copies)."""
        return {"q": {name: q.detach().cpu().clone() for name, q in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"q"})
        if unknown:
            raise ValueError(f"unknown powersgd state entries {unknown}; expected ['q']")
        self._q = {name: q.clone() for name, q in state.get("q", {}).items()}

    def snapshot(self, previous: Any = None) -> Any:
        """The factors ``Q`` copied on their device, into ``previous``'s buffers where they fit."""
        kept = previous if isinstance(previous, dict) else {}
        return {name: copy_into(kept.get(name), q) for name, q in self._q.items()}

    def restore(self, snapshot: Any) -> None:
        """``Q`` as :meth:`snapshot` took it, in place; one first drawn since is dropped (drawn again
        alike: :meth:`initial_q` is a function of the seed, parameter and step)."""
        for name in [name for name in self._q if name not in snapshot]:
            del self._q[name]
        for name, copy in snapshot.items():
            self._q[name] = copy_into(self._q.get(name), copy)
