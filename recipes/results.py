"""One result file per run: what a run measured, written by rank 0 when fitting ends.

``result.json`` (and a one-row ``result.csv``) in the run's directory hold:

- ``metric`` / ``metric_name`` / ``metric_mode``: the task's final validation metric and whether
  higher (``"max"``) or lower (``"min"``) is better; ``null`` when validation never ran;
- ``strategy`` / ``compressor``: the strategy's class and the compressor's name (``null`` for
  dense DDP);
- ``compress_ratio``: the strategy's configured ratio (the target after any warm-up), ``null`` for
  strategies without one (dense DDP, quantisers, PowerSGD); ``final_ratio``: the ratio in force
  at the last step (above the target when the run ended inside the warm-up);
- ``bytes_sent`` / ``dense_bytes``: per-rank sums over the fit of the bytes handed to collectives
  and of the bytes plain DDP would have all-reduced; ``wire_compression = dense_bytes / bytes_sent``
  (1 for dense DDP, whose ``bytes_sent`` is the dense gradient bytes times the steps), and
  ``last_step_wire_compression`` the last step's (after any sparsity warm-up);
- ``test_metric`` / ``test_metric_name``: with ``test_after_fit=true``, the final model's metric
  on the data's test split (absent otherwise);
- ``curve``: ``[epoch, global step, metric]`` after each validation run of the fit (sanity checks
  excluded), for learning curves;
- ``step_time_s``: median wall time between the ends of consecutive training batches within an
  epoch (data loading included; each epoch's first batch excluded), and
  ``samples_per_s = batch_size * world_size / step_time_s`` across all processes.

The app prints one summary line per run (:func:`summary_line`).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

RESULT_FILE = "result.json"


def _number(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


class RunRecorder(Callback):
    """Measure a fit and write its ``result.json`` / ``result.csv`` into ``out_dir`` (rank 0).

    Args:
        out_dir: the run's directory.
        info: fields copied into the result as they are (e.g. ``name``, ``overrides``).
        metric_name, metric_mode: the metric to report; default: the module's ``metric_name`` /
            ``metric_mode`` attributes.
    """

    def __init__(
        self,
        out_dir: str | Path,
        info: dict[str, Any] | None = None,
        metric_name: str | None = None,
        metric_mode: str | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.info = dict(info or {})
        self.metric_name, self.metric_mode = metric_name, metric_mode
        self.intervals: list[float] = []
        self._last_end: float | None = None
        self._start = 0.0
        self.target_ratio: float | None = None
        self.curve: list[tuple[int, int, float | None]] = []
        self.result: dict[str, Any] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        adjustable = getattr(trainer.strategy, "adjustable", None)
        ratio = None if adjustable is None else adjustable.compress_ratio
        self.target_ratio = None if ratio is None else float(ratio)
        self.metric_name = self.metric_name or getattr(pl_module, "metric_name", "val/loss")
        self.metric_mode = self.metric_mode or getattr(pl_module, "metric_mode", "min")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self.intervals.append(now - self._last_end)
        self._last_end = now

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None  # validation inside an epoch is not a training step

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metric = trainer.callback_metrics.get(self.metric_name)
        if not trainer.sanity_checking and metric is not None:
            self.curve.append((trainer.current_epoch, trainer.global_step, _number(metric)))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        steps = trainer.global_step
        totals = getattr(trainer.strategy, "totals", None)
        if totals is not None and totals["bytes_sent"] > 0:
            sent, dense = float(totals["bytes_sent"]), float(totals["dense_bytes"])
        else:  # plain DDP all-reduces every gradient element every step
            dense = float(sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad) * steps)
            sent = dense
        step_time = statistics.median(self.intervals) if self.intervals else None
        batch_size = getattr(trainer.datamodule, "batch_size", None) if trainer.datamodule is not None else None
        metric = trainer.callback_metrics.get(self.metric_name)
        last_ratio = trainer.callback_metrics.get("gc/wire_ratio")
        self.result = {
            **self.info,
            "strategy": type(trainer.strategy).__name__,
            "compressor": getattr(getattr(trainer.strategy, "compressor", None), "name", None),
            "compress_ratio": self.target_ratio,
            "final_ratio": _final_ratio(trainer),
            "metric_name": self.metric_name,
            "metric_mode": self.metric_mode,
            "metric": None if metric is None else _number(metric),
            "curve": self.curve,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "epochs": trainer.current_epoch,
            "steps": steps,
            "world_size": trainer.world_size,
            "bytes_sent": sent,
            "dense_bytes": dense,
            "wire_compression": dense / sent if sent > 0 else None,
            "last_step_wire_compression": None if last_ratio is None else _number(last_ratio),
            "step_time_s": step_time,
            "samples_per_s": batch_size * trainer.world_size / step_time if batch_size and step_time else None,
            "wall_s": time.perf_counter() - self._start,
        }
        if trainer.is_global_zero:
            write_result(self.out_dir, self.result)


def _final_ratio(trainer: Trainer) -> float | None:
    """The ratio in force at the last step (below the target while a sparsity warm-up runs)."""
    adjustable = getattr(trainer.strategy, "adjustable", None)
    return None if adjustable is None else float(adjustable.compress_ratio)


def write_result(out_dir: Path, result: dict[str, Any]) -> None:
    """``result.json`` and a one-row ``result.csv`` (lists and dicts JSON-encoded) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    with open(out_dir / "result.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result))
        writer.writeheader()
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in result.items()})


def scheme(result: dict[str, Any]) -> str:
    """What exchanged the gradients: ``"dense DDP"`` or the compressor's name."""
    return "dense DDP" if result.get("compressor") is None else str(result["compressor"])


def summary_line(result: dict[str, Any], out_dir: Path) -> str:
    """``[name] val/acc 0.9120 | dgc 0.001 | wire 270x | 0.123 s/step, 1040 samples/s | <dir>`` (after
    the metric, ``| test/ppl 123.4000`` when the run was tested)."""
    metric = "n/a" if result["metric"] is None else f"{result['metric']:.4f}"
    ratio = "" if result["compress_ratio"] is None else f" {result['compress_ratio']:g}"
    wire = "n/a" if result["wire_compression"] is None else f"{result['wire_compression']:.0f}x"
    step = "n/a" if result["step_time_s"] is None else f"{result['step_time_s']:.3f} s/step"
    rate = "" if result["samples_per_s"] is None else f", {result['samples_per_s']:.0f} samples/s"
    tested = "" if result.get("test_metric") is None else f" | {result['test_metric_name']} {result['test_metric']:.4f}"
    return (
        f"[{result.get('name', 'run')}] {result['metric_name']} {metric}{tested} | {scheme(result)}{ratio} | "
        f"wire {wire} | {step}{rate} | {out_dir}"
    )


def load_results(root: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``result.json`` below ``root`` (a run or a sweep directory), sorted by path."""
    return [(path.parent, json.loads(path.read_text())) for path in sorted(Path(root).rglob(RESULT_FILE))]


def discard_unused_run_dir(run_dir: Path) -> bool:
    """Remove ``run_dir`` when it holds nothing but what Hydra writes before a run starts (its
    ``.hydra/`` folder and empty log files): a run refused by its checks leaves no folder behind.
    An emptied date folder under ``outputs/`` (Hydra's default ``outputs/<date>/<time>``) goes too, and
    so does ``outputs/`` once empty.
    Returns whether no such folder is left; a folder holding anything else is left alone.

    Under torchrun every rank's Hydra writes the folder and every rank refuses the run, so each
    calls this once its own files are written: removals that another rank got to first are
    skipped, and the last rank to finish writing leaves nothing behind."""
    try:
        entries = list(run_dir.iterdir())
        hydras = [e for e in entries if e.name == ".hydra" and e.is_dir()]
        logs = [e for e in entries if e.is_file() and e.suffix == ".log" and e.stat().st_size == 0]
        if len(hydras) + len(logs) != len(entries):
            return False
        for entry in hydras:
            shutil.rmtree(entry, ignore_errors=True)
        for entry in logs:
            entry.unlink(missing_ok=True)
        run_dir.rmdir()
        date, outputs = run_dir.parent, run_dir.parent.parent
        if outputs.name == "outputs":
            for folder in (date, outputs):
                if any(folder.iterdir()):
                    break
                folder.rmdir()
    except OSError:  # gone already, or written again by a rank still starting: that rank removes it
        return not run_dir.exists()
    return True
