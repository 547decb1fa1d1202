"""One rank of the outer-loop Trainer runs (``tests/test_outer_strategy.py``): runs the fits of a
JSON plan in order, saves what each saw to ``<out>/rank<r>.pt``.

Each fit is a dict::

    {"name": str, "strategy": {"kind": "ddp" | "outer", ...kwargs}, "max_epochs": int, "max_steps": int,
     "data": {...DigitsDataModule kwargs}, "limit_train_batches": int, "limit_val_batches": int,
     "trainer": {...more Trainer kwargs}, "checkpoint_dir": str | None, "resume_from": str | None,
     "fp16_scaler": bool}

``fp16_scaler``: precision 16-mixed with a CPU GradScaler whose initial scale differs per rank
(2^(9 + rank), growing every 3 steps), so each rank's scaler state is its own.

The model is the quickstart's digits MLP with one hidden layer of 32 (SGD, momentum 0.9, weight
decay 1e-4), seeded alike on every rank; each rank trains on its own share of the digits.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lightning_gc.integrations.outer import OuterLoopStrategy
from lightning_gc.runtime.teardown import shut_down_process_group
from recipes.quickstart import DigitsClassifier, DigitsDataModule

RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])


def named(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


class Recorder(Callback):
    """At each validation: whether the module holds theta_g (and theta_g,
    theta_r then); after it whether training resumed from this rank's own theta_r."""

    def __init__(self) -> None:
        self.validated_on_global: list[bool] = []
        self.resumed_local: list[bool] = []
        self.differed_before_validation: list[bool] = []
        self.at_validation: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []  # theta_g, theta_r
        self._after_step: dict[str, torch.Tensor] | None = None
        self._validated = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._after_step = named(pl_module)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        outer = getattr(trainer.strategy, "outer", None)
        if outer is not None and not trainer.sanity_checking and not self._validated:
            self.validated_on_global.append(same(outer.global_parameters, named(pl_module)))
            if self._after_step is not None:
                self.differed_before_validation.append(not same(outer.global_parameters, self._after_step))
                self.at_validation.append(
                    ({k: v.clone() for k, v in outer.global_parameters.items()}, self._after_step)
                )
            self._validated = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._validated and self._after_step is not None:
            self.resumed_local.append(same(self._after_step, named(pl_module)))
        self._validated = False


def run_fit(fit: dict[str, Any]) -> dict[str, Any]:
    L.seed_everything(0, workers=True, verbose=False)
    model = DigitsClassifier(hidden=(32,), lr=0.05, momentum=0.9, weight_decay=1e-4)
    spec = dict(fit["strategy"])
    kind = spec.pop("kind")
    strategy = DDPStrategy(**spec) if kind == "ddp" else OuterLoopStrategy(**spec)
    recorder = Recorder()
    plugins = []
    if fit.get("fp16_scaler"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (9 + RANK), growth_interval=3)
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    callbacks: list[Callback] = [recorder]
    if fit.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=fit["checkpoint_dir"], filename="{epoch}", save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=fit.get("max_epochs", 100),
        max_steps=fit.get("max_steps", -1),
        limit_train_batches=fit.get("limit_train_batches", 1.0),
        limit_val_batches=fit.get("limit_val_batches", 0),
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(fit.get("checkpoint_dir")),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        plugins=plugins,
        **fit.get("trainer", {}),
    )
    trainer.fit(model, DigitsDataModule(**fit.get("data", {})), ckpt_path=fit.get("resume_from"))
    result: dict[str, Any] = {"params": named(model), "global_step": trainer.global_step}
    if isinstance(strategy, OuterLoopStrategy):
        assert strategy.outer is not None
        result |= {
            "syncs": strategy.outer.syncs,
            "inner_steps": strategy.outer.inner_steps,
            "global": {k: v.clone() for k, v in strategy.outer.global_parameters.items()},
            "totals": dict(strategy.totals),
            "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("outer/")},
            "validated_on_global": recorder.validated_on_global,
            "differed_before_validation": recorder.differed_before_validation,
            "resumed_local": recorder.resumed_local,
            "at_validation": recorder.at_validation,
            "precision": trainer.precision_plugin.state_dict(),
        }
    return result


def main() -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    results = {fit["name"]: run_fit(fit) for fit in plan["fits"]}
    torch.save(results, os.path.join(plan["out"], f"rank{RANK}.pt"))
    shut_down_process_group()


if __name__ == "__main__":
    main()
