"""One rank of a multi-process test: runs the fits described in a JSON plan, saves what it saw.

Launched by ``tests/conftest.py::run_ranks`` once per rank with ``RANK``/``LOCAL_RANK``/``MASTER_PORT`` set,
the way torchrun or a cluster scheduler launches Lightning, so Lightning uses the processes
as they are (no re-launch). Each fit of the plan is a dict::

    {"strategy": {"kind": "ddp" | "dgc" | "gc", ...strategy kwargs},
     "rank_strategy": {"<rank>": {...strategy kwargs overriding "strategy" on that rank}},
     "model": {...DigitsClassifier kwargs},
     "variant": "groups" | "unused" | "used_on_one_rank" | "evaluable" | "rewrites_optimizer"
                | "frozen_adamw_reference" | None,
     "data": {...DigitsDataModule kwargs},
     "epochs": int, "seed": int, "warmup": {...SparsityWarmup kwargs} | None,
     "checkpoint_dir": str | None, "resume_from": str | None, "csv_dir": str | None,
     "trainer": {...extra Trainer kwargs: precision, accumulate_grad_batches, gradient_clip_val;
                 "fp16_with_scaler": true for fp16 autocast with a GradScaler on the CPU},
     "faults": [{"rank": r, "step": s, "kind": "kill" | "nan" | "perturb"}],
     "after_fit": bool (run validate, test and predict after fit),
     "refit": {"epochs": int, "resume_from": str | absent} (then fit again on the same Trainer),
     "save_after_fit": str (then ``trainer.save_checkpoint`` to that path, on every rank)}

Faults happen at the start of global step ``s`` on rank ``r``: ``kill`` SIGKILLs the process,
``nan`` makes the first layer's gradient NaN for that step, ``perturb`` nudges a weight on that
rank only (a silent divergence).

and yields, per rank: final parameters, parameters and metrics after every epoch, and the
comm hook's bucket bookkeeping. Results go to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lightning_gc import DGCStrategy, GradientCompressionStrategy, SparsityWarmup
from lightning_gc.runtime.teardown import shut_down_process_group
from recipes.quickstart import NUM_CLASSES, DigitsClassifier, DigitsDataModule

# as the launcher set them (Lightning rewrites WORLD_SIZE and friends once a fit has run)
RANK, WORLD_SIZE, DEVICES_PER_NODE = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


class EpochRecorder(Callback):
    """Parameters and logged metrics at the end of every training epoch, and the parameters a
    callback sees at the end of training."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []
        self.steps: list[dict[str, Any]] = []
        self.at_train_end: torch.Tensor | None = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params.append(flat_parameters(pl_module))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_train_end = flat_parameters(pl_module)  # what a callback sees there (e.g. weight averaging)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # each step's gc/* metrics, and the ratio the compressor shows between steps
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gc/")}
        adjustable = getattr(trainer.strategy, "adjustable", None)
        self.steps.append({**metrics, "compress_ratio": getattr(adjustable, "compress_ratio", None)})


class FaultInjector(Callback):
    """Injects the plan's faults on this rank (see the module docstring)."""

    def __init__(self, faults: list[dict[str, Any]], rank: int) -> None:
        self.faults = {f["step"]: f["kind"] for f in faults if f["rank"] == rank}
        self.handle: Any = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        kind = self.faults.get(trainer.global_step)
        first = next(pl_module.parameters())
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "nan":
            self.handle = first.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        elif kind == "perturb":
            with torch.no_grad():
                first.add_(1e-3)

    def on_train_batch_end(self, *args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class GroupsAndScheduler(DigitsClassifier):
    """Two param groups (different LR and weight decay) and a step LR schedule."""

    def configure_optimizers(self) -> Any:
        h = self.hparams
        first, rest = list(self.net[0].parameters()), [p for layer in self.net[1:] for p in layer.parameters()]
        optimizer = torch.optim.SGD(
            [{"params": first, "lr": h.lr * 0.5, "weight_decay": 0.0}, {"params": rest}],
            lr=h.lr,
            momentum=h.momentum,
            weight_decay=h.weight_decay,
        )
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10, gamma=0.5)}


class WithUnusedLayer(DigitsClassifier):
    """Has a layer that forward never uses (needs ``find_unused_parameters=True``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.unused = torch.nn.Linear(64, 64)


class UsedOnOneRankAtATime(DigitsClassifier):
    """An extra layer each rank uses on alternate batches: every step it is unused on one rank
    (its gradient there is None) and used on the other (needs ``find_unused_parameters=True``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = torch.nn.Linear(NUM_CLASSES, NUM_CLASSES)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if (batch_idx + self.global_rank) % 2 == 1:
            out = self.extra(out)
        loss = torch.nn.functional.cross_entropy(out, y)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss


class Evaluable(DigitsClassifier):
    """Adds test and predict steps, for ``Trainer.test``/``predict`` after a compressed fit."""

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test/loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)


class RewritesItsOptimizer(DigitsClassifier):
    """What hand-written schedules do to SGD's groups: momentum cycled between 0.95 and 0.5 from
    global step 2 (OneCycleLR's ``cycle_momentum`` moves it every step), weight decay raised to
    1e-2 from step 5, momentum set to 0 from step 12."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        for group in self.trainer.optimizers[0].param_groups:
            if step >= 5:
                group["weight_decay"] = 1e-2
            if step >= 12:
                group["momentum"] = 0.0
            elif step >= 2:
                group["momentum"] = 0.5 if step % 2 else 0.95


class FrozenVarianceAdamW(torch.optim.AdamW):
    """Reference, written independently of lightning_gc.core.adam: AdamW for the first
    ``freeze_after`` steps, then ``exp_avg <- b1 exp_avg + (1 - b1) g`` over the second moment
    as it was (bias-corrected as at the freeze; where it is 0, the tensor's mean), with AdamW's
    decoupled decay."""

    def __init__(self, params: Any, freeze_after: int, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.freeze_after = freeze_after
        self.steps_taken = 0

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps_taken += 1
        if self.steps_taken <= self.freeze_after:
            super().step()
            return loss
        with torch.no_grad():
            for group in self.param_groups:
                (b1, b2), lr = group["betas"], group["lr"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    state["step"] += 1
                    t = float(state["step"])
                    p.mul_(1 - lr * group["weight_decay"])
                    state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                    root = state["exp_avg_sq"].sqrt() / (1 - b2**self.freeze_after) ** 0.5
                    if (root == 0).any() and (root > 0).any():  # never had a gradient: the tensor's typical
                        root = torch.where(root == 0, root[root > 0].mean(), root)
                    denom = root + group["eps"]
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**t))
        return loss


class FrozenAdamWReference(DigitsClassifier):
    """DigitsClassifier trained by :class:`FrozenVarianceAdamW` (``freeze_after`` in the model kwargs)."""

    def __init__(self, freeze_after: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.freeze_after = freeze_after

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return FrozenVarianceAdamW(self.parameters(), self.freeze_after, lr=h.lr, weight_decay=h.weight_decay)


class ConvNet(DigitsClassifier):
    """Two convolutions over the 8 x 8 digit, in ``channels_last`` memory format when asked (DDP
    lays such a weight's gradient out in its bucket as N, H, W, C)."""

    def __init__(self, channels_last: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 8, 8)),
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 8 * 8, NUM_CLASSES),
        )
        if channels_last:
            self.net.to(memory_format=torch.channels_last)


VARIANTS = {
    "conv": ConvNet,
    "frozen_adamw_reference": FrozenAdamWReference,
    None: DigitsClassifier,
    "groups": GroupsAndScheduler,
    "unused": WithUnusedLayer,
    "evaluable": Evaluable,
    "rewrites_optimizer": RewritesItsOptimizer,
    "used_on_one_rank": UsedOnOneRankAtATime,
}


def make_strategy(spec: dict[str, Any]) -> DDPStrategy:
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "ddp":
        return DDPStrategy(**spec)
    if kind == "dgc":
        return DGCStrategy(**spec)
    if kind == "gc":
        return GradientCompressionStrategy(**spec)
    raise ValueError(f"unknown strategy kind {kind!r}")


def run_fit(fit: dict[str, Any]) -> dict[str, Any]:
    L.seed_everything(fit.get("seed", 0), workers=True, verbose=False)
    rank = RANK
    model = VARIANTS[fit.get("variant")](**fit.get("model", {}))
    data = DigitsDataModule(**fit.get("data", {}))
    strategy = make_strategy({**fit["strategy"], **fit.get("rank_strategy", {}).get(str(rank), {})})
    recorder = EpochRecorder()
    callbacks: list[Callback] = [recorder, FaultInjector(fit.get("faults", []), rank)]
    if fit.get("warmup") is not None:
        callbacks.append(SparsityWarmup(**fit["warmup"]))
    if fit.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=fit["checkpoint_dir"], filename="{epoch}", save_top_k=-1))
    logger = CSVLogger(fit["csv_dir"], name="", version=0) if fit.get("csv_dir") else False
    trainer_kwargs = dict(fit.get("trainer", {}))
    if trainer_kwargs.pop("fp16_with_scaler", False):  # Lightning turns "16-mixed" into bf16 on CPU
        trainer_kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES_PER_NODE,
        num_nodes=WORLD_SIZE // DEVICES_PER_NODE,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=fit["epochs"],
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=bool(fit.get("checkpoint_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
        limit_val_batches=fit.get("limit_val_batches", 0),
        **trainer_kwargs,
    )
    trainer.fit(model, data, ckpt_path=fit.get("resume_from"))
    if fit.get("refit"):  # a second fit on the same Trainer (resuming a checkpoint, or not)
        trainer.fit_loop.max_epochs = fit["refit"]["epochs"]
        trainer.fit(model, data, ckpt_path=fit["refit"].get("resume_from"))
    if fit.get("save_after_fit"):
        trainer.save_checkpoint(fit["save_after_fit"])
    result: dict[str, Any] = {}
    if fit.get("after_fit"):
        result["validate"] = trainer.validate(model, data.val_dataloader(), verbose=False)
        result["test"] = trainer.test(model, data.val_dataloader(), verbose=False)
        result["predict"] = trainer.predict(model, data.val_dataloader())
    result |= {
        "params": flat_parameters(model),
        "epoch_params": recorder.params,
        "train_end_params": recorder.at_train_end,
        "epoch_metrics": recorder.metrics,
        "global_step": trainer.global_step,
    }
    hook = getattr(strategy, "hook_state", None)
    if hook is not None:
        result["buckets"] = sorted(hook.layouts)
        result["layouts_built"] = hook.layouts_built
        result["hook_step"] = hook.step
        result["memory_entries"] = sorted({key for entry in hook.memory.state_dict().values() for key in entry})
        result["memory"] = hook.memory.state_dict()
        result["totals"] = dict(strategy.totals)
        result["grad_scale"] = hook.grad_scale
        plan = strategy.session.adam_plan  # the Adam hand-over's resolved warm-up (None: SGD's hand-over)
        result["adam_plan"] = None if plan is None else (plan.warmup_steps, plan.total_steps, plan.source)
        result["step_metrics"] = recorder.steps
    state = trainer.optimizers[0].state
    result["exp_avg_sq"] = [state[p]["exp_avg_sq"].clone() for p in model.parameters() if "exp_avg_sq" in state[p]]
    result["exp_avg"] = [state[p]["exp_avg"].clone() for p in model.parameters() if "exp_avg" in state[p]]
    return result


def main() -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank = RANK
    results = [run_fit(fit) for fit in plan["fits"]]
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))
    shut_down_process_group()  # also after Lightning's own DDPStrategy, which leaves gloo's group up


if __name__ == "__main__":
    main()
