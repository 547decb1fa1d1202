"""One compressed DDP run, whatever drives it: the Lightning strategy is wiring around this.

A front end (``GradientCompressionStrategy`` for the Trainer; Fabric and a plain DDP loop can
call the same points) owns a :class:`CompressionSession` and calls, in order::

    session.attach(ddp_model)                    once DDP has wrapped the model (registers the hook)
    session.start_fit(optimizers, total_steps)   before the first step of a fit (the run's length:
                                                 what the Adam hand-over's "auto" warm-up needs)
    per optimizer step:
        session.before_step(optimizers, grad_scale)
        with session.stepping(optimizers):       around optimizer.step (momentum handed over)
            ... backward (the hook runs), then session.settle(optimizer) -> skip?, then the step
        session.after_step()                     -> the step's gc/* metrics or None
        session.verify(ddp_model)                every verify_every_n_steps: ranks still agree?
    session.finish(ddp_model, optimizers)        when training ends (applies owed delayed averages)
    session.checkpoint_entry(module, ...)        every rank, when a checkpoint is written (DDP's module)
    session.resume(entry, ...)                   before attach, when a checkpoint is loaded

Invariants: the hook state is built once per ``attach``; state restored by :meth:`resume` is taken
over by the next ``attach`` (each fit builds a new hook state); ``totals`` are running sums over
every step of the run, resumed from checkpoints; between steps the compressor holds the ratio its
user set (the Adam hand-over's density floor raises it for each step's exchange only:
:mod:`lightning_gc.runtime.adam_plan`); a resumed run keeps the Adam warm-up it resolved first.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_gc.common.layout import shaped_like
from lightning_gc.common.log import warn_on_rank_zero
from lightning_gc.compressors.base import Compressor
from lightning_gc.core.adam import AdamHandOver
from lightning_gc.core.handover import HandOver, MomentumHandOver
from lightning_gc.core.handover_choice import hand_over_for
from lightning_gc.core.momentum import unwrap_optimizer
from lightning_gc.exchanges.hierarchy import agreed_topology
from lightning_gc.exchanges.hierarchy_sparse import two_level_exchange
from lightning_gc.runtime.adam_plan import AdamPlan, RatioFloor, RunLength, floor_for, plan_adam
from lightning_gc.runtime.checkpoint import IncompatibleCheckpoint, gather_entry, rank_state
from lightning_gc.runtime.consistency import verify_same_parameters, verify_same_setup
from lightning_gc.runtime.hook import CompressionHookState, compression_hook, refuse_sparse_gradients
from lightning_gc.runtime.hook_options import HookOptions
from lightning_gc.runtime.policy import agreed
from lightning_gc.runtime.settings import CompressionSettings
from lightning_gc.runtime.usage import GradientUsage


class CompressionSession:
    """Compressor, memory, hand-over, statistics and checkpoint state of one run.

    Args:
        compressor: the compressor (built and validated).
        settings: everything else the run does (see :class:`~lightning_gc.runtime.settings.CompressionSettings`).
        owner: the front end's name, used in errors.
    """

    def __init__(
        self,
        compressor: Compressor,
        settings: CompressionSettings,
        *,
        owner: str = "GradientCompressionStrategy",
    ) -> None:
        settings.check_compressor(compressor)
        self.compressor = compressor
        self.settings = settings
        self.memory = settings.memory_for(compressor)
        self.owner = owner
        self.hand_over: HandOver = MomentumHandOver(self.memory, settings.momentum, owner)
        self.totals: dict[str, float] = {"steps": 0, "bytes_sent": 0.0, "dense_bytes": 0.0, "skipped_steps": 0}
        self.hook_state: CompressionHookState | None = None
        self._pending_state: dict[str, Any] | None = None
        self._nesterov_times_m = False  # resumed from format 1: Nesterov momenta are m times SGD's buffer
        self.adam_plan: AdamPlan | None = None  # the fit's Adam warm-up (None: no Adam hand-over)
        self._resumed_adam_warmup: int | None = None  # the warm-up a checkpoint's run resolved
        self._floor: RatioFloor | None = None  # the density floor after Adam's freeze

    # ------------------------------------------------------------------ set-up
    def attach(
        self,
        ddp: DistributedDataParallel,
        *,
        find_unused_parameters: bool = False,
        devices_per_node: int | None = None,
    ) -> None:
        """Build the hook state for ``ddp``, check every rank agrees on the set-up, take over state
        from :meth:`resume`, and register the comm hook. ``find_unused_parameters``: what DDP was
        told (parameters without a gradient are then expected, as they are under DDP's
        ``static_graph``, which ``ddp`` says itself). ``devices_per_node``: ranks per
        node, for a two-level ``hierarchy`` (``None``: torchrun's ``LOCAL_WORLD_SIZE``)."""
        refuse_sparse_gradients(ddp.module)
        names = {id(p): (name, order) for order, (name, p) in enumerate(ddp.module.named_parameters())}
        settings = self.settings
        topology = agreed_topology(settings.hierarchy, devices_per_node, ddp.process_group)
        self.release_usage()  # a model attached again (a second fit) is watched once
        # a static graph may leave parameters unused too (the same ones every step)
        find_unused = find_unused_parameters or bool(getattr(ddp, "static_graph", False))
        options = HookOptions(
            min_wire_ratio=settings.min_wire_ratio,
            pays=agreed(settings.compress_when, ddp.process_group),
            nonfinite=settings.nonfinite,
            find_unused_parameters=find_unused,
            delay=settings.delay,
            local_update=settings.local_update,
            sync_warmup_steps=settings.sync_warmup_steps or 0,  # None: a SparsityWarmup may lengthen it
        )
        self.hook_state = CompressionHookState(
            self.compressor,
            self.memory,
            names,
            ddp.process_group,
            options,
            exchange=None if topology is None else two_level_exchange(settings.hierarchy, topology, self.compressor),
            # else DDP refuses unused parameters: no hook per backward
            usage=GradientUsage(ddp.module.parameters()) if find_unused else None,
        )
        self.hook_state.owed_gradient_terms = self.hand_over.owed_gradient_terms
        verify_same_setup(self.description(ddp), ddp.process_group)
        if self._pending_state is None:  # a fit from scratch (a Trainer's second fit builds a new
            # optimizer, whose momentum starts at zero): the last fit's residuals and momenta are not its
            self.memory.load_state_dict({})
            self.compressor.load_state_dict({})
        # the compressed exchange runs among the nodes under a two-level hierarchy
        exchanging = dist.get_world_size(ddp.process_group) if topology is None else topology.nodes
        for inert in self.compressor.inert_settings(exchanging):
            warn_on_rank_zero(f"lightning_gc: {inert}")
        self.take_over_pending(ddp)
        ddp.register_comm_hook(self.hook_state, compression_hook)

    def release_usage(self) -> None:
        """Take the hook state's gradient-usage hooks off the model's parameters."""
        if self.hook_state is not None and self.hook_state.usage is not None:
            self.hook_state.usage.remove()
            self.hook_state.usage = None

    def take_over_pending(self, ddp: DistributedDataParallel) -> None:
        """Load the state :meth:`resume` took from a checkpoint into the hook state (and, saved
        with ``local_update``, this rank's own parameters, which DDP overwrote with rank 0's)."""
        if self._pending_state is None or self.hook_state is None:
            return
        own_parameters = self._pending_state.pop("parameters", None)
        if own_parameters is not None:
            with torch.no_grad():
                for name, param in ddp.module.named_parameters():
                    param.copy_(own_parameters[name])
        self.hook_state.load_state_dict(self._pending_state)
        self._pending_state = None

    def description(self, ddp: DistributedDataParallel) -> dict[str, Any]:
        """What every rank must agree on: compressor, memory settings and the model's parameters."""
        return {
            "compressor": self.compressor.config(),
            "memory": self.memory.config(),
            "strategy": self.settings.shared(),
            "parameters": [
                (name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in ddp.module.named_parameters()
            ],
        }

    def start_fit(
        self, optimizers: Sequence[Any], total_steps: RunLength = None, *, length_hint: str = "pass total_steps=N"
    ) -> None:
        """Pick and check the hand-over for the fit's optimizers (SGD's or Adam's), and hand their
        momentum over (before the first step of a fit). ``total_steps``: the run's optimizer steps
        from step 0 (a number, ``None``/``inf``: unknown, or a function asked only if the Adam
        hand-over needs it); ``length_hint`` tells the user how to give them, in the one-line error
        of an ``"auto"`` warm-up whose run has no known length (:mod:`lightning_gc.runtime.adam_plan`)."""
        self.hand_over.release()
        self._release_floor()
        self._floor, self.adam_plan = None, None
        settings = self.settings

        def adam_warmup_steps() -> int:  # only where Adam's first moment is handed over
            self.adam_plan = plan_adam(
                settings.adam_warmup_steps,
                settings.adam_warmup_fraction,
                total_steps,
                recorded=self._resumed_adam_warmup,
                length_hint=length_hint,
            )
            return self.adam_plan.warmup_steps

        self.hand_over = hand_over_for(
            optimizers,
            self.memory,
            explicit_momentum=settings.momentum,
            adam_warmup_steps=adam_warmup_steps,
            adam_weighting=settings.adam_weighting,
            owner=self.owner,
        )
        self._resumed_adam_warmup = None  # taken (a later fit from scratch resolves its own)
        self.hand_over.check(optimizers, local_update=settings.local_update, delay=settings.delay)
        self.memory.momentum_masking = settings.masking_for(adam=isinstance(self.hand_over, AdamHandOver))
        if isinstance(self.hand_over, AdamHandOver) and self.adam_plan is not None:
            self._floor = floor_for(self.compressor, self.adam_plan, settings.adam_min_sends)
            if self.hook_state is not None:  # every rank must freeze at the same step
                verify_same_setup({"adam_warmup_steps": self.adam_plan.warmup_steps}, self.hook_state.process_group)
        if self.hook_state is not None:
            self.hook_state.exact_steps = self.hand_over.exact_steps()
            self.hook_state.owed_gradient_terms = self.hand_over.owed_gradient_terms
            self.hand_over.refresh(optimizers, self.hook_state.names, step=self.hook_state.step, announce=True)
        if self._nesterov_times_m:  # the momenta are known now: the optimizer's groups named them
            self.memory.divide_nesterov_momentum()
            self._nesterov_times_m = False

    # ------------------------------------------------------------------ each step
    def synchronous_until(self, steps: int) -> None:
        """Make the first ``steps`` optimizer steps synchronous when ``sync_warmup_steps`` was left
        to its default (``None``): a sparsity warm-up calls it as training starts, before any step,
        so that a delay starts at the target density."""
        if self.settings.sync_warmup_steps is None and self.hook_state is not None:
            self.hook_state.sync_warmup_steps = steps

    def before_step(self, optimizers: Sequence[Any], grad_scale: float | None) -> None:
        """Follow momentum a scheduler rewrote; tell the hook the loss scale of this step's gradients."""
        if self.hook_state is None:
            return
        self.hand_over.refresh(optimizers, self.hook_state.names, step=self.hook_state.step, grad_scale=grad_scale)
        self.hook_state.grad_scale = grad_scale
        if self._floor is not None:
            self._floor.hold(self.hook_state.step)

    def _release_floor(self) -> float | None:
        """The user's ratio back after a step; the density floor, if it was in force."""
        return None if self._floor is None else self._floor.release()

    def stepping(self, optimizers: Sequence[Any]) -> AbstractContextManager[Any]:
        """Around the optimizer step: without the momentum the memory applied."""
        return self.hand_over.stepping(optimizers) if self.hook_state is not None else nullcontext()

    def settle(self, optimizer: Any) -> bool:
        """After backward: agree across ranks whether this step is skipped (a non-finite gradient
        under ``nonfinite="skip"``). True when the front end must skip the optimizer step itself;
        under a grad scaler the gradients are made infinite instead, so the scaler skips the step
        and backs off its scale."""
        if self.hook_state is None or not self.hook_state.settle_step():
            return False
        self.totals["skipped_steps"] += 1
        if self.hook_state.grad_scale is None:
            return True
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.fill_(float("inf"))
        return False

    def after_step(self) -> dict[str, float] | None:
        """The step's ``gc/*`` metrics (``None`` when nothing was exchanged), added to ``totals``."""
        if self.hook_state is None:
            return None
        self.hand_over.step_ended()
        floor = self._release_floor()
        metrics = self.hook_state.stats.pop_metrics()
        if metrics is not None:
            if floor is not None:
                metrics["gc/density_floor"] = floor
            self.totals["steps"] += 1
            self.totals["bytes_sent"] += metrics["gc/bytes_sent"]
            self.totals["dense_bytes"] += metrics["gc/dense_bytes"]
        return metrics

    def verify(self, ddp: DistributedDataParallel) -> None:
        """Every ``verify_every_n_steps`` optimizer steps, compare the parameters across ranks."""
        every = self.settings.verify_every_n_steps
        if every and self.hook_state is not None and self.hook_state.step % every == 0:
            verify_same_parameters(ddp.module, self.hook_state.process_group)

    # ------------------------------------------------------------------ the end of training
    def finish(self, ddp: DistributedDataParallel, optimizers: Sequence[Any]) -> None:
        """With a delay, the last ``delay`` steps' averages have not been applied when training
        ends: apply them now, one optimizer step each (momentum-free, as in training), so that
        every rank ends with the same parameters (with ``local_update``, rank 0's: the ranks'
        own-term swaps leave them float rounding apart). Then the hand-over lets go of the model."""
        try:
            self._apply_owed(ddp, optimizers)
            if self.settings.local_update:
                self._take_rank_zeros_parameters(ddp)
        finally:
            self._release_floor()
            self.hand_over.release()
            self.release_usage()

    def _apply_owed(self, ddp: DistributedDataParallel, optimizers: Sequence[Any]) -> None:
        line = None if self.hook_state is None else self.hook_state.delay_line
        if line is None:
            return
        params = dict(ddp.module.named_parameters())
        for owed in line.pending(self.hook_state.step, since=self.hook_state.first_delayed_step()):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            for name, value in owed.items():
                params[name].grad = shaped_like(value, params[name], dtype=params[name].dtype)
            for optimizer in optimizers:
                with self.hand_over.stepping([optimizer]):
                    unwrap_optimizer(optimizer).step()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        line.discharge()

    @staticmethod
    def _take_rank_zeros_parameters(ddp: DistributedDataParallel) -> None:
        """Every rank takes rank 0's parameters (a collective). Each swap of a rank's own term for
        the average, ``(p - own) + own - average``, rounds differently on every rank, so after the
        local update the ranks are float rounding apart, not equal."""
        source = dist.get_global_rank(ddp.process_group, 0)
        with torch.no_grad():
            for param in ddp.module.parameters():
                dist.broadcast(param.data, src=source, group=ddp.process_group)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_entry(
        self, module: torch.nn.Module, optimizer_states: Sequence[dict[str, Any]], *, rank: int, world_size: int
    ) -> dict[str, Any] | None:
        """Every rank's state for the checkpoint (a collective; ``None`` before :meth:`attach`).
        With ``local_update`` each rank's parameters and optimizer states hold its own latest
        terms, and front ends save rank 0's only: they go in too."""
        if self.hook_state is None:
            return None
        local = self.hook_state.state_dict()
        # the memory holds momentum-corrected velocity or plain residuals: read back in the other
        # terms, momentum would be lost or applied twice
        local["resume_settings"] = {"momentum_correction": self.settings.momentum_correction}
        local["resume_settings"] |= self.hand_over.resume_settings(self.hook_state.step)
        if self.settings.local_update:
            local["parameters"] = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
            local["optimizer_states"] = list(optimizer_states)
        entry = gather_entry(
            local,
            group=self.hook_state.process_group,
            rank=rank,
            world_size=world_size,
            compressor=self.compressor.config(),
            totals=self.totals,
        )
        if self.adam_plan is not None:  # a resumed "auto" run keeps it, whatever its own length
            entry["adam_warmup_steps"] = self.adam_plan.warmup_steps
        return entry

    def resume(self, entry: dict[str, Any], *, source: Any, rank: int, world_size: int) -> list[Any] | None:
        """Take this rank's state from a checkpoint entry for the next :meth:`attach`; this
        rank's own optimizer states when they were saved (``local_update``), else ``None``."""
        self._pending_state = rank_state(entry, source=source, rank=rank, world_size=world_size)
        self._nesterov_times_m = entry.get("format") == 1
        saved_compressor = entry.get("compressor", {}).get("name", self.compressor.name)
        if saved_compressor != self.compressor.name:
            raise IncompatibleCheckpoint(
                f"the checkpoint {source}'s compression state was written by compressor {saved_compressor!r} and "
                f"this run uses {self.compressor.name!r}: its residuals and compressor state would not continue "
                f"exactly; resume with compressor {saved_compressor!r}"
            )
        for name, saved in self._pending_state.pop("resume_settings", {}).items():
            if getattr(self.settings, name) != saved:
                raise IncompatibleCheckpoint(
                    f"the checkpoint {source}'s compression memory was written with {name}={saved!r} and this run "
                    f"has {name}={getattr(self.settings, name)!r}: the memory holds its values in that setting's "
                    f"terms; resume with {name}={saved!r}"
                )
        self.totals.update(entry.get("totals", {}))  # the running sums continue where they were
        self._resumed_adam_warmup = entry.get("adam_warmup_steps")
        return self._pending_state.pop("optimizer_states", None)
