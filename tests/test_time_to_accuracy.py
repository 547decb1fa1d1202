"""The time-to-accuracy benchmark (issue #52): its smoke mode end to end on loopback (2 processes,
no root, no tc), and the composition arithmetic on hand-made trajectories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.time_to_accuracy import compose, modes, nets
from benchmarks.time_to_accuracy.compose import Trajectory
from benchmarks.time_to_accuracy.phases import kind_medians

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SMOKE_MODES = ("dense", "dgc", "fp16_hook")


def trajectory(mode: str, metrics: list[float], kinds: list[tuple[str, int]], every: int = 10) -> Trajectory:
    evals = [
        {"step": i * every, "metric": m, "tcp_bytes": 1000 * i * every, "train_s": 0.0} for i, m in enumerate(metrics)
    ]
    meta = {"type": "meta", "mode": mode}
    return Trajectory(mode, meta, evals, {"kinds": [list(k) for k in kinds], "tcp_bytes": 1000 * every * len(metrics)})


def test_composition_arithmetic_on_hand_made_trajectories() -> None:
    # accuracy: dense ends at 80 (target 80, 95 %: 76); "fast" gets there in fewer, cheaper steps
    dense = trajectory("dense", [10, 50, 76, 79, 80], [("step", 40)])
    fast = trajectory("fast", [10, 60, 77, 81, 82], [("density=0.25", 10), ("density=0.001", 30)])
    never = trajectory("never", [10, 20, 30, 40, 50], [("step", 40)])
    assert compose.targets(80.0, higher_is_better=True) == (80.0, pytest.approx(76.0))
    assert compose.targets(100.0, higher_is_better=False) == (100.0, pytest.approx(100 / 0.95))
    assert compose.steps_to_target(dense.evals, 76.0, True) == 20
    assert compose.steps_to_target(fast.evals, 80.0, True) == 30
    assert compose.steps_to_target(never.evals, 76.0, True) is None
    assert compose.composed_time(fast.kinds, {"density=0.25": 0.3, "density=0.001": 0.1}, 30) == pytest.approx(5.0)
    with pytest.raises(KeyError, match="density=0.25"):
        compose.composed_time(fast.kinds, {"density=0.001": 0.1}, 30)
    times = {
        "dense": {"step": {"step_s": 0.5}},
        "fast": {"density=0.25": {"step_s": 0.3}, "density=0.001": {"step_s": 0.1}},
        "never": {"step": {"step_s": 0.1}},
    }
    measured = {"fast": trajectory("fast", [10, 60, 77, 81, 82], [("x", 40)])}
    for e in measured["fast"].evals:
        e["train_s"] = e["step"] * 0.12  # 3.6 s at step 30
    runs = {"dense": dense, "fast": fast, "never": never}
    rows = {r.mode: r for r in compose.compose_link(runs, times, True, measured, {"dense": 0.4, "fast": 0.1})}
    assert rows["dense"].steps == (20, 40) and rows["dense"].time_s == (pytest.approx(10.0), pytest.approx(20.0))
    assert rows["fast"].steps == (20, 30) and rows["fast"].time_s == (pytest.approx(4.0), pytest.approx(5.0))
    assert rows["fast"].of_dense == (pytest.approx(0.4), pytest.approx(0.25))
    assert rows["never"].steps == (None, None) and rows["never"].of_dense == (None, None)
    assert rows["fast"].bytes_to_final == 30_000 and rows["fast"].bytes_run == 50_000
    assert rows["fast"].predicted_s == pytest.approx(3.0) and rows["dense"].predicted_s == pytest.approx(16.0)
    assert rows["fast"].measured_s == pytest.approx(3.6)
    assert rows["fast"].composition_error == pytest.approx((5.0 - 3.6) / 3.6)
    assert [t for t, _ in rows["fast"].curve] == pytest.approx([0.0, 3.0, 4.0, 5.0, 6.0])
    table = compose.markdown(list(rows.values()), "top-1 %")
    assert "| fast | 82.00 | 20 | 4 s | 0.40 | 30 | 5 s | 0.25 | 3.6 s | +38.9 % | 3 s | 0.03 | 0.05 |" in table
    assert "| never | 50.00 | – | – | – | – | – | – |" in table
    # perplexity: lower is better, 95 % is final / 0.95
    lm = compose.compose_link(
        {"dense": trajectory("dense", [300, 150, 120, 100], [("step", 30)]),
         "m": trajectory("m", [300, 104, 99, 98], [("step", 30)])},
        {"dense": {"step": {"step_s": 1.0}}, "m": {"step": {"step_s": 2.0}}}, False,
    )  # fmt: skip
    assert [(r.steps, r.of_dense) for r in lm] == [((30, 30), (1.0, 1.0)), ((10, 20), (pytest.approx(2 / 3), 4 / 3))]


def test_kind_medians_leave_out_the_warm_up_and_each_stretch_first_step() -> None:
    end = {
        "offset": 2,
        "step_kinds": ["a", "a", "a", "a", "a", "b", "b", "b", "s", "b", "b"],
        "step_s": [9.0, 9.0, 1.0, 1.2, 1.1, 5.0, 2.0, 2.2, 7.0, 6.0, 2.1],
        "step_tcp_bytes": [10, 20, 30, 40, 50, 60, 80, 100, 200, 210, 220],
    }
    medians = kind_medians(end)
    assert medians["a"] == {"step_s": pytest.approx(1.1), "tcp_bytes": 10}
    assert medians["b"]["step_s"] == pytest.approx(2.1)  # 5.0 and 6.0 open stretches of "b"
    assert medians["s"] == {"step_s": 7.0, "tcp_bytes": 100}  # a lone step is its own kind's sample


def test_smoke_mode_produces_trajectories_table_and_chart(tmp_path: Path) -> None:
    """Three modes (dense, ours through ``attach``, a torch hook) on two loopback processes."""
    command = [sys.executable, "-m", "benchmarks.time_to_accuracy", "--task", "cifar10", "--smoke"]
    command += ["--modes", ",".join(SMOKE_MODES), "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    task = tmp_path / "cifar10"
    for mode in SMOKE_MODES:
        records = [json.loads(line) for line in (task / "accuracy" / f"{mode}.jsonl").read_text().splitlines()]
        assert [r["type"] for r in records] == ["meta", "eval", "eval", "eval", "eval", "end"]
        evals = records[1:-1]
        assert [e["step"] for e in evals] == [0, 2, 4, 6] and [e["samples"] for e in evals] == [0, 16, 32, 48]
        assert all(0 <= e["metric"] <= 100 for e in evals)
        sent = [e["tcp_bytes"] for e in evals]
        assert sent[0] < sent[1] < sent[2] < sent[3]  # every mode exchanges every step
        assert 0 < evals[1]["train_s"] < evals[3]["train_s"]
        assert sum(n for _, n in records[-1]["kinds"]) == 6
    dense, dgc = (Trajectory.load(task / "accuracy" / f"{m}.jsonl") for m in ("dense", "dgc"))
    assert dgc.end["tcp_bytes"] < dense.end["tcp_bytes"]  # DGC's warm-up densities start at 25 %
    assert dgc.evals[-1]["payload_bytes"] > 0 and dense.evals[-1]["payload_bytes"] is None
    steptime = json.loads((task / "steptime-loopback.json").read_text())
    assert steptime["socket_bps"] > 0 and set(steptime["modes"]) == {"noop", *SMOKE_MODES}
    assert set(steptime["modes"]["dgc"]) == {f"density={d:g}" for d in (0.25, 0.0625, 0.015625, 0.00390625, 0.001)}
    table = (task / "table.md").read_text()
    assert "#### link loopback" in table and "time to final (composed)" in table
    for mode in SMOKE_MODES:
        assert f"| {mode} |" in table
    assert "end to end dgc@loopback" in table
    assert (task / "time_to_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shaped_links_are_refused_without_root_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from benchmarks.time_to_accuracy import __main__ as cli

    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as refused:
        cli.main(["--task", "cifar10", "--links", "100mbit", "--out", str(tmp_path)])
    message = str(refused.value)
    assert "need root (network namespaces, tc)" in message and "\n" not in message
    assert not (tmp_path / "cifar10").exists()
    assert "--end-to-end MODE@LINK" in (cli.__doc__ or "")


def test_the_workers_networks_are_the_recipes_and_densities_the_papers() -> None:
    """The LSTM network a worker builds is the recipe's, parameter for parameter from the same seed
    (both come from recipes.plain), and DGC's warm-up densities are the paper's."""
    import torch

    from lightning_gc import PAPER_WARMUP_DENSITIES
    from recipes.language import LSTMLanguageModel

    torch.manual_seed(3)
    mine = nets.LanguageModel(50, 16)
    torch.manual_seed(3)
    recipe = LSTMLanguageModel(50, 16, 16, dropout=0.2)
    assert [(n, p.shape) for n, p in mine.named_parameters()] == [(n, p.shape) for n, p in recipe.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), recipe.parameters()))
    tokens = torch.randint(0, 50, (2, 7))
    assert torch.equal(mine.eval()(tokens), recipe.eval()(tokens))
    assert modes.WARMUP_DENSITIES == PAPER_WARMUP_DENSITIES


def test_a_worker_imports_neither_lightning_nor_torchvision() -> None:
    """Every launch would pay ~5 s for them (the smoke test launches 7 pairs of processes)."""
    code = (
        "import sys\n"
        "from benchmarks.time_to_accuracy import modes, tasks, worker\n"
        "for name in ('cifar10', 'ptb'):\n"
        "    tasks.build_model(tasks.config(name, smoke=True), 50)\n"
        "heavy = [m for m in ('lightning', 'torchvision', 'torchmetrics', 'recipes.common') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(not (SHARED_DATA / "ptb").is_dir(), reason="needs the shared data folder (../shared/data)")
def test_the_ptb_task_holds_out_the_validation_text(tmp_path: Path) -> None:
    from benchmarks.time_to_accuracy import tasks

    cfg = tasks.config("ptb")
    data = tasks.TaskData(cfg, tasks.prepare(cfg, SHARED_DATA, tmp_path), seed=0)
    assert data.vocab == 10_000 and data.train_x.shape[1] == cfg.bptt
    assert 600 < data.steps_per_epoch < 800 and len(data.val_x) > 2000
    x, y = data.batch(5, rank=1)
    assert x.shape == (cfg.batch_size, cfg.bptt) and bool((x[:, 1:] == y[:, :-1]).all())
    assert not torch_equal(data.batch(5, rank=0)[0], x)  # the ranks' shards differ


def torch_equal(a, b) -> bool:
    return bool((a == b).all())
