"""How each mode exchanges, in one plain ``DistributedDataParallel`` loop (:mod:`.worker`).

* ``dense`` -- DDP's all-reduce; ``noop`` -- DDP with netbench's hook that exchanges nothing (the
  compute reference of the step-time phase and of the performance model, never trained to a target);
* ``fp16_hook`` -- torch's ``fp16_compress_hook``;
* ``powersgd_hook1`` / ``powersgd_hook4`` -- torch's ``powerSGD_hook`` at rank 1 / 4 (dense for the
  first 2 steps, counted as compressed ones; one DDP bucket: netbench's settings, DESIGN.md section 4);
* ``postlocal_sgd`` -- torch's post-local SGD: dense for the first epoch, then local steps and
  torch's ``PeriodicModelAverager`` averaging the parameters every :data:`POSTLOCAL_PERIOD` steps;
* ``dgc`` -- ours, ``lightning_gc.attach(ddp, optimizer, "dgc", compress_ratio=0.001)`` after DGC's
  sparsity warm-up (``PAPER_WARMUP_DENSITIES``, one stage per ``stage_epochs``); ``dgc_delay1`` the
  same with ``delay=1`` (synchronous during the warm-up); ``onebit``, ``powersgd`` -- ours at the
  compressors' defaults (netbench's ``gc_onebit``, ``gc_powersgd``);
* ``diloco_int8``, ``sparseloco`` -- the outer-loop presets (``outer_attach.outer_loop``, no DDP;
  evaluated on the synchronised parameters), where this checkout has them.

Each step has a *kind*, the class of work its time depends on ("step", "density=0.0625",
"average", "sync", ...): the step-time phase times every kind of a mode, and composition sums a
trajectory's steps kind by kind. A :class:`Plan` says when each kind happens; a timing plan
squeezes the schedule so that each kind gets ``kind_steps`` steps after ``offset`` warm-up steps.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

DGC_RATIO = 0.001  # netbench's DGC_MODES["gc_dgc"]
WARMUP_DENSITIES = (0.25, 0.0625, 0.015625, 0.00390625)
"""``lightning_gc.PAPER_WARMUP_DENSITIES`` (whose module imports Lightning; the tests check they agree)."""
POSTLOCAL_PERIOD = 4  # torch's documented example
POWERSGD_HOOK_START = 2  # netbench's start_powerSGD_iter
TIMING_PERIOD = 3  # steps between averages / syncs in a timing run
TIMING_OFFSET = 3  # warm-up steps of a timing run, left out of its medians
NETBENCH_NAMES = {
    "dense": "ddp", "noop": "noop", "fp16_hook": "torch_fp16", "powersgd_hook1": "torch_powersgd1",
    "powersgd_hook4": "torch_powersgd4", "dgc": "gc_dgc", "dgc_delay1": "gc_dgc_delay1", "onebit": "gc_onebit",
    "powersgd": "gc_powersgd",
}  # fmt: skip
"""Each mode's name in ``benchmarks.netbench.predict`` (the performance model's per-step prediction)."""
OUTER_PRESETS = ("diloco_int8", "sparseloco")
REFERENCE = "dense"
FLOOR = "noop"


def outer_available() -> bool:
    return importlib.util.find_spec("lightning_gc.integrations.outer_attach") is not None


def all_modes() -> list[str]:
    """Every mode trained to a target, dense first (``noop`` is timed only)."""
    ours = ["dense", "fp16_hook", "powersgd_hook1", "powersgd_hook4", "postlocal_sgd"]
    ours += ["dgc", "dgc_delay1", "onebit", "powersgd"]
    return ours + (list(OUTER_PRESETS) if outer_available() else [])


@dataclass(frozen=True)
class Plan:
    """When each kind happens, in optimizer steps: DGC's warm-up stages, post-local SGD's switch
    and period, the outer loop's period (``None``: the preset's); ``offset``: steps before them."""

    stage_steps: int
    postlocal_start: int
    postlocal_period: int = POSTLOCAL_PERIOD
    sync_every: int | None = None
    offset: int = 0

    @classmethod
    def training(cls, steps_per_epoch: int, stage_epochs: float) -> Plan:
        return cls(stage_steps=max(1, round(stage_epochs * steps_per_epoch)), postlocal_start=steps_per_epoch)

    @classmethod
    def timing(cls, kind_steps: int, offset: int) -> Plan:
        return cls(kind_steps, offset + kind_steps, TIMING_PERIOD, TIMING_PERIOD, offset)


class Mode:
    """Plain DDP all-reduce; subclasses change the exchange. The loop calls :meth:`setup` once,
    then per step :meth:`before_step`, forward/backward on the returned module, clips when
    :attr:`clips_after_backward`, :meth:`step`; :meth:`finish` at the end."""

    clips_after_backward = True  # the gradient after backward is what the optimizer applies
    ddp_arguments: dict[str, Any] = {}

    def __init__(self, name: str, plan: Plan, cfg: Any) -> None:
        self.name, self.plan, self.cfg = name, plan, cfg

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.ddp = DistributedDataParallel(model, **self.ddp_arguments)
        self.register(self.ddp, optimizer)
        return self.ddp

    def register(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        """Register the comm hook (none: DDP's all-reduce)."""

    def before_step(self, step: int) -> None:
        """Adjust the exchange for ``step`` (e.g. the warm-up's density)."""

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        optimizer.step()

    def kind(self, step: int) -> str:
        return "step"

    def payload_bytes(self) -> int | None:
        """Bytes the mode handed to its collectives so far, where it counts them."""
        return None

    @contextlib.contextmanager
    def evaluated(self, model: nn.Module) -> Iterator[None]:
        """The weights to evaluate are in ``model`` inside this context."""
        yield

    def finish(self) -> None:
        """What the mode still owes at the end (delayed averages, a last sync)."""


class Noop(Mode):
    def register(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        from benchmarks.netbench.modes import noop_hook

        ddp.register_comm_hook(None, noop_hook)


class Fp16Hook(Mode):
    def register(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


class PowerSGDHook(Mode):
    ddp_arguments = {"bucket_cap_mb": 1024}

    def register(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        rank = int(self.name.removeprefix("powersgd_hook"))
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=POWERSGD_HOOK_START)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)


class PostLocalSGD(Mode):
    def register(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        # one process per node: the intra-node all-reduce after the switch is over one rank, i.e. none
        state = post_local.PostLocalSGDState(None, None, self.plan.postlocal_start, post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, post_local.post_localSGD_hook)
        self.averager = PeriodicModelAverager(period=self.plan.postlocal_period, warmup_steps=self.plan.postlocal_start)

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        optimizer.step()
        self.averager.average_parameters(self.ddp.module.parameters())

    def kind(self, step: int) -> str:
        start = self.plan.postlocal_start
        if step < start:
            return "dense"
        return "average" if (step - start) % self.plan.postlocal_period == 0 else "local"


class Ours(Mode):
    """``lightning_gc.attach``: netbench's ``gc_<name>`` arguments, the task's clipping (local,
    as DGC clips) and masking; DGC with the sparsity warm-up; ``_delay1``: ``delay=1``."""

    clips_after_backward = False

    def register(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        from lightning_gc import attach

        self.dgc = self.name.startswith("dgc")
        self.delay = 1 if self.name.endswith("_delay1") else 0
        kwargs: dict[str, Any] = {"clip_norm": self.cfg.clip_norm}
        if self.dgc:
            kwargs.update(compress_ratio=DGC_RATIO, momentum_masking=self.cfg.momentum_masking)
        if self.delay:
            kwargs.update(delay=self.delay, sync_warmup_steps=self.warmup_steps())
        self.gc = attach(ddp, optimizer, "dgc" if self.dgc else self.name, **kwargs)

    def densities(self) -> tuple[float, ...]:
        return tuple(max(d, DGC_RATIO) for d in WARMUP_DENSITIES) if self.dgc else ()

    def warmup_steps(self) -> int:
        return self.plan.offset + len(self.densities()) * self.plan.stage_steps

    def density(self, step: int) -> float:
        stage = max(0, step - self.plan.offset) // self.plan.stage_steps
        densities = self.densities()
        return densities[stage] if stage < len(densities) else DGC_RATIO

    def before_step(self, step: int) -> None:
        if self.dgc:
            self.gc.compress_ratio = self.density(step)

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.gc.step()

    def kind(self, step: int) -> str:
        if not self.dgc:
            return "step"
        delayed = "delayed, " if self.delay and step >= self.warmup_steps() else ""
        return f"{delayed}density={self.density(step):g}"

    def payload_bytes(self) -> int | None:
        return int(self.gc.totals["bytes_sent"])

    def finish(self) -> None:
        self.gc.finish()


class Outer(Mode):
    """An outer-loop preset: no DDP, local inner steps, a compressed sync every ``sync_every``."""

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        from lightning_gc.integrations.outer_attach import outer_loop

        every = {} if self.plan.sync_every is None else {"sync_every": self.plan.sync_every}
        self.model, self.outer = model, outer_loop(model, self.name, **every)
        self.synced: dict[int, bool] = {}
        return model

    def step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        optimizer.step()
        self.synced[step] = bool(self.outer.inner_step_done())

    def kind(self, step: int) -> str:
        return "sync" if self.synced.get(step) else "inner"

    def payload_bytes(self) -> int | None:
        return int(self.outer.bytes_sent)

    def evaluated(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Evaluate theta_g, the synchronised parameters (between syncs the model holds this rank's)."""
        return self.outer.global_weights()

    def finish(self) -> None:
        if self.outer.sync():  # exchanges in flight and the steps since each fragment's last sync
            self.synced[max(self.synced, default=0)] = True


def make(name: str, plan: Plan, cfg: Any) -> Mode:
    """The mode called ``name`` (module docstring)."""
    if name == "dense":
        return Mode(name, plan, cfg)
    classes = {"noop": Noop, "fp16_hook": Fp16Hook, "postlocal_sgd": PostLocalSGD}
    if name in classes:
        return classes[name](name, plan, cfg)
    if name in ("powersgd_hook1", "powersgd_hook4"):
        return PowerSGDHook(name, plan, cfg)
    if name in ("dgc", "dgc_delay1", "onebit", "powersgd"):
        return Ours(name, plan, cfg)
    if name in OUTER_PRESETS and outer_available():
        return Outer(name, plan, cfg)
    raise ValueError(f"unknown mode {name!r}; modes are {[*all_modes(), FLOOR]}")


def timing_steps(name: str, kind_steps: int, offset: int) -> int:
    """Steps a timing run of ``name`` needs so that each of its kinds gets ``kind_steps`` steps."""
    if name.startswith("dgc"):
        return offset + 5 * kind_steps  # four warm-up densities and the target (delayed, for delay1)
    if name == "postlocal_sgd":
        return offset + kind_steps + (TIMING_PERIOD + 1) * kind_steps
    if name in OUTER_PRESETS:
        return offset + TIMING_PERIOD * kind_steps
    return offset + kind_steps
