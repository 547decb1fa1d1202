"""One rank of a multi-process test: runs the fits described in a JSON plan, saves what it saw.

Launched by ``tests/conftest.py::run_ranks`` once per rank with ``LOCAL_RANK``/``MASTER_PORT`` set,
the way torchrun or a cluster scheduler launches Lightning, so Lightning uses the processes
as they are (no re-launch). Each fit of the plan is a dict::

    {"strategy": {"kind": "ddp" | "dgc" | "gc", ...strategy kwargs},
     "model": {...DigitsClassifier kwargs}, "data": {...DigitsDataModule kwargs},
     "epochs": int, "seed": int, "warmup": {...SparsityWarmup kwargs} | None,
     "checkpoint_dir": str | None, "resume_from": str | None, "csv_dir": str | None}

and yields, per rank: final parameters, parameters and metrics after every epoch, and the
comm hook's bucket bookkeeping. Results go to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_gc import DGCStrategy, GradientCompressionStrategy, SparsityWarmup
from recipes.quickstart import DigitsClassifier, DigitsDataModule


def flat_parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


class EpochRecorder(Callback):
    """Parameters and logged metrics at the end of every training epoch."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params.append(flat_parameters(pl_module))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


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
    model = DigitsClassifier(**fit.get("model", {}))
    data = DigitsDataModule(**fit.get("data", {}))
    strategy = make_strategy(fit["strategy"])
    recorder = EpochRecorder()
    callbacks: list[Callback] = [recorder]
    if fit.get("warmup") is not None:
        callbacks.append(SparsityWarmup(**fit["warmup"]))
    if fit.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=fit["checkpoint_dir"], filename="{epoch}", save_top_k=-1))
    logger = CSVLogger(fit["csv_dir"], name="", version=0) if fit.get("csv_dir") else False
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
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
    )
    trainer.fit(model, data, ckpt_path=fit.get("resume_from"))
    result: dict[str, Any] = {
        "params": flat_parameters(model),
        "epoch_params": recorder.params,
        "epoch_metrics": recorder.metrics,
        "global_step": trainer.global_step,
    }
    hook = getattr(strategy, "hook_state", None)
    if hook is not None:
        result["buckets"] = sorted(hook.layouts)
        result["layouts_built"] = hook.layouts_built
        result["hook_step"] = hook.step
        result["memory_entries"] = sorted({key for entry in hook.memory.state_dict().values() for key in entry})
    return result


def main() -> None:
    torch.set_num_threads(1)  # two ranks share two cores
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    rank = int(os.environ["LOCAL_RANK"])
    results = [run_fit(fit) for fit in plan["fits"]]
    torch.save(results, os.path.join(plan["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
