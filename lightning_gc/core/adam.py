"""The Adam/AdamW hand-over: Adam's first moment handed over to the compression memory over a
frozen second moment (momentum correction; the interface is :class:`lightning_gc.core.handover.HandOver`).

**Adam / AdamW** (:class:`AdamHandOver`, frozen-variance compressed momentum as in 1-bit Adam,
Tang et al. 2021, with DGC's sparsification in place of 1-bit codes): for the first
``warmup_steps`` optimizer steps the gradients are averaged exactly as DDP does and the optimizer
runs untouched. Then the second moment ``v`` is frozen, the first moment is handed to the memory
preconditioned by the frozen denominator ``d = sqrt(v / (1 - b2^T)) + eps`` (where ``v`` is still 0,
the tensor's mean ``sqrt(v_hat)``: see :meth:`AdamHandOver._freeze`): ``u <- exp_avg / d``
once, then ``u <- b1 u + (1 - b1)(g + wd p) / d`` (the decay only for Adam's L2 form). Each step,
with ``M'`` the decoded average of what the ranks sent and ``t`` Adam's step::

    p <- p (1 - lr wd)                                     AdamW's decoupled decay
    p <- p - lr / (1 - b1^t) * M'                          = Adam's update with m = M' d over frozen v
    exp_avg <- M' d;  exp_avg_sq unchanged;  step <- t

Preconditioning is what makes sparsification work here: under Adam every element moves about
``lr`` per step whatever its gradient's size, so the top-k must pick by the preconditioned
momentum; picked by raw magnitude, elements with small gradients wait hundreds of steps and then
jump by hundreds of ``lr`` at once (a 2-rank MLP diverged so at 1 % density). With ``d`` frozen
the recurrence stays linear, so error feedback still loses nothing.

**Weighting** (``adam_weighting``, :data:`ADAM_WEIGHTINGS`): because ``d`` is frozen and the
recurrence is linear, the memory may hold each element scaled by any fixed ``d^a`` without changing
what is eventually applied; only which elements a compressor favours changes. The memory then
takes ``(g + wd p) / d^(1-a)`` (and ``exp_avg / d^(1-a)`` at the freeze), and the step divides the
average by ``d^a`` before applying it (``exp_avg <- M' d^(1-a)``). With ``V`` an element's pending
Adam step (in units of ``lr``), top-k then ranks by ``|V| d^a``:

* ``"step"`` (``a = 0``): the largest pending step, whatever its effect on the loss;
* ``"decrease"`` (``a = 1/2``): the largest first-order loss decrease. The pending step's gradient
  sum is ``G = V d``, so applying it lowers the loss by about ``G V = d V^2``: ranking by
  ``|V| sqrt(d)`` ranks by that decrease;
* ``"gradient"`` (``a = 1``): the largest accumulated gradient, as SGD's DGC ranks (the
  divergence above).

Under SGD (``d = 1``) the three coincide: SGD's DGC already ranks by loss decrease, and
``"decrease"`` is that rule carried over to Adam's metric. It helps top-k (DGC); a compressor that
sends every element (onebit) has nothing to rank and only sees its scales skewed, so the default
stays ``"step"`` (benchmarks/RESULTS.md, "What top-k ranks by").

``T`` is the step at which ``v`` froze: its bias correction is the one of its last update (with
``1 - b2^t`` the frozen estimate would shrink as ``t`` grows, raising every effective learning
rate: 2.4x from step 10 to 60). Because ``v`` no longer changes, each element's effective learning
rate is fixed, so what error feedback delays is applied later at the same rate: the reason
compressing Adam's raw gradients (whose ``v`` is computed from compressed values) loses accuracy
and this does not. The optimizer's state stays a valid Adam state throughout: a
checkpoint of the compressed phase loads into plain Adam/AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gc.common.layout import Segment, bucket_order
from lightning_gc.common.log import notify_on_rank_zero
from lightning_gc.core.handover import HandOver, ParamNames, StepStart
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec, unwrap_optimizer

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizers whose first moment this hand-over takes (:func:`lightning_gc.core.handover_choice.hand_over_for`)."""

ADAM_WEIGHTINGS: dict[str, float] = {"step": 0.0, "decrease": 0.5, "gradient": 1.0}
"""``adam_weighting`` choices and their power ``a``: the memory holds each element's pending Adam
step times ``d^a`` (module docstring)."""


def _adam_groups(optimizers: Sequence[Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
    for optimizer in optimizers:
        inner = unwrap_optimizer(optimizer)
        for group in inner.param_groups:
            yield inner, group


def _decoupled(optimizer: Any, group: dict[str, Any]) -> bool:
    """Whether weight decay is AdamW's (decoupled) rather than Adam's L2 term in the gradient."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


@dataclass(frozen=True)
class FrozenScales:
    """One parameter's frozen denominator ``d`` split by a weighting's power ``a``: gradients enter
    the memory divided by ``into = d^(1-a)`` and averages leave it divided by ``out_of = d^a``, so
    every element is divided by ``d`` exactly once. A part that is 1 is ``None`` (no division), and
    at ``a = 1/2`` both parts are the same tensor: one parameter-sized tensor per parameter."""

    into: torch.Tensor | None
    out_of: torch.Tensor | None

    @classmethod
    def split(cls, denominator: torch.Tensor, power: float) -> FrozenScales:
        def part(exponent: float) -> torch.Tensor | None:
            return None if exponent == 0.0 else denominator if exponent == 1.0 else denominator.pow(exponent)

        into = part(1.0 - power)
        return cls(into, into if power == 0.5 else part(power))

    @staticmethod
    def divide(tensor: torch.Tensor, part: torch.Tensor | None) -> torch.Tensor:
        """``tensor / part`` (a new tensor; ``tensor`` itself when ``part`` is 1, i.e. ``None``)."""
        return tensor if part is None else tensor / part


class AdamHandOver(HandOver):
    """Adam's first moment applied by ``memory`` after ``warmup_steps`` dense steps, over a frozen,
    preconditioned second moment (module docstring). Needs exactly one ``torch.optim.Adam``/``AdamW``.

    Args:
        memory: the compensation memory (with momentum correction).
        warmup_steps: optimizer steps of plain, exactly averaged Adam before the variance freezes.
        owner: the front end's name, used in errors.
        weighting: an :data:`ADAM_WEIGHTINGS` name: how the memory weights elements against each
            other (module docstring).
    """

    def __init__(self, memory: CompensationMemory, warmup_steps: int, owner: str, weighting: str = "step") -> None:
        self.memory = memory
        self.warmup_steps = warmup_steps
        self.owner = owner
        self.weighting = weighting
        self.active = False  # set per step: whether this step is compressed (past the warm-up)
        self.compressed_steps = 0  # set per step: compressed steps before this one
        self.scales: dict[torch.Tensor, FrozenScales] = {}  # param -> its frozen d, split by the weighting
        self._hooks: list[Any] = []
        self._loss_scale = 1.0
        self._decayed: set[int] = set()  # ids of parameters whose L2 term entered this step's gradient
        self._decays: dict[int, float] = {}  # id(param) -> Adam's L2 weight decay, once frozen (if not 0)

    def check(self, optimizers: Sequence[Any], *, local_update: bool, delay: int = 0) -> None:
        inner = [unwrap_optimizer(o) for o in optimizers]
        if len(inner) != 1:
            raise ValueError(
                f"the Adam hand-over moves one optimizer's first moment into the compression memory, but the "
                f"model configures {len(inner)} optimizers; use one (param groups for different settings)"
            )
        for _, group in _adam_groups(optimizers):
            for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
                if group.get(flag, False):
                    raise ValueError(
                        f"the Adam hand-over does not support {type(inner[0]).__name__}({flag}=True); "
                        f"set {flag}=False or pass momentum_correction=False to {self.owner}"
                    )
        if delay:
            raise ValueError(
                f"delay={delay} with the Adam hand-over is not supported; use delay=0, or "
                f"momentum_correction=False (plain error feedback under Adam's own state)"
            )

    def exact_steps(self) -> int:
        return self.warmup_steps

    def before_step(self, optimizers: Sequence[Any], names: ParamNames, start: StepStart) -> None:
        """Before step ``start.step``: nothing during the warm-up; from the freeze on, gradients are
        preconditioned by the frozen ``sqrt(v_hat) + eps`` (built again after a resume) and the
        memory's momentum starts, at the freeze, from ``exp_avg`` preconditioned the same way."""
        if start.announce:
            notify_on_rank_zero(
                f"lightning_gc: Adam hand-over: plain Adam for the first {self.warmup_steps} steps (gradients "
                "averaged exactly), then the second moment freezes and the first moment is compressed"
            )
        self.active = start.step >= self.warmup_steps
        self.compressed_steps = max(0, start.step - self.warmup_steps)
        self._loss_scale = 1.0 if start.grad_scale is None else start.grad_scale
        if not self.active:
            self.release()
            self.memory.set_specs({})
            return
        if not self.scales:
            if start.announce:  # the fit's start: Lightning restores a resumed optimizer's state only after it
                return
            self._freeze(optimizers)
        specs, moments = {}, {}
        freezing = start.step == self.warmup_steps  # the freeze: u starts from Adam's first moment
        by_id = {pid: name for pid, (name, _) in names.items()}
        for optimizer, group in _adam_groups(optimizers):
            beta1 = float(group["betas"][0])
            spec = MomentumSpec(momentum=beta1, dampening=beta1)  # Adam's L2 decay is in the gradient hook
            for param in group["params"]:
                name = by_id.get(id(param))
                if name is None or param not in self.scales:
                    continue
                specs[name] = spec
                if freezing and "exp_avg" in optimizer.state[param]:  # else its momentum starts at zero
                    moment = FrozenScales.divide(optimizer.state[param]["exp_avg"], self.scales[param].into)
                    moments[name] = bucket_order(moment, param)
        self.memory.set_specs(specs)
        if freezing:
            self.memory.seed_momentum(moments)

    def _freeze(self, optimizers: Sequence[Any]) -> None:
        """Freeze every Adam parameter's denominator (:func:`frozen_denominators`), split it by the
        weighting, and hook a division by its ``into`` part (adding Adam's L2 decay first) onto its gradient."""
        power = ADAM_WEIGHTINGS[self.weighting]
        for param, (denominator, decay) in frozen_denominators(optimizers, self.compressed_steps).items():
            self.scales[param] = scales = FrozenScales.split(denominator, power)
            if decay != 0.0:
                self._decays[id(param)] = decay
            self._hooks.append(param.register_hook(self._preconditioner(param, scales.into, decay)))

    def _l2_term(self, param: torch.Tensor, decay: float) -> torch.Tensor:
        """Adam's L2 term of ``param``, scaled like the gradient under a grad scaler."""
        return (decay * self._loss_scale) * param.detach()

    def _preconditioner(self, param: torch.Tensor, into: torch.Tensor | None, decay: float) -> Any:
        def precondition(grad: torch.Tensor) -> torch.Tensor:
            # once per optimizer step, not once per backward (accumulated micro-batches each run this hook)
            if decay != 0.0 and id(param) not in self._decayed:
                self._decayed.add(id(param))
                grad = grad + self._l2_term(param, decay)
            return FrozenScales.divide(grad, into)

        return precondition

    def owed_gradient_terms(self, grad: torch.Tensor, unused_here: Sequence[tuple[Segment, torch.Tensor]]) -> None:
        """Adam's preconditioned L2 term ``wd p / d^(1-a)`` of each unused parameter: torch's Adam adds
        ``wd p`` to the averaged gradient of every parameter it steps, so under DDP each rank's
        share of it is in the average, also from a rank where the parameter went unused."""
        for segment, param in unused_here:  # their hooks never ran this step: nothing is in _decayed
            decay = self._decays.get(id(param))
            if decay is None:
                continue
            term = FrozenScales.divide(self._l2_term(param, decay), self.scales[param].into)
            segment.of(grad).add_(bucket_order(term, param))

    def release(self) -> None:
        """Remove the gradient hooks (at the end of a fit, or before a new hand-over)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.scales.clear()
        self._decays.clear()

    def resume_settings(self, step: int) -> dict[str, Any]:
        """Once a step past the freeze ran, the memory holds elements weighted by ``d^a`` (also after
        the fit's end released the hooks): resume with the same weighting."""
        return {"adam_weighting": self.weighting} if step > self.warmup_steps else {}

    def stepping(self, optimizers: Sequence[Any]) -> AbstractContextManager[Any]:
        """Around an optimizer step of the compressed phase: the optimizer's ``step`` is the
        frozen-variance step of the module docstring (the user's precision plugin and grad
        scaler still call it as they would Adam's own)."""
        return _frozen_variance_steps(optimizers, self.scales) if self.active else nullcontext()

    def step_ended(self) -> None:
        """The next step's gradients take Adam's L2 term again (also after a skipped step, whose
        optimizer step never ran)."""
        self._decayed.clear()


def frozen_denominators(
    optimizers: Sequence[Any], compressed_steps: int = 0
) -> dict[torch.Tensor, tuple[torch.Tensor, float]]:
    """Each Adam/AdamW parameter's frozen ``d = sqrt(v / (1 - b2^T)) + eps`` (``T``: the step of v's
    last update, ``compressed_steps`` before the optimizer's count) and its L2 decay (0 for AdamW's
    decoupled form), for the parameters the optimizers have stepped.

    An element whose ``v`` is still 0 never had a gradient during the warm-up (an embedding row
    of a word not yet seen): ``d = eps`` would turn its first gradient into a step of ``lr/eps``.
    It takes its tensor's mean ``sqrt(v_hat)`` instead (or, for a tensor without any gradient
    yet, the mean over all tensors): the same value on every rank, as ``v`` is. A trainable
    parameter Adam never stepped (a module first used after the warm-up) takes that mean too, as a
    0-d tensor; :func:`frozen_variance_step` gives it Adam's state when it is first stepped.

    Raises:
        RuntimeError: no second moment to freeze (no warm-up step updated it: every step skipped
            by a grad scaler, or gradients that were all zero).
    """
    roots: dict[torch.Tensor, tuple[torch.Tensor, float, float]] = {}
    unstepped: list[tuple[torch.Tensor, float, float]] = []
    for optimizer, group in _adam_groups(optimizers):
        beta2, eps = float(group["betas"][1]), float(group["eps"])
        decay = 0.0 if _decoupled(optimizer, group) else float(group["weight_decay"])
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "exp_avg_sq" not in state:
                if param.requires_grad:
                    unstepped.append((param, eps, decay))
                continue
            frozen_at = float(state["step"]) - compressed_steps
            # a state begun after the freeze (frozen_variance_step) holds v = 0: no correction to take
            correction = 1 - beta2**frozen_at if frozen_at >= 1 else 1.0
            roots[param] = (state["exp_avg_sq"].sqrt() / math.sqrt(correction), eps, decay)
    seen = [root[root > 0] for root, _, _ in roots.values()]
    if not any(s.numel() for s in seen):
        raise RuntimeError(
            "the Adam hand-over freezes the second moment, but Adam holds none yet: no warm-up step "
            "updated it (every step skipped, e.g. by a grad scaler's overflows, or all-zero gradients); "
            "raise adam_warmup_steps"
        )
    overall = torch.cat(seen).mean()
    frozen = {}
    for param, (root, eps, decay) in roots.items():
        unseen = root == 0
        if unseen.any():
            root = torch.where(unseen, root[~unseen].mean() if not unseen.all() else overall, root)
        frozen[param] = (root.add_(eps), decay)
    for param, eps, decay in unstepped:
        frozen[param] = (overall + eps, decay)
    return frozen


@contextmanager
def _frozen_variance_steps(optimizers: Sequence[Any], scales: dict[torch.Tensor, FrozenScales]) -> Iterator[None]:
    inner = [unwrap_optimizer(o) for o in optimizers]
    # An LR scheduler wraps the instance's ``step`` to record that it ran: keep that wrapper to restore.
    saved = [o.__dict__.get("step") for o in inner]
    for optimizer in inner:
        optimizer.step = _frozen_step_of(optimizer, scales)
    try:
        yield
    finally:
        for optimizer, step in zip(inner, saved):
            if step is None:
                del optimizer.step
            else:
                optimizer.step = step


def _frozen_step_of(optimizer: Any, scales: dict[torch.Tensor, FrozenScales]) -> Any:
    def step(closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen_variance_step(optimizer, scales)
        optimizer._opt_called = True  # what a scheduler's own wrapper records (no "step order" warning)
        return loss

    return step


@torch.no_grad()
def frozen_variance_step(optimizer: Any, scales: dict[torch.Tensor, FrozenScales]) -> None:
    """One Adam/AdamW step with ``p.grad`` the averaged, weighted compressed momentum
    ``M' = M / d^(1-a)`` (``d`` the frozen ``sqrt(v_hat) + eps``, split by ``scales[p]``;
    ``a = 0`` unless a weighting says otherwise)::

        p <- p (1 - lr wd)   (AdamW);   p <- p - lr / (1 - b1^t) * M' / d^a;   exp_avg <- M' d^(1-a);   step <- t
    """
    for group in optimizer.param_groups:
        beta1 = float(group["betas"][0])
        lr, decay = float(group["lr"]), float(group["weight_decay"])
        decoupled = _decoupled(optimizer, group)
        for param in group["params"]:
            if param.grad is None or param not in scales:
                continue
            state, scale = optimizer.state[param], scales[param]
            if "step" not in state:  # first stepped after the freeze: Adam's state begins, as Adam's own would
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            if decoupled and decay != 0.0:
                param.mul_(1 - lr * decay)
            param.add_(FrozenScales.divide(param.grad, scale.out_of), alpha=-lr / (1 - beta1**t))
            if scale.into is None:
                state["exp_avg"].copy_(param.grad)
            else:
                torch.mul(param.grad, scale.into, out=state["exp_avg"])
