"""The DDP communication hook: one bucket of a synchronising backward pass through the pipeline.

Modelled on torch's ``powerSGD_hook``: a state object plus a hook function. The hook works out what
the bucket is (its layout, rebuilt when DDP re-buckets; which parameters got no gradient anywhere;
whether compressing it pays) and hands it to :func:`lightning_gc.exchanges.pipeline.run_bucket`, which runs
screen -> compensate -> encode -> exchange -> decode -> commit with real collectives.

The step counter advances on DDP's last bucket of each synchronising backward pass; it salts the
threshold sample so that a step's selection depends only on (step, parameter), not on how DDP
happened to bucket the parameters. That makes results identical across DDP's bucket rebuild and
across a checkpoint resume (which starts again with DDP's initial bucketing).
"""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_gc.common.errors import IncompatibleCheckpoint
from lightning_gc.common.layout import BucketLayout, Segment
from lightning_gc.common.validation import check_int
from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.simple import NoCompressor
from lightning_gc.core.guard import StepGuard
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.exchanges import comm
from lightning_gc.exchanges.base import Exchange
from lightning_gc.exchanges.delay import DelayedExchange, DelayLine
from lightning_gc.exchanges.pipeline import BucketJob, BucketStep, RoundQueue
from lightning_gc.exchanges.select import CodecAndExchange, exchange_of
from lightning_gc.exchanges.timeline import EXCHANGE
from lightning_gc.exchanges.transport import GroupTransport, Transport
from lightning_gc.exchanges.two_phase import split_server_state
from lightning_gc.runtime.hook_options import DEFAULT_OPTIONS, HookOptions
from lightning_gc.runtime.stats import CompressionStats
from lightning_gc.runtime.usage import GradientUsage

_WHOLE = "whole residuals (hierarchy 'flat' or 'node_sparse')"
"""How a resume error names the compression state of a rank that holds every tensor's residual whole."""


def reaches_wire_ratio(compressor: Compressor, layout: BucketLayout, element_size: int, min_ratio: float) -> bool:
    """Whether ``compressor`` sends at most ``1 / min_ratio`` of the bucket's dense bytes."""
    return layout.numel * element_size >= min_ratio * compressor.wire_bytes(layout, element_size)


class CompressionHookState:
    """Everything the hook needs between calls: compressor, memory, layouts, step and stats.

    Args:
        compressor: encodes/decodes bucket payloads.
        memory: velocity/momentum of this rank.
        names: ``id(param) -> (name, position in named_parameters())`` for the wrapped module.
        process_group: group to communicate over (``None``: the default group).
        exchange: how a bucket's rounds move among the ranks (:mod:`lightning_gc.exchanges.base`):
            default the one the compressor's ``exchange`` argument chooses over ``process_group``
            (:func:`~lightning_gc.exchanges.select.exchange_for`), or a transport over which it
            chooses; a two-level one (:mod:`lightning_gc.exchanges.hierarchy`)
            for ``hierarchy="node"``.
        options: the per-run choices (:class:`~lightning_gc.runtime.hook_options.HookOptions`).
        usage: which parameters got a gradient in each step (needed with
            ``options.find_unused_parameters``; ``None``: read ``param.grad``).

    Attributes:
        exact_steps: steps before this one are averaged exactly as DDP's own all-reduce does
            (``g / N`` summed over ranks), bypassing memory and compressor: a dense warm-up, e.g.
            Adam's before its variance freezes (:mod:`lightning_gc.core.adam`). Set by the session.
        grad_scale: the loss scale of a mixed-precision grad scaler, set by the strategy before
            each step (``None``: none). Memory then works on unscaled gradients (``g / s``) and
            the decoded result is scaled back, so the scaler's unscaling and overflow checks see
            what they expect; non-finite steps are always skipped then, as the scaler expects.
    """

    def __init__(
        self,
        compressor: Compressor,
        memory: CompensationMemory,
        names: dict[int, tuple[str, int]],
        process_group: dist.ProcessGroup | None = None,
        options: HookOptions = DEFAULT_OPTIONS,
        exchange: Exchange | Transport | None = None,
        usage: GradientUsage | None = None,
    ) -> None:
        self.compressor = compressor
        self.options = options
        self.find_unused_parameters = options.find_unused_parameters
        self.usage = usage
        # the hand-over's terms owed by a rank where a parameter went unused (the session sets it)
        self.owed_gradient_terms: Callable[[torch.Tensor, Sequence[tuple[Segment, torch.Tensor]]], None] | None = None
        self.min_wire_ratio = options.min_wire_ratio
        self.pays = options.pays
        self.grad_scale: float | None = None
        self.uncompressed = NoCompressor()
        self.memory = memory
        self.names = names
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # without an exchange given, the codec's `exchange` argument chooses one over the group
        self.exchange = exchange_of(compressor, exchange if exchange is not None else GroupTransport(process_group))
        self.delay_line = (
            DelayLine(options.delay, options.local_update, carry_unused=options.find_unused_parameters)
            if options.delay
            else None
        )
        # the previous step's exchanges must land before the guard snapshots the compressor state,
        # and a skipped step's own before it is rolled back
        self.guard = StepGuard(
            options.nonfinite,
            memory,
            CodecAndExchange(compressor, self.exchange),  # what a skipped step rolls back besides memory
            rank=self.rank,
            any_rank=partial(comm.any_rank, group=process_group),
            drain=None if self.delay_line is None else self.delay_line.drain,
        )
        self._resumed_delayed_since: int | None = None  # a resumed run that was delayed from this step on
        self.sync_warmup_steps = options.sync_warmup_steps
        if options.local_update and not self.exchange.knows_own_contribution:
            raise ValueError(
                "`local_update=True` does not combine with a hierarchical exchange: a rank's own part is a node's sum"
            )
        self.defer_rounds = options.defer_rounds
        self.rounds = RoundQueue()  # buckets whose earlier round is still in flight (defer_rounds)
        self.stats = CompressionStats()
        stats = self.stats
        self.delayed_exchange = (
            None
            if self.delay_line is None
            else DelayedExchange(
                self.exchange,
                self.delay_line,
                before_rebucketing=self.rounds.finish,  # the drain waits for every bucket's exchange
                on_wait=lambda seconds: stats.add(waited=seconds),
            )
        )
        memory.seed_view = self.exchange.seed_view
        self.step = 0
        self._resumed_step = 0  # the step counter a checkpoint restored
        self.exact_steps = 0
        self.layouts: dict[int, BucketLayout] = {}
        self.layouts_built = 0

    def used_here(self, params: list[torch.Tensor]) -> list[bool]:
        """Whether each of a bucket's ``params`` got a gradient on this rank in this synchronised
        step: as :attr:`usage` saw it (autograd, as DDP sees it), which then forgets them; without
        one, whether its ``grad`` is set. Asked once per bucket and step."""
        if self.usage is not None:
            return self.usage.take(params)
        return [param.grad is not None for param in params]

    def unused_everywhere(self, layout: BucketLayout, used_here: list[bool], device: torch.device) -> list[Segment]:
        """The segments of ``layout`` whose parameter got a gradient on no rank (``used_here``:
        :meth:`used_here`'s answer). DDP zeroes the bucket's slot of a parameter unused here, so
        one used elsewhere needs nothing more."""
        if not self.find_unused_parameters:
            return [segment for segment, used in zip(layout.segments, used_here) if not used]
        counts = torch.tensor(used_here, dtype=torch.int32, device=device)
        dist.all_reduce(counts, group=self.process_group)  # every rank, every bucket: same order
        return [segment for segment, count in zip(layout.segments, counts.tolist()) if count == 0]

    def layout_for(self, bucket: dist.GradBucket) -> BucketLayout:
        """The layout of ``bucket``, rebuilt when DDP re-bucketed its parameters."""
        params = bucket.parameters()
        layout = self.layouts.get(bucket.index())
        if layout is None or not layout.matches(params):
            layout = BucketLayout.build(bucket.index(), params, self.names, bucket.buffer().numel())
            self.layouts[bucket.index()] = layout
            self.layouts_built += 1
        return layout

    def compressor_for(self, layout: BucketLayout, element_size: int) -> Compressor:
        """The configured compressor, or exact all-reduce where it would not pay its way."""
        if reaches_wire_ratio(self.compressor, layout, element_size, self.min_wire_ratio) and (
            self.pays is None or self.pays(self.compressor, layout, element_size)
        ):
            return self.compressor
        return self.uncompressed

    def settle_step(self) -> bool:
        """After a synchronising backward pass, on every rank: whether the step is skipped (some
        rank saw a non-finite gradient); memory, compressor state and step counter are then
        rolled back to before it."""
        restored = self.guard.settle()
        if restored is not None:
            self.step = restored
        return restored is not None

    @property
    def sync_warmup_steps(self) -> int:
        """With a delay, the steps before this one are synchronous."""
        return self._sync_warmup_steps

    @sync_warmup_steps.setter
    def sync_warmup_steps(self, steps: int) -> None:
        steps = check_int("sync_warmup_steps", steps, 0)
        since = self._resumed_delayed_since
        if since is not None and steps > self.step:
            raise IncompatibleCheckpoint(
                f"the checkpoint was written at step {self.step} of a run delayed since step {since}: "
                f"sync_warmup_steps={steps} would make steps {self.step} to {steps - 1} synchronous and drop the "
                f"delayed averages in flight; resume with sync_warmup_steps <= {self.step} (the default, None, "
                "takes a SparsityWarmup's length)"
            )
        self._sync_warmup_steps = steps

    def delayed(self, step: int) -> bool:
        """Whether step ``step`` hands over a delayed average."""
        return self.delay_line is not None and step >= self.sync_warmup_steps

    def first_delayed_step(self) -> int:
        """The first step of this run's history that handed over a delayed average (or will):
        what the end of training owes is read from there on (:meth:`DelayLine.pending`). A run
        resumed from a delayed checkpoint was delayed from the step its writer began to be."""
        if self._resumed_delayed_since is not None:
            return self._resumed_delayed_since
        return max(self.sync_warmup_steps, self._resumed_step)

    def state_dict(self) -> dict[str, Any]:
        """This rank's resumable state: step counter, memory, the compressor's own state, the
        exchange's (two-phase server errors) and, with a delay, the averages not yet handed over.
        Exchanges in flight are drained first: their decodes still write memory and state."""
        if self.delay_line is not None:
            self.delay_line.drain()
        state = {"step": self.step, "memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}
        exchange = self.exchange.state_dict()  # the two-phase server errors: this rank's chunks
        if exchange:
            state["exchange"] = exchange
        if self.exchange.state_shape:
            state["hierarchy"] = self.exchange.state_shape
        if self.delay_line is not None:
            state["delay"] = (self.delay_line.delay, self.delay_line.local_update)
            state["delayed"] = self.delay_line.state_dict()
            state["delayed_since"] = self.first_delayed_step()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a delayed run resumes only with the same delay
        settings (the averages in flight belong to particular steps)."""
        saved = tuple(state.get("delay", (0, False)))
        mine = (0, False) if self.delay_line is None else (self.delay_line.delay, self.delay_line.local_update)
        if saved != mine and (saved[0] or state.get("delayed")):
            raise IncompatibleCheckpoint(
                f"the checkpoint was written with (delay, local_update)={saved}, this run has {mine}: the "
                "averages it holds belong to other steps; resume with the same delay settings"
            )
        saved_topology = tuple(state.get("hierarchy", ()))
        topology = self.exchange.state_shape
        if saved_topology != topology:
            raise IncompatibleCheckpoint(
                "the checkpoint's compression state was written with (nodes, devices per node)="
                f"{saved_topology or _WHOLE} and this run is {topology or _WHOLE}: with hierarchy='node' each rank "
                "holds its own piece of every tensor's residual; resume with the same hierarchy and devices per node"
            )
        self.step = self._resumed_step = int(state["step"])
        since = state.get("delayed_since")  # absent before it was saved: not checked
        self._resumed_delayed_since = since if since is not None and self.step > since else None
        self.sync_warmup_steps = self.sync_warmup_steps  # checked against the resumed history
        self.memory.load_state_dict(state["memory"])
        codec, exchange = state.get("compressor", {}), state.get("exchange")
        if exchange is None:  # written before the server errors moved from the codec to the exchange
            codec, exchange = split_server_state(codec)
        self.compressor.load_state_dict(codec)
        self.exchange.load_state_dict(exchange)
        if self.delay_line is not None:
            self.delay_line.load_state_dict(state.get("delayed", {}))


def exchange_failed(rank: int, world_size: int, layout: BucketLayout, step: int, error: Exception) -> RuntimeError:
    """The error a failed collective becomes: which bucket and rank, and the likely cause."""
    return RuntimeError(
        f"lightning_gc: the gradient exchange of bucket {layout.index} ({len(layout.segments)} parameters) failed "
        f"on rank {rank} of {world_size} at step {step}: a peer process died, timed out or the "
        f"network failed. The last checkpoint is untouched; resume from it (at any world size). Cause: {error}"
    )


def exact_average(state: CompressionHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP's own averaging of a bucket, bit for bit: divide by the world size, then all-reduce."""
    grad = bucket.buffer()
    if bucket.is_last():
        state.step += 1
    size = grad.numel() * grad.element_size()
    state.stats.add(bytes_sent=size, dense_bytes=size, elements_sent=grad.numel(), elements_total=grad.numel())
    grad.div_(state.world_size)
    work = dist.all_reduce(grad, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def compression_hook(state: CompressionHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook implementing compressed gradient exchange; register with ``register_comm_hook``.

    (This module avoids ``from __future__ import annotations``: DDP checks these annotations at runtime.)
    """
    try:
        earlier = len(state.rounds)  # earlier buckets' runs waiting for an earlier round (defer_rounds)
        averaged = _compressed(state, bucket)
        # This bucket's first round is out; now the earlier buckets' later rounds, while it travels
        # (every rank launches in this same order). The last bucket's hook has finished them all.
        state.rounds.finish(earlier)
        return averaged
    except BaseException as error:  # nothing left to resume in a later step
        state.rounds.abandon(error)
        raise


def refuse_sparse_gradients(module: torch.nn.Module) -> None:
    """Refuse, naming them, the modules that make sparse gradients (``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True``): DDP hands those to the hook as sparse buckets, and
    every compressor and the compensation memory work on dense bucket buffers."""
    sparse = [
        name
        for name, child in module.named_modules()
        if isinstance(child, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and child.sparse
    ]
    if sparse:
        raise ValueError(
            f"gradient compression works on dense gradients, but {sparse} make sparse ones (sparse=True): "
            "build them with sparse=False (the compressors sparsify the exchange themselves), or train "
            "with plain DDP"
        )


def _compressed(state: CompressionHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    grad = bucket.buffer()
    if grad.layout != torch.strided:  # a sparse gradient from a functional call refuse_sparse_gradients cannot see
        names = [state.names[id(p)][0] for p in bucket.parameters()]
        raise RuntimeError(f"gradient compression works on dense gradients; {names} got a {grad.layout} gradient")
    params = bucket.parameters()
    used_here = state.used_here(params)  # also in exact steps: every synchronised step starts afresh
    if state.step < state.exact_steps:
        return exact_average(state, bucket)
    layout = state.layout_for(bucket)
    absent = state.unused_everywhere(layout, used_here, grad.device)
    if state.owed_gradient_terms is not None and not all(used_here):
        nowhere = {segment.name for segment in absent}
        unused_here = [
            (segment, param)
            for segment, param, used in zip(layout.segments, params, used_here)
            if not used and segment.name not in nowhere
        ]
        if unused_here:
            state.owed_gradient_terms(grad, unused_here)
    step = state.step
    compressor = state.compressor_for(layout, grad.element_size())
    # The callbacks run on the backend's threads and must not hold `state`: it holds the process
    # group, and a thread that drops a group's last reference joins itself in its destructor.
    on_decoded = lambda timeline, stats=state.stats: stats.add(  # noqa: E731
        seconds=timeline.seconds(), waited=timeline.seconds(EXCHANGE)
    )
    failure = lambda error, rank=state.rank, world_size=state.world_size: exchange_failed(  # noqa: E731
        rank, world_size, layout, step, error
    )
    job = BucketJob(
        compressor=compressor,
        memory=state.memory,
        grad=grad,
        layout=layout,
        step=step,
        params=params,
        absent=absent,
        loss_scale=state.grad_scale,
        guard=state.guard,
        on_decoded=on_decoded,
        failure=failure,
        defer_rounds=state.defer_rounds,
    )
    exchange = state.delayed_exchange if state.delayed(step) else state.exchange
    assert exchange is not None
    sent = exchange.run(job)

    stats, numel, dense_bytes = state.stats, grad.numel(), grad.numel() * grad.element_size()

    def count(done: BucketStep) -> None:
        stats.add(
            bytes_sent=done.bytes_sent, dense_bytes=dense_bytes, elements_sent=done.elements_sent, elements_total=numel
        )

    state.rounds.add(sent, count)  # counted once its last round is launched (now, or at a later hook)
    if bucket.is_last():
        state.step += 1
        state.rounds.finish()
    return sent.averaged if sent.handed is None else sent.handed
