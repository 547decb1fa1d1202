"""The accuracy driver's run selection (``python -m benchmarks.accuracy TASK --runs ...``), without training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import accuracy


def test_runs_trains_only_the_named_runs_and_reports_the_finished_ones(tmp_path: Path, monkeypatch, capsys) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    task = accuracy.lstm_ptb_task(data.resolve(), 8)
    finished = task.runs[0]  # finished earlier: its result is read, not trained again
    directory = accuracy.run_directory(out, task, finished)
    directory.mkdir(parents=True)
    earlier = {"metric": 116.6, "curve": [[0, 664, 305.0]], "wire_compression": 1.0, "step_time_s": 0.1, "wall_s": 60}
    (directory / "result.json").write_text(json.dumps(earlier))
    trained: list[str] = []

    def fake_train(task: accuracy.Task, run: accuracy.Run, directory: Path) -> dict[str, Any]:
        trained.append(run.label)
        return {**earlier, "metric": 120.0}

    monkeypatch.setattr(accuracy, "train", fake_train)
    accuracy.main(["lstm_ptb", "--data", str(data), "--out", str(out), "--runs", "DGC 1 %"])
    assert trained == ["DGC 1 %"]
    table = (out / "lstm_ptb" / "table.md").read_text()
    assert "| dense | 116.6 |" in table and "| DGC 1 % | 120.0 |" in table
    assert "| DGC 0.1 % | not run |" in table


def test_an_unknown_run_label_is_named_with_the_task_runs(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        accuracy.main(["lstm_ptb", "--data", str(tmp_path), "--runs", "DGC 2 %"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--runs ['DGC 2 %'] are not runs of lstm_ptb" in error and "'DGC 1 %'" in error


def _tiny_ptb(data: Path) -> None:
    """100 lines of 63 words + <eos>: 6,400 tokens, 99 windows of 64, 50 per process, 3 full batches of 16."""
    (data / "ptb").mkdir()
    (data / "ptb" / "ptb.train.txt").write_text(("w " * 63 + "\n") * 100)


def test_ptb_adamw_lr_decay_falls_at_60_and_85_percent_of_the_steps_in_epochs(tmp_path: Path) -> None:
    from benchmarks.accuracy import ptb_adamw_task, ptb_steps_per_epoch

    _tiny_ptb(tmp_path)
    assert ptb_steps_per_epoch(tmp_path) == 3
    decayed = ptb_adamw_task(tmp_path, steps=30, freeze=6, lr_decay=True)
    assert "model.lr_milestones=[6.0,8.5]" in decayed.overrides  # steps 18 and 25.5, at 3 steps per epoch
    assert "lr x0.1 at 60% and 85% of the steps" in decayed.description
    constant = ptb_adamw_task(tmp_path, steps=30, freeze=6)
    assert not any(o.startswith("model.lr_milestones") for o in constant.overrides)
    assert "trainer.val_check_interval=3" in constant.overrides  # 30 // 10
    long = ptb_adamw_task(tmp_path, steps=300, freeze=60)
    assert "trainer.val_check_interval=3" in long.overrides  # not 30: Lightning refuses more than an epoch


@pytest.mark.parametrize(
    ("arguments", "freeze"), [(["--steps", "2000"], 400), (["--steps", "2000", "--freeze", "120"], 120)]
)
def test_ptb_adamw_freezes_after_a_fifth_of_the_steps_unless_told(
    tmp_path: Path, arguments: list[str], freeze: int
) -> None:
    _tiny_ptb(tmp_path)
    accuracy.main(["ptb_adamw", "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--report-only", *arguments])
    assert f"variance frozen after {freeze} steps" in (tmp_path / "out" / "ptb_adamw" / "table.md").read_text()


@pytest.mark.parametrize("task_of", [accuracy.cifar10_task, accuracy.cifar10_4_ranks_task])
def test_cifar10_runs_keep_the_global_batch_and_say_whether_they_feed_the_server_error(task_of, tmp_path: Path) -> None:
    """Each run's configuration as train.py composes it: 128 samples per step at any number of
    processes, and a two-phase run has the server error feedback unless its label says it has none
    (it was the default when those runs were recorded)."""
    from hydra import compose, initialize_config_dir

    task, fed = task_of(tmp_path, 16, 20_000), []
    with initialize_config_dir(str(accuracy.REPO / "configs"), version_base="1.3"):
        for run in task.runs:
            cfg = compose("config", overrides=[f"+recipe={run.recipe}", *task.overrides, *run.overrides])
            assert cfg.trainer.devices * cfg.data.batch_size == accuracy.CIFAR10_GLOBAL_BATCH, run.label
            if cfg.strategy.get("exchange") == "two_phase":
                fed.append(cfg.strategy.server_feedback)
                assert fed[-1] is ("no server feedback" not in run.label), run.label
    assert True in fed and False in fed  # both forms are compared
