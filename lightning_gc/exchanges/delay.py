"""Delayed synchronisation: the exchange of step t runs while step t+1 computes.

With ``delay = d >= 1`` the hook launches a bucket's exchange and returns at once, handing DDP the
average of the exchange launched ``d`` steps earlier (stale-synchronous SGD; OD-SGD, Xu et al.
arXiv:2005.06728, for ``d = 1``). With ``local_update`` each rank also applies its own
contribution at once and swaps it for the average when that arrives (OD-SGD's compensation)::

    returned_t = avg_{t-d}                              (local_update=False)
    returned_t = own_t + avg_{t-d} - own_{t-d}          (local_update=True)

where ``avg_j`` is the decoded average of step ``j``'s exchange and ``own_j`` this rank's own
contribution to it as decoded (zero for ``j`` before the first delayed step). Summed over steps,
every rank applies every average exactly once, ``d`` steps late; with ``local_update`` the ranks
differ only by their last ``d`` own contributions, which :meth:`DelayLine.pending` lets the caller
swap for their averages at the end of training.

Per bucket the line keeps ``d + 1`` bucket-sized slots (``d + 1`` more for ``own``): step ``t``
encodes and decodes into slot ``t mod (d+1)`` and reads slot ``(t-d) mod (d+1)``, so the slot in
flight is never the one read. Only one exchange per bucket is ever in flight: step ``t`` waits for
step ``t-1``'s before compensating, because compressors reuse their buffers across steps (and
PowerSGD commits its residual at decode). The overlap gained is therefore the next step's
forward and backward pass, whatever ``d``. A guarded step (``nonfinite="skip"`` or a grad
scaler) waits for all of them at its first bucket instead, before the guard copies the
compressor state aside, so the backward pass of the next step is not overlapped.

With ``find_unused_parameters`` a parameter can be unused on every rank in the step that would
apply its average; DDP then leaves its gradient alone, and the average would be lost. The line
(``carry_unused``) carries it instead, per parameter, and adds it to what the next step that uses
the parameter applies (or to what :meth:`DelayLine.pending` owes at the end). The carry has two
slots by step parity, step ``t`` reading ``(t-1) mod 2`` and writing ``t mod 2``, so that a step
skipped and retried (non-finite gradient, grad-scaler overflow) reads the same carry again.

:class:`DelayedExchange` puts a line around any :class:`~lightning_gc.exchanges.base.Exchange`:
it gives each step's job its slot and hands back what the step applies.

Slots are stored by parameter name (:class:`~lightning_gc.common.flatstate.FlatState`): they survive DDP's
bucket rebuild and are saved in checkpoints after draining what is in flight, so a resume continues
exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.common.flatstate import FlatState
from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_bool, check_int
from lightning_gc.exchanges.base import Exchange
from lightning_gc.exchanges.pipeline import BucketJob, BucketStep

CARRY_KINDS = ("carry.0", "carry.1")
"""The state kinds of averages carried past steps that did not use their parameter (by step parity)."""


@dataclass
class DelayedBucket:
    """The slots of one bucket layout and its exchange in flight."""

    layout: BucketLayout
    averages: list[torch.Tensor]
    owns: list[torch.Tensor]
    carries: list[torch.Tensor] = field(default_factory=list)
    in_flight: Future[torch.Tensor] | None = None
    finish: Callable[[], None] | None = None  # work the in-flight exchange still needs from this thread

    def wait(self) -> None:
        """Block until the exchange in flight (if any) has been decoded into its slot (running its
        ``finish`` first: called from the hook's thread, on every rank in the same order)."""
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        if self.in_flight is not None:
            future, self.in_flight = self.in_flight, None
            future.wait()


class DelayLine:
    """Averages handed over ``delay`` steps after their exchange (see the module docstring)."""

    def __init__(self, delay: int, local_update: bool = False, carry_unused: bool = False) -> None:
        self.delay = check_int("delay", delay, 1)
        self.local_update = check_bool("local_update", local_update)
        slots = range(delay + 1)
        self._average_kinds = [f"average.{i}" for i in slots]
        self._own_kinds = [f"own.{i}" for i in slots] if local_update else []
        self._carry_kinds = list(CARRY_KINDS) if check_bool("carry_unused", carry_unused) else []
        self._state = FlatState(self._kinds)
        self._buckets: dict[int, DelayedBucket] = {}

    def drains_for(self, layout: BucketLayout) -> bool:
        """Whether :meth:`bucket` drains every bucket before taking ``layout`` (a new layout)."""
        bucket = self._buckets.get(layout.index)
        return bucket is None or bucket.layout is not layout

    def bucket(self, layout: BucketLayout, like: torch.Tensor) -> DelayedBucket:
        """The slots of ``layout``; a new layout (DDP re-bucketed) first drains every bucket, then
        takes each parameter's slots over by name."""
        bucket = self._buckets.get(layout.index)
        if self.drains_for(layout):
            self.drain()
            # buckets of the old bucketing holding any of these parameters are stale: a rebuild into
            # fewer buckets would otherwise keep some (and their slot buffers) alive
            names = {segment.name for segment in layout.segments}
            for index, old in list(self._buckets.items()):
                if index != layout.index and any(segment.name in names for segment in old.layout.segments):
                    del self._buckets[index]
            flat = self._state.bind(layout, like, self._kinds)
            bucket = DelayedBucket(
                layout=layout,
                averages=[flat[kind] for kind in self._average_kinds],
                owns=[flat[kind] for kind in self._own_kinds],
                carries=[flat[kind] for kind in self._carry_kinds],
            )
            self._buckets[layout.index] = bucket
        return bucket

    @property
    def _kinds(self) -> list[str]:
        return self._average_kinds + self._own_kinds + self._carry_kinds

    def slots(self, step: int) -> tuple[int, int]:
        """(the slot step ``step`` writes, the slot it reads)."""
        return step % (self.delay + 1), (step - self.delay) % (self.delay + 1)

    def hand_over(
        self,
        bucket: DelayedBucket,
        step: int,
        grad: torch.Tensor,
        unused: Sequence[Segment] = (),
        *,
        writable: bool = False,
    ) -> torch.Tensor:
        """What step ``step`` applies (module docstring), as the tensor to hand DDP; the step's own
        exchange must have been launched (its ``own`` slot filled). ``unused``: segments of
        parameters no rank used in this step, whose part is carried to a later step.

        With nothing to add to the average (no ``local_update``, no carry) and ``writable`` false,
        that is the slot itself: DDP copies a hook's result into the parameters' gradients either
        way, so copying it into ``grad`` first would copy the bucket twice. The caller must then
        leave it as it is (a skipped step's retry reads the slot again). Otherwise it is ``grad``,
        written here, which the caller may change (e.g. scale back by a loss scale)."""
        write, read = self.slots(step)
        if not (self.local_update or bucket.carries or unused or writable):
            return bucket.averages[read]
        if self.local_update:  # (avg + own_t) - own_{t-d}: the same rounding as adding to a copy, one pass less
            torch.add(bucket.averages[read], bucket.owns[write], out=grad).sub_(bucket.owns[read])
        else:
            grad.copy_(bucket.averages[read])
        if bucket.carries:
            carried, carry = bucket.carries[(step - 1) % 2], bucket.carries[step % 2]
            grad.add_(carried)
            carry.zero_()
            for segment in unused:  # DDP will not apply these: keep them for the next use
                segment.of(carry).copy_(segment.of(grad))
        elif unused:
            raise RuntimeError("parameters without a gradient need DelayLine(carry_unused=True)")
        return grad

    def drain(self) -> None:
        """Wait for every exchange in flight. A two-level bucket's ``finish`` launches an
        intra-node all-gather, so call this on every rank at the same point (every caller does:
        the hook, a skipped step's roll-back, checkpoints, the end of training)."""
        for bucket in self._buckets.values():
            bucket.wait()

    def pending(self, step: int, since: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """After the last step (``step`` = steps taken), what each delayed step (from step ``since``
        on) whose average was not yet applied still owes, oldest first, by parameter name and
        flat: ``avg_j`` (``avg_j - own_j`` with ``local_update``). What is carried for unused
        parameters is added to the oldest, as training adds a carry to the next step that uses
        the parameter: one dict, so one optimizer step, per owed step (a step of its own would
        apply weight decay and optimizer momentum once more). Read by name, so state loaded from a
        checkpoint and not yet bound to a bucket is owed too. Drains first."""
        self.drain()
        carried: dict[str, torch.Tensor] = {}
        if self._carry_kinds:
            carried = self._state.of_kind(self._carry_kinds[(step - 1) % 2])
            if not any(bool(value.any()) for value in carried.values()):
                carried = {}
        owed_steps = range(max(since, step - self.delay), step)
        if carried and not owed_steps:  # a carry is written by a delayed step, which owes an average
            raise RuntimeError(f"a delayed-average carry with no delayed step owed (step {step}, since {since})")
        for j in owed_steps:
            slot = j % (self.delay + 1)
            owed = self._state.of_kind(self._average_kinds[slot])
            if self.local_update:
                owns = self._state.of_kind(self._own_kinds[slot])
                owed = {name: value - owns[name] for name, value in owed.items()}
            if carried:
                owed = {name: carried[name] + value if name in carried else value for name, value in owed.items()}
                carried = {}
            yield owed

    def discharge(self) -> None:
        """Once what :meth:`pending` owes was applied: nothing is owed any more, so every slot and
        carry starts from zero again (a checkpoint written afterwards must not owe it twice)."""
        self.load_state_dict({})

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's slots by name, after draining (the exchanges in flight are decoded)."""
        self.drain()
        return self._state.state_dict()

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore :meth:`state_dict`'s output. Carries saved by a run that expected unused
        parameters are taken only by a line that carries too, unless they are all zero (nothing
        owed): a line without carries would drop what they owe."""
        if not self._carry_kinds:
            owed = sorted(
                name for name, entry in state.items() if any(t.any() for k, t in entry.items() if k in CARRY_KINDS)
            )
            if owed:
                raise IncompatibleCheckpoint(
                    f"the checkpoint carries delayed averages owed to parameters unused when they were due "
                    f"({', '.join(owed[:5])}{', ...' if len(owed) > 5 else ''}), written with "
                    "find_unused_parameters=True or static_graph=True; this run has neither and would drop them: "
                    "resume with find_unused_parameters=True"
                )
            state = {name: {k: t for k, t in entry.items() if k not in CARRY_KINDS} for name, entry in state.items()}
        self.drain()
        self._state.load_state_dict(state)
        self._buckets.clear()


class DelayedExchange(Exchange):
    """Any exchange, its averages handed over ``line.delay`` steps late (module docstring).

    Each job runs through ``inner`` into this step's slot (``out``; ``own`` with ``local_update``,
    whose hand-over reads it at once, so that job's rounds are not deferred); the returned step's
    :attr:`~lightning_gc.exchanges.pipeline.BucketStep.handed` is what the step applies, already
    resolved, and its ``averaged`` this step's own exchange, in flight until a later step waits.

    Args:
        inner: the exchange that moves each step's rounds.
        line: the slots and what is owed (:class:`DelayLine`).
        before_rebucketing: called before a new layout drains every bucket in flight (the comm
            hook finishes its buckets' deferred rounds there, which the drain waits for).
        on_wait: told the seconds spent waiting for a bucket's previous exchange.
    """

    def __init__(
        self,
        inner: Exchange,
        line: DelayLine,
        *,
        before_rebucketing: Callable[[], None] | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.inner, self.line = inner, line
        self._before_rebucketing, self._on_wait = before_rebucketing, on_wait

    @property
    def knows_own_contribution(self) -> bool:  # type: ignore[override]
        return self.inner.knows_own_contribution

    @property
    def state_shape(self) -> tuple[int, ...]:
        return self.inner.state_shape

    @property
    def seed_view(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.inner.seed_view

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()  # the averages in flight are the line's, checkpointed by its owner

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def snapshot(self, previous: Any = None) -> Any:
        return self.inner.snapshot(previous)

    def restore(self, snapshot: Any) -> None:
        self.inner.restore(snapshot)

    def run(self, job: BucketJob) -> BucketStep:
        line, layout, step = self.line, job.layout, job.step
        if line.drains_for(layout) and self._before_rebucketing is not None:
            self._before_rebucketing()
        delayed = line.bucket(layout, job.grad)
        began = time.perf_counter()
        delayed.wait()  # step - 1's exchange of this bucket: compressors reuse their buffers
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - began)
        write, _ = line.slots(step)
        own = delayed.owns[write] if line.local_update else None
        sent = self.inner.run(
            job.but(out=delayed.averages[write], own=own, defer_rounds=job.defer_rounds and own is None)
        )
        delayed.in_flight, delayed.finish = sent.averaged, sent.finish
        applied = line.hand_over(delayed, step, job.grad, job.absent, writable=job.loss_scale is not None)
        job.memory.restore_loss_scale(applied, job.loss_scale)
        handed: Future[torch.Tensor] = Future()
        handed.set_result(applied)
        sent.handed, sent.finish = handed, None  # the line runs `finish` when it waits
        return sent
