"""What ``train.py`` does with a composed Hydra config: build, fit, record, compare.

One run = one strategy fitted on the configured task, recorded by
:class:`recipes.results.RunRecorder` in the run's directory. With ``compare_dense=true``
(the quickstart) the same task is fitted again with dense DDP (in ``<run dir>/dense``) and the
two are printed side by side.

Launching: a single run uses Lightning's default launcher (it re-runs ``train.py`` with the same
overrides and Hydra's run directory for the other ranks). Inside a Hydra multirun that launcher
would re-run ``-m`` and start a second sweep, so jobs there use the ``spawn`` start method: the
workers are forked from the job in fresh interpreters and never see ``sys.argv``. Processes
started externally (torchrun, srun) launch nothing: every one runs the sweep's jobs in order, and
the start method is left as configured.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from lightning_gc import GradientCompressionStrategy
from lightning_gc.integrations.outer import OuterLoopStrategy
from lightning_gc.runtime.checkpoint import IncompatibleCheckpoint
from recipes.common import DownloadFailed
from recipes.results import RESULT_FILE, RunRecorder, summary_line, write_result
from recipes.trainer_args import trainer_argument_errors


class UsageError(ValueError):
    """A mistake in the run's options or data, found before training: ``train.py`` prints it as one
    line on stderr and exits with status 2."""


def qualified(group: str, cfg: DictConfig, message: str) -> str:
    """``message`` with each backticked option of ``cfg`` (`` `compress_ratio` ``) named by its full
    Hydra path (`` `strategy.compress_ratio` ``), and Lightning's `` `Trainer(devices=0)` `` as
    `` `trainer.devices=0` ``."""
    message = re.sub(r"`Trainer\((\w+)=([^`]*)\)`", r"`trainer.\1=\2`", message)
    return re.sub(r"`([A-Za-z_]\w*)`", lambda m: f"`{group}.{m[1]}`" if m[1] in cfg else m[0], message)


def quiet_foreign_noise() -> None:
    """Drop messages of other libraries that tell a user of this app nothing (for the app only, never
    in the library): Lightning's own deprecation of its tree utilities, its note that tensorboardX is
    no longer its dependency (it then logs CSV, which the app reads), and its advertising tips."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*`tensorboardX` has been removed as a dependency")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in rank_zero.filters):
        rank_zero.addFilter(_NoTips())


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def processes_started_externally() -> bool:
    """Whether a launcher (torchrun, srun) started this process as one rank of several: Lightning
    then launches nothing, whatever the start method."""
    slurm_tasks = os.environ.get("SLURM_NTASKS", "1")
    return (
        "LOCAL_RANK" in os.environ
        or TorchElasticEnvironment.detect()
        or (slurm_tasks.isdigit() and int(slurm_tasks) > 1)
    )


def build_strategy(cfg: DictConfig, *, multirun: bool) -> Strategy:
    """The configured strategy; ``start_method="spawn"`` inside a multirun unless set explicitly
    or the processes are started externally (then every process runs the sweep's jobs in order).

    Bad arguments (unknown compressor, ``compress_ratio=0``, ...) raise here, before any process starts.
    """
    if not multirun or processes_started_externally():
        return build("strategy", cfg)
    if cfg.get("start_method") == "popen":
        raise UsageError(
            "`strategy.start_method=popen` cannot run inside a multirun: it re-runs the command line, `-m` "
            "included, in every extra process; use spawn (the default in sweeps), fork or forkserver"
        )
    extra = {"start_method": "spawn"} if "start_method" not in cfg else {}
    return build("strategy", cfg, **extra)


def build(group: str, cfg: DictConfig, **extra: Any) -> Any:
    """``instantiate(cfg)``; a constructor's error (Hydra wraps it in its own
    ``InstantiationException``) becomes a :class:`UsageError` naming the options by their full path."""
    try:
        return instantiate(cfg, _convert_="all", **extra)
    except Exception as err:
        cause = err.__cause__ or err
        if not isinstance(cause, (ValueError, TypeError)):
            raise
        raise UsageError(f"bad `{group}` config ({cfg.get('_target_')}): {qualified(group, cfg, str(cause))}") from err


def fit_once(
    cfg: DictConfig, strategy: Strategy, out_dir: Path, info: dict[str, Any], ckpt_path: str | None = None
) -> dict[str, Any] | None:
    """Fit ``cfg.model`` on ``cfg.data`` with ``strategy`` (resuming ``ckpt_path`` if given); rank 0
    returns the run's result."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    model = build("model", cfg.model)
    data = build("data", cfg.data)
    test_after_fit = bool(cfg.get("test_after_fit", False))
    testable = getattr(model, "test_metric_name", None) is not None and is_overridden("test_step", model)
    if test_after_fit and not (testable and is_overridden("test_dataloader", data)):
        raise UsageError(
            f"`test_after_fit=true` evaluates on the data's test split, but {type(data).__name__} with "
            f"{type(model).__name__} has none (the PTB language models have one); set test_after_fit=false"
        )
    check_data = getattr(data, "check_data", None)
    if check_data is not None:
        try:  # a missing dataset fails here, before Lightning starts the other processes
            check_data(test=True) if test_after_fit else check_data()
        except (FileNotFoundError, ValueError) as err:
            raise UsageError(str(err)) from err
    prepare_in_launcher(data)
    recorder = RunRecorder(out_dir, info)
    callbacks: list[L.Callback] = [recorder]
    if cfg.trainer.get("enable_progress_bar", True) is not False:
        callbacks.append(ProgressBar())
    if cfg.warmup is not None and isinstance(strategy, GradientCompressionStrategy) and strategy.adjustable is not None:
        callbacks.append(build("warmup", cfg.warmup))
    trainer_args: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    if trainer_args.get("enable_checkpointing") is None:  # made-up data: nothing worth hundreds of MB on disk
        trainer_args["enable_checkpointing"] = not cfg.data.get("synthetic", False)
    try:
        trainer = L.Trainer(**trainer_args, strategy=strategy, callbacks=callbacks, default_root_dir=str(out_dir))
    except (MisconfigurationException, ValueError, TypeError) as err:
        message = qualified("trainer", cfg.trainer, str(err))
        if "`trainer.devices=" in message:  # Lightning names the value, not what it takes
            message += " `trainer.devices` takes a number of devices >= 1, a list of device indices, or 'auto'."
        raise UsageError(message) from err
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except IncompatibleCheckpoint as err:  # resumed with other ranks or settings than the checkpoint's
        raise UsageError(f"`ckpt_path`: {err}") from err
    metric_name = recorder.metric_name or getattr(model, "metric_name", "val/loss")
    late = None
    if metric_name not in trainer.callback_metrics and not trainer.interrupted and validates(trainer, model):
        # stopped before its first validation (e.g. trainer.max_steps below an epoch): validate once so
        # that a short run still reports its metric; every rank (or, spawned, the launching process)
        # sees the same callback metrics, so all take this branch together
        late = trainer.validate(model, datamodule=data, verbose=False)[0].get(metric_name)
    tested = None
    if test_after_fit and not trainer.interrupted:
        tested = trainer.test(model, datamodule=data, verbose=False)[0].get(model.test_metric_name)
    if not trainer.is_global_zero or not (out_dir / RESULT_FILE).is_file():
        return None
    result: dict[str, Any] = json.loads((out_dir / RESULT_FILE).read_text())
    if late is not None:
        value = float(late)
        result["metric"], result["curve"] = (
            value,
            [*result["curve"], [trainer.current_epoch, trainer.global_step, value]],
        )
    if tested is not None:
        result["test_metric_name"], result["test_metric"] = model.test_metric_name, float(tested)
    if late is not None or tested is not None:
        write_result(out_dir, result)
    print(summary_line(result, out_dir), flush=True)
    if result["steps"] == 0:
        raise UsageError(
            f"the run made no training step: each of the {result['world_size']} processes got fewer samples than "
            f"data.batch_size={cfg.data.get('batch_size')} (incomplete batches are dropped), or "
            "trainer.limit_train_batches / trainer.max_steps is 0; lower data.batch_size"
        )
    return result


def prepare_in_launcher(data: L.LightningDataModule) -> None:
    """Download what ``data`` asks for here, in the process that launches the others, so that a
    download that fails ends the run with its one message before any other rank starts (Lightning
    would prepare on rank 0 after starting them). Processes a launcher started (torchrun, srun, the
    ranks Lightning starts) leave it to Lightning.

    Raises:
        UsageError: the download could not reach its server (the message says what to do offline).
    """
    if processes_started_externally():
        return
    try:
        data.prepare_data()
    except DownloadFailed as err:
        raise UsageError(str(err)) from err


class ProgressBar(RichProgressBar):
    """Lightning's rich progress bar without the logger's version number (``v_num: 0.000``): a run's
    directory and version are in its summary line."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def validates(trainer: L.Trainer, model: L.LightningModule) -> bool:
    """Whether the fit could have validated: the model has a validation step and the trainer runs it."""
    return is_overridden("validation_step", model) and trainer.limit_val_batches != 0


def dense_twin(strategy: DDPStrategy) -> DDPStrategy:
    """Plain DDP with ``strategy``'s DDP settings (``bucket_cap_mb``, ``find_unused_parameters``,
    timeout, backend, start method), so the comparison differs in the gradient exchange only."""
    return DDPStrategy(
        process_group_backend=strategy._process_group_backend,
        timeout=strategy._timeout,
        start_method=strategy._start_method,
        **strategy._ddp_kwargs,
    )


def comparison(cfg: DictConfig, compressed: dict[str, Any], dense: dict[str, Any]) -> str:
    """The quickstart's closing lines: both metrics, megabytes sent per rank, wire compression."""
    label = "DGC" if compressed["strategy"] == "DGCStrategy" else str(compressed["compressor"])
    metric = compressed["metric_name"].replace("/", " ")
    per_step = compressed.get("last_step_wire_compression")
    overall = compressed.get("wire_compression")
    wire = "n/a" if overall is None else f"{overall:.0f}x"
    target, final = compressed.get("compress_ratio"), compressed.get("final_ratio")
    if cfg.warmup is None or target is None or compressed["strategy"] == OuterLoopStrategy.__name__:  # no warm-up
        span = " over the run"
    elif final is not None and final > target:  # stopped inside the warm-up: no step at the target ratio
        span = f" over the run; the warm-up had not ended: the last step sent {final:.2%} of each compressed tensor"
    else:
        span = " over the run with warm-up" + (f", {per_step:.0f}x per step after it" if per_step else "")

    def value(result: dict[str, Any]) -> str:
        return "n/a" if result["metric"] is None else f"{result['metric']:.3f}"

    return (
        f"\n{cfg.name}: {cfg.description} ({compressed['params']:,} params), {compressed['world_size']} processes, "
        f"{compressed['epochs']} epochs\n"
        f"  dense DDP  {metric} {value(dense)}   sent {dense['bytes_sent'] / 1e6:8.2f} MB per rank\n"
        f"  {label:<9}  {metric} {value(compressed)}   sent {compressed['bytes_sent'] / 1e6:8.2f} MB per rank "
        f"(wire compression {wire}{span})"
    )


def run(cfg: DictConfig, run_dir: Path, *, multirun: bool, overrides: list[str]) -> list[dict[str, Any]]:
    """Fit the configured run (and its dense twin with ``compare_dense``); return rank 0's results."""
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < 2**32:
        raise UsageError(f"`seed` must be an integer in [0, 2**32), got {cfg.seed!r}")
    errors = trainer_argument_errors(OmegaConf.to_container(cfg.trainer, resolve=True))  # type: ignore[arg-type]
    if errors:
        raise UsageError("; ".join(errors))
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None:
        if not Path(ckpt_path).is_file():
            raise UsageError(f"`ckpt_path` must be a Lightning checkpoint file, got {ckpt_path!r} (no such file)")
        if cfg.compare_dense:
            raise UsageError(
                f"`ckpt_path={ckpt_path}` resumes one run, but compare_dense=true fits two; add compare_dense=false"
            )
    strategy = build_strategy(cfg.strategy, multirun=multirun)
    if cfg.compare_dense and not isinstance(strategy, (GradientCompressionStrategy, OuterLoopStrategy)):
        raise UsageError(
            f"`compare_dense=true` compares a compressed strategy with dense DDP, but the strategy is "
            f"{type(strategy).__name__}; add compare_dense=false"
        )
    info = {
        "name": cfg.name,
        "overrides": overrides,
        "paper": OmegaConf.to_container(cfg.paper) if cfg.paper is not None else None,
    }
    results = []
    first = fit_once(cfg, strategy, run_dir, info, ckpt_path)
    if first is not None:
        results.append(first)
    if cfg.compare_dense:
        dense_strategy = dense_twin(strategy)
        dense = fit_once(cfg, dense_strategy, run_dir / "dense", {**info, "name": f"{cfg.name}_dense"})
        if first is not None and dense is not None:
            results.append(dense)
            print(comparison(cfg, first, dense), flush=True)
    return results
