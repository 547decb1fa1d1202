"""Hydra multirun gives one sweep directory with one result per job; the report reads it;
bad overrides fail before any training process starts, naming the option and what is allowed."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from apprun import REPO, output, results, train
from conftest import train_under_torchrun
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from rich.console import Console

from recipes.app import UsageError, build, build_strategy, run
from recipes.report import main as report_main
from recipes.report import report
from recipes.results import discard_unused_run_dir


def test_multirun_over_the_ratio_writes_one_sweep_and_the_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    done = train(
        "-m",
        "strategy.compress_ratio=0.01,0.1",
        "compare_dense=false",
        "warmup=null",  # so that the ratio takes effect from the first epoch
        "trainer.max_epochs=1",
        "data.batch_size=64",
        f"hydra.sweep.dir={sweep}",
    )
    assert done.returncode == 0, output(done)
    # Lightning's default launcher would re-run `-m` in the second process, which starts a second
    # sweep of its own (that happens to line up with the first only under the basic sequential launcher).
    assert (done.stdout + done.stderr).count("Launching 2 jobs") == 1, output(done)
    assert len(list(tmp_path.rglob("multirun.yaml"))) == 1
    assert sorted(p.parent.name for p in sweep.rglob("result.json")) == ["0", "1"]
    runs = results(sweep)
    assert sorted(r["compress_ratio"] for r in runs) == [0.01, 0.1]
    assert all(r["world_size"] == 2 and r["steps"] == 11 and r["metric"] > 0.5 for r in runs), runs
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 for r in runs), runs
    sparse, denser = sorted(runs, key=lambda r: r["compress_ratio"])
    assert sparse["wire_compression"] > 2 * denser["wire_compression"] > 2, runs  # the override reached the job

    console = Console(file=io.StringIO(), width=200)
    png = report(sweep, console)
    table = console.file.getvalue()
    assert "2 run(s)" in table and "val/acc" in table
    for r in runs:
        assert f"{r['compress_ratio']:g}" in table and f"{r['metric']:.4f}" in table
    assert png == sweep / "report.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_results_says_what_it_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="no result.json under"):
        report(tmp_path, Console(file=io.StringIO()))
    with pytest.raises(SystemExit) as exit_info:
        report_main([str(tmp_path)])  # python -m recipes.report <dir>
    assert exit_info.value.code == 2 and "no result.json under" in capsys.readouterr().err


def test_unknown_recipe_lists_the_recipes() -> None:
    done = train("+recipe=resnet99_dgc")
    assert done.returncode != 0
    assert "Could not find 'recipe/resnet99_dgc'" in done.stderr
    assert "resnet50_dgc" in done.stderr and "lstm_ptb_dense" in done.stderr
    assert "Initializing distributed" not in done.stdout + done.stderr


def test_a_run_that_makes_no_training_step_fails_naming_the_batch_size(tmp_path: Path) -> None:
    """1,438 training digits over 2 processes is 719 each: a batch of 1000 never fills (and is dropped)."""
    done = train_under_torchrun(
        "data.batch_size=1000", "trainer.max_epochs=1", "compare_dense=false", f"hydra.run.dir={tmp_path / 'run'}",
        logs=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert "the run made no training step" in done.stderr and "data.batch_size=1000" in done.stderr, output(done)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+recipe=resnet20_cifar10_dgc", "strategy.compress_ratio=0", "data.synthetic=true"],
         "`strategy.compress_ratio` must be in (0, 1], got 0"),
        (["strategy.compress_ratio=abc"], "`strategy.compress_ratio` must be a finite number in (0, 1], got 'abc'"),
        (["data.batch_size=-1"], "`data.batch_size` must be an integer >= 1, got -1"),
        (["trainer.devices=0"], "`trainer.devices` takes a number of devices >= 1, a list of device indices"),
        (["test_after_fit=true"], "`test_after_fit=true` evaluates on the data's test split, but DigitsDataModule"),
    ],
    ids=["ratio-0", "ratio-abc", "batch-negative", "devices-0", "no-test-split"],
)  # fmt: skip
def test_a_mistake_is_a_usage_error_naming_the_option_before_any_process_starts(
    overrides: list[str], message: str, tmp_path: Path
) -> None:
    """What ``train.py`` runs, in this process: the mistake is found before Lightning launches
    the ranks (no process group is made); how ``train.py`` prints it is the test below."""
    import torch.distributed

    with pytest.raises(UsageError) as error:
        run(_compose(*overrides, "compare_dense=false"), tmp_path, multirun=False, overrides=overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not torch.distributed.is_initialized()


def test_train_py_prints_a_mistake_as_one_line_on_stderr_with_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    run_dir = tmp_path / "outputs" / "2026-12-01" / "10-00-00"
    done = train("strategy.compress_ratio=abc", "compare_dense=false", f"hydra.run.dir={run_dir}")
    assert not (tmp_path / "outputs").exists(), output(done)  # the refused run left no folder
    assert (tmp_path / "kept").is_dir()
    assert done.returncode == 2, output(done)
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], output(done)  # exactly one line
    assert done.stderr.startswith("train.py: error: bad `strategy` config"), output(done)
    assert "`strategy.compress_ratio` must be a finite number in (0, 1], got 'abc'" in done.stderr, output(done)
    assert "Initializing distributed" not in done.stdout + done.stderr


def test_a_mistake_under_torchrun_exits_2_on_every_rank_and_leaves_no_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = train_under_torchrun(
        "strategy.compress_ratio=abc", "compare_dense=false", f"hydra.run.dir={run_dir}", logs=tmp_path / "ranks"
    )
    assert done.returncode == 2 and done.stderr.count("(exit 2)") == 2, output(done)
    assert done.stderr.count("train.py: error: bad `strategy` config") == 2 and "Traceback" not in done.stderr
    assert not run_dir.exists(), output(done)


def test_only_a_run_folder_holding_nothing_but_hydras_own_files_is_discarded(tmp_path: Path) -> None:
    def run_dir(name: str, log: str = "", extra: str | None = None) -> Path:
        folder = tmp_path / "outputs" / name / "10-00-00"
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "config.yaml").write_text("seed: 0\n")
        (folder / "train.log").write_text(log)
        if extra is not None:
            (folder / extra).write_text("{}")
        return folder

    assert discard_unused_run_dir(run_dir("refused")) and not (tmp_path / "outputs" / "refused").exists()
    for kept in (run_dir("logged", log="[INFO] epoch 0\n"), run_dir("finished", extra="result.json")):
        assert not discard_unused_run_dir(kept) and (kept / ".hydra" / "config.yaml").is_file()
    assert discard_unused_run_dir(tmp_path / "missing")  # nothing left: another rank removed it first


def test_missing_dataset_fails_before_training_saying_where_to_put_it(tmp_path: Path) -> None:
    done = train("+recipe=lstm_ptb_dgc", "data.download=false", f"data.root={tmp_path}", f"hydra.run.dir={tmp_path}")
    assert done.returncode != 0
    assert f"Penn Treebank not found under data.root='{tmp_path}'" in done.stderr, output(done)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, output(done)
    assert "Initializing distributed" not in done.stdout + done.stderr


def _compose(*overrides: str):
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_trainer_values_of_the_wrong_type_fail_before_anything_starts(tmp_path: Path) -> None:
    """Lightning takes ``max_epochs="abc"`` or ``logger="maybe"`` when it builds the Trainer and fails
    once every process trains (a traceback from each); ``run`` refuses them first, naming each
    option, what it takes and the value, as it does a bad ``seed``."""
    from recipes.app import UsageError, run
    from recipes.trainer_args import trainer_argument_errors

    assert trainer_argument_errors({"max_epochs": 3, "devices": "auto", "precision": "16-mixed", "logger": False}) == []
    assert trainer_argument_errors({"precision": 32, "deterministic": "warn", "limit_val_batches": 0.5}) == []
    cases = {
        "trainer.max_epochs=abc": "`trainer.max_epochs` must be an integer or null, got 'abc'",
        "trainer.logger=maybe": (
            "`trainer.logger` must be a Logger or an iterable or true or false or null, got 'maybe'"
        ),
        "+trainer.accumulate_grad_batches=0": "`trainer.accumulate_grad_batches` must be an integer >= 1, got 0",
        "trainer.max_steps=1.5": "`trainer.max_steps` must be an integer, got 1.5",
        "seed=abc": "`seed` must be an integer in [0, 2**32), got 'abc'",
    }
    for override, message in cases.items():
        with pytest.raises(UsageError) as error:
            run(_compose(override), tmp_path, multirun=False, overrides=[override])
        assert str(error.value) == message


def test_unknown_compressor_names_the_choices() -> None:
    cfg = _compose("strategy=topk", "strategy.compressor=bogus")
    from lightning_gc.compressors import available

    choices = re.escape(str(sorted(available())))  # every registered codec, whatever registers next
    with pytest.raises(ValueError, match=rf"`strategy.compressor` must be one of {choices}.*got 'bogus'"):
        build_strategy(cfg.strategy, multirun=False)


def test_unknown_strategy_option_lists_the_strategies() -> None:
    with pytest.raises(MissingConfigException, match="strategy/bogus"):
        _compose("strategy=bogus")


def test_strategy_arguments_are_checked_at_build_time() -> None:
    cfg = _compose("+strategy.bucket_cap_mbb=25")
    with pytest.raises(ValueError, match="bucket_cap_mbb"):
        build_strategy(cfg.strategy, multirun=False)
    assert build_strategy(_compose().strategy, multirun=True)._start_method == "spawn"
    assert build_strategy(_compose().strategy, multirun=False)._start_method == "popen"
    with pytest.raises(ValueError, match="`strategy.start_method=popen` cannot run inside a multirun"):
        build_strategy(_compose("+strategy.start_method=popen").strategy, multirun=True)


def test_externally_started_processes_keep_their_start_method_in_a_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun sets it
    assert build_strategy(_compose().strategy, multirun=True)._start_method == "popen"
    build_strategy(_compose("+strategy.start_method=popen").strategy, multirun=True)  # launches nothing: fine


def test_a_sweep_under_torchrun_runs_every_job_once_on_both_ranks(tmp_path: Path) -> None:
    """The README's multi-node path, on one machine: torchrun starts both ranks, each runs the jobs."""
    import os
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", "-m"]
    overrides = ["strategy.compress_ratio=0.01,0.1", "compare_dense=false", "warmup=null", "trainer.max_epochs=1"]
    done = subprocess.run(
        [*command, *overrides, "model.hidden=[64]", f"hydra.sweep.dir={sweep}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, output(done)
    runs = results(sweep)
    assert sorted(r["compress_ratio"] for r in runs) == [0.01, 0.1]
    assert all(r["world_size"] == 2 and r["steps"] > 0 for r in runs), runs


BAD_OVERRIDES = [
    # (overrides, config node built, text the error must contain: the option, the value, what is allowed)
    (["strategy.compress_ratio=1.5"], "strategy", "`compress_ratio` must be in (0, 1], got 1.5"),
    (["strategy.sample_ratio=0"], "strategy", "`sample_ratio` must be in (0, 1], got 0"),
    (
        ["strategy.value_dtype=int8"],
        "strategy",
        "`value_dtype` must be one of ['float32', 'float16', 'bfloat16'], got 'int8'",
    ),
    (
        ["strategy.index_encoding=delta"],
        "strategy",
        "`index_encoding` must be one of ['int32', 'elias_fano'], got 'delta'",
    ),
    (
        ["strategy=topk", "strategy.dense_dtype=int8"],
        "strategy",
        "`dense_dtype` must be one of ['float32', 'float16', 'bfloat16', None], got 'int8'",
    ),
    (["strategy.clip_norm=-1"], "strategy", "`clip_norm` must be in (0, inf], got -1"),
    (["strategy.min_compress_numel=0"], "strategy", "`min_compress_numel` must be an integer >= 1, got 0"),
    (["+strategy.nonfinite=ignore"], "strategy", "`nonfinite` must be one of ['raise', 'skip'], got 'ignore'"),
    (["+strategy.timeout=-1"], "strategy", "`timeout` must be in (0, inf], got -1"),
    (["+strategy.verify_every_n_steps=0"], "strategy", "`verify_every_n_steps` must be an integer >= 1, got 0"),
    (["strategy=powersgd", "strategy.rank=0"], "strategy", "`rank` must be an integer >= 1, got 0"),
    (["strategy=powersgd", "strategy.start_iter=-2"], "strategy", "`start_iter` must be an integer >= 0, got -2"),
    (["strategy=qsgd", "strategy.levels=1"], "strategy", "`levels` must be an integer in [2, 127], got 1"),
    (["strategy=fft", "strategy.bits=3"], "strategy", "`bits` must be one of [4, 8, 16], got 3"),
    (["strategy=signsgd", "strategy.chunk_size=2"], "strategy", "`chunk_size` must be an integer >= 8, got 2"),
    (["strategy=randomk", "strategy.compress_ratio=1.0"], "strategy", "`compress_ratio` must be in (0, 1), got 1.0"),
    (["warmup.interval=batch"], "warmup", "`interval` must be one of ['epoch', 'step'], got 'batch'"),
    (["+recipe=resnet20_cifar10_dgc", "model.lr_gamma=0"], "model", "`model.lr_gamma` must be in (0, 1], got 0"),
    (["+recipe=lstm_ptb_dgc", "data.batch_size=0"], "data", "`data.batch_size` must be an integer >= 1, got 0"),
    (["+recipe=deepspeech_librispeech_dgc", "data.corpus=timit"], "data", "`data.corpus` must be one of"),
    (["data.batch_size=0"], "data", "`data.batch_size` must be an integer >= 1, got 0"),  # the quickstart
    (["model.lr=-1"], "model", "`model.lr` must be in (0, inf], got -1"),
    (["model.momentum=1.5"], "model", "`model.momentum` must be in [0, 1), got 1.5"),
    (["model.hidden=[64,0]"], "model", "`model.hidden[1]` must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize(
    ("overrides", "node", "message"), BAD_OVERRIDES, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_bad_config_values_fail_at_construction_naming_option_value_and_choices(
    overrides: list[str], node: str, message: str
) -> None:
    cfg = _compose(*overrides)
    with pytest.raises(ValueError) as error:
        if node == "strategy":
            build_strategy(cfg.strategy, multirun=False)
        else:
            build(node, cfg[node])
    qualified = message if message.startswith(f"`{node}.") else message.replace("`", f"`{node}.", 1)
    assert str(error.value).startswith(f"bad `{node}` config") and qualified in str(error.value)


def _result(compressor: str | None, ratio: float | None, overrides: list[str], metric: float) -> dict:
    return {
        "name": "quickstart",
        "overrides": ["trainer.max_epochs=1", *overrides],
        "strategy": "DDPStrategy" if compressor is None else "GradientCompressionStrategy",
        "compressor": compressor,
        "compress_ratio": ratio,
        "metric_name": "val/acc",
        "metric": metric,
        "wire_compression": 1.0,
        "step_time_s": 0.1,
        "samples_per_s": 100.0,
    }


def test_report_tells_schemes_apart_and_skips_stale_and_failed_jobs(tmp_path: Path) -> None:
    """Quantisers have no ratio but are not dense DDP; topk and randomk sweeps are separate lines;
    a result left by an earlier sweep into the same directory is not reported; a failed job is named."""
    import json
    import os

    from recipes.report import series, sweep_runs

    sweep = tmp_path / "sweep"
    old = sweep / "7"
    old.mkdir(parents=True)
    (old / "result.json").write_text(json.dumps(_result("dgc", 0.5, ["strategy=dgc"], 0.1)))
    os.utime(old / "result.json", (1, 1))  # long before this sweep started
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    jobs = [
        _result(None, None, ["strategy=dense"], 0.90),
        _result("qsgd", None, ["strategy=qsgd"], 0.88),
        _result("topk", 0.01, ["strategy=topk", "strategy.compress_ratio=0.01"], 0.85),
        _result("topk", 0.1, ["strategy=topk", "strategy.compress_ratio=0.1"], 0.87),
        _result("randomk", 0.01, ["strategy=randomk", "strategy.compress_ratio=0.01"], 0.60),
        _result("randomk", 0.1, ["strategy=randomk", "strategy.compress_ratio=0.1"], 0.80),
    ]
    for index, result in enumerate(jobs):
        (sweep / str(index) / ".hydra").mkdir(parents=True)
        (sweep / str(index) / "result.json").write_text(json.dumps(result))
    (sweep / "6" / ".hydra").mkdir(parents=True)  # a job of this sweep that failed

    rows, stale, missing = sweep_runs(sweep)
    assert len(rows) == 6 and stale == [old] and missing == [sweep / "6"]
    lines = series(rows)
    assert sorted(lines) == ["randomk strategy=randomk", "topk strategy=topk"]
    assert sorted(r["compress_ratio"] for r in lines["topk strategy=topk"]) == [0.01, 0.1]

    console = Console(file=io.StringIO(), width=250)
    report(sweep, console)
    text = console.file.getvalue()
    assert "6 run(s)" in text and "trainer.max_epochs" not in text  # only what the sweep varied
    qsgd_line = next(line for line in text.splitlines() if "strategy=qsgd" in line)
    assert "qsgd" in qsgd_line.split("strategy=qsgd")[1] and "dense" not in qsgd_line
    assert "job 6: no result (failed or still running)" in text
    assert "not reported: 1 result(s) older than multirun.yaml" in text


def test_summary_line_names_the_scheme() -> None:
    from recipes.results import summary_line

    line = summary_line({**_result("qsgd", None, [], 0.5), "wire_compression": 8.0}, Path("run"))
    assert "| qsgd | wire 8x |" in line
    assert "| dense DDP |" in summary_line(_result(None, None, [], 0.5), Path("run"))
    assert "| dgc 0.001 |" in summary_line(_result("dgc", 0.001, [], 0.5), Path("run"))
    assert "wire n/a" in summary_line({**_result("dgc", 0.001, [], 0.5), "wire_compression": None}, Path("run"))


def test_the_dense_twin_shares_the_ddp_settings() -> None:
    from recipes.app import dense_twin

    compressed = build_strategy(
        _compose("+strategy.bucket_cap_mb=4", "+strategy.find_unused_parameters=true", "+strategy.timeout=60").strategy,
        multirun=True,
    )
    twin = dense_twin(compressed)
    assert twin._ddp_kwargs == {"bucket_cap_mb": 4, "find_unused_parameters": True}
    assert twin._timeout.total_seconds() == 60 and twin._start_method == "spawn"


def test_train_py_resumes_a_checkpoint_and_refuses_a_missing_one(tmp_path: Path) -> None:
    common = ["compare_dense=false", "trainer.enable_checkpointing=true", "model.hidden=[64]"]
    # launched as torchrun does, on warm ranks (Lightning's own launcher: test_quickstart.py)
    first = train_under_torchrun(
        *common, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'first'}", logs=tmp_path / "first-ranks"
    )
    assert first.returncode == 0, output(first)
    (checkpoint,) = (tmp_path / "first").rglob("*.ckpt")
    quoted = f'ckpt_path="{checkpoint}"'  # Lightning's file names hold "=", which Hydra's grammar needs quoted
    resumed = train_under_torchrun(
        *common, "trainer.max_epochs=2", quoted, f"hydra.run.dir={tmp_path / 'resumed'}", logs=tmp_path / "ranks"
    )
    assert resumed.returncode == 0, output(resumed)
    (one_epoch,) = results(tmp_path / "first")
    (two_epochs,) = results(tmp_path / "resumed")
    assert two_epochs["steps"] == 2 * one_epoch["steps"] > 0  # continued from step 11, not from 0

    with pytest.raises(UsageError, match="`ckpt_path` must be a Lightning checkpoint file"):
        run(
            _compose(*common, f"ckpt_path={tmp_path / 'nothing.ckpt'}"),
            tmp_path / "missing",
            multirun=False,
            overrides=[],
        )
    with pytest.raises(UsageError, match="add compare_dense=false"):
        run(_compose(quoted), tmp_path / "both", multirun=False, overrides=[])
    alone = train(*common, "trainer.max_epochs=2", "trainer.devices=1", quoted, f"hydra.run.dir={tmp_path / 'alone'}")
    # one process resumes two ranks' residuals: re-sharded (lightning_gc.runtime.reshard), said once
    assert alone.returncode == 0, output(alone)
    assert "holds the compression state of 2 ranks and this run has 1" in alone.stderr, output(alone)
    (one_process,) = results(tmp_path / "alone")
    assert one_process["steps"] > 2 * one_epoch["steps"]  # continued from step 11 with twice the batches per epoch


def test_report_draws_one_dense_reference_per_sweep_and_prints_whole_columns_when_piped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ratio sweep with a dense twin per job: the twins do not depend on the ratio, so they are
    one reference line labelled without it; piped output keeps every column name whole."""
    import json

    from recipes.report import references

    for index, ratio in enumerate((0.01, 0.1)):
        overrides = [f"strategy.compress_ratio={ratio}", "trainer.max_epochs=3"]
        for name, result in (
            (str(index), _result("dgc", ratio, overrides, 0.9)),
            (f"{index}/dense", _result(None, None, overrides, 0.95)),
        ):
            (tmp_path / name).mkdir(parents=True, exist_ok=True)
            (tmp_path / name / "result.json").write_text(json.dumps(result))
    rows = [(path.parent, json.loads(path.read_text())) for path in sorted(tmp_path.rglob("result.json"))]
    assert [label for label, _ in references(rows)] == ["dense DDP"]
    report_main([str(tmp_path)])  # stdout is captured: not a terminal
    header = next(line for line in capsys.readouterr().out.splitlines() if "scheme" in line)
    assert all(name in header for name in ("overrides", "scheme", "ratio", "wire ×", "step (s)", "samples/s"))


def test_the_comparison_says_when_the_warm_up_had_not_ended() -> None:
    from recipes.app import comparison

    cfg = _compose()  # the quickstart, with DGC's warm-up
    dense = {**_result(None, None, [], 0.95), "bytes_sent": 1e9, "params": 10, "world_size": 2, "epochs": 1}
    inside = {
        **dense, **_result("dgc", 0.001, [], 0.9), "strategy": "DGCStrategy", "bytes_sent": 5e8,
        "wire_compression": 2.0, "final_ratio": 0.25, "last_step_wire_compression": 2.0,
    }  # fmt: skip
    text = comparison(cfg, inside, dense)
    assert "the warm-up had not ended: the last step sent 25.00% of each compressed tensor" in text
    assert "per step after it" not in text
    after = comparison(cfg, {**inside, "final_ratio": 0.001, "last_step_wire_compression": 261.0}, dense)
    assert "over the run with warm-up, 261x per step after it" in after
