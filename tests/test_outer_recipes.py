"""The outer-loop recipes (transformer_ptb_diloco / _sparseloco, resnet20_cifar10_diloco / _sparseloco):
they compose as their dense twins with the outer loop's strategy, one trains for real on the shared PTB
files, and a sweep over ``strategy.sync_every`` and ``strategy.compress_ratio`` is what the report draws."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from apprun import REPO, SHARED_DATA, output, results
from conftest import train_under_torchrun
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from rich.console import Console

OUTER_RECIPES = {  # recipe: (its dense twin, the outer preset, H, density or None)
    "transformer_ptb_diloco": ("transformer_ptb_dense", "diloco", 30, None),
    "transformer_ptb_sparseloco": ("transformer_ptb_dense", "sparseloco", 30, 0.02),
    "resnet20_cifar10_diloco": ("resnet20_cifar10_dense", "diloco", 30, None),
    "resnet20_cifar10_sparseloco": ("resnet20_cifar10_dense", "sparseloco", 30, 0.02),
}


def _compose(*overrides: str):
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("recipe", sorted(OUTER_RECIPES))
def test_outer_recipe_is_its_dense_twin_with_the_outer_loop(recipe: str) -> None:
    twin, preset, sync_every, density = OUTER_RECIPES[recipe]
    outer, dense = _compose(f"+recipe={recipe}"), _compose(f"+recipe={twin}")
    for key in ("model", "data", "trainer", "seed", "compare_dense", "test_after_fit"):
        assert outer[key] == dense[key], key  # same model, optimizer (AdamW / SGD-momentum inner), data, steps
    assert outer.name == recipe and outer.warmup is None
    assert outer.strategy._target_ == "lightning_gc.OuterLoopStrategy" and outer.strategy.preset == preset
    strategy = instantiate(outer.strategy)
    built = strategy.outer_arguments
    assert (built.preset, built.sync_every) == (preset, sync_every)
    if density is not None:
        assert strategy.compressor.compress_ratio == density and built.error_decay == 0.95
        assert strategy.compressor.name == "chunk_topk"  # SparseLoCo's codec, from configs/strategy/sparseloco.yaml
    else:
        assert strategy.compressor.name == "none" and (built.outer_lr, built.outer_nesterov) == (0.7, True)
    inner = outer.model.get("optimizer", "adamw")
    assert inner == ("sgd" if recipe.startswith("resnet") else "adamw")


def test_the_sweep_documented_in_the_recipe_composes_job_by_job() -> None:
    """Each job of ``-m strategy.sync_every=15,30,100 strategy.compress_ratio=0.01,0.02,0.03`` builds."""
    text = (REPO / "configs" / "recipe" / "transformer_ptb_sparseloco.yaml").read_text()
    assert "strategy.sync_every=15,30,100" in text and "strategy.compress_ratio=0.01,0.02,0.03" in text
    for sync_every in (15, 100):
        for ratio in (0.01, 0.03):
            cfg = _compose(
                "+recipe=transformer_ptb_sparseloco",
                f"strategy.sync_every={sync_every}",
                f"strategy.compress_ratio={ratio}",
            )
            strategy = instantiate(cfg.strategy)
            assert strategy.outer_arguments.sync_every == sync_every and strategy.compressor.compress_ratio == ratio


def _outer_result(sync_every: int, ratio: float, perplexity: float) -> dict:
    overrides = ["+recipe=transformer_ptb_sparseloco", f"strategy.sync_every={sync_every}"]
    return {
        "name": "transformer_ptb_sparseloco",
        "strategy": "OuterLoopStrategy",
        "compressor": "chunk_topk",
        "compress_ratio": ratio,
        "overrides": [*overrides, f"strategy.compress_ratio={ratio}"],
        "metric_name": "val/ppl",
        "metric": perplexity,
        "wire_compression": 4 * sync_every / (ratio * 1.8),
        "step_time_s": 0.1,
        "samples_per_s": 100.0,
    }


def test_report_draws_one_line_per_sync_every_against_the_density(tmp_path: Path) -> None:
    from recipes.report import report, series, sweep_runs

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    grid = [(h, r) for h in (15, 30) for r in (0.01, 0.02, 0.03)]
    for index, (h, r) in enumerate(grid):
        (sweep / str(index) / ".hydra").mkdir(parents=True)
        (sweep / str(index) / "result.json").write_text(json.dumps(_outer_result(h, r, 300 - 1000 * r + h)))
    rows, stale, missing = sweep_runs(sweep)
    assert len(rows) == 6 and not stale and not missing
    lines = series(rows)
    assert sorted(lines) == ["chunk_topk strategy.sync_every=15", "chunk_topk strategy.sync_every=30"]
    assert all(sorted(r["compress_ratio"] for r in runs) == [0.01, 0.02, 0.03] for runs in lines.values())
    console = Console(file=io.StringIO(), width=250)
    png = report(sweep, console)
    assert "6 run(s)" in console.file.getvalue() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not (SHARED_DATA / "ptb").is_dir(), reason=f"no PTB files in {SHARED_DATA}")
def test_diloco_recipe_trains_on_the_real_ptb_files(tmp_path: Path) -> None:
    """4 AdamW steps on 2 processes, a sync every 2: two syncs of the exact pseudo-gradient, theta_g
    validated; the report reads the run."""
    from recipes.report import report

    run_dir = tmp_path / "run"
    small = ["model.d_model=32", "model.ff_size=64", "data.batch_size=2", "trainer.limit_val_batches=2"]
    done = train_under_torchrun(
        "+recipe=transformer_ptb_diloco",
        f"data.root={SHARED_DATA / 'ptb'}",
        "data.download=false",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=null",
        "trainer.enable_checkpointing=false",
        "test_after_fit=false",
        "strategy.sync_every=2",
        *small,
        f"hydra.run.dir={run_dir}",
        logs=tmp_path / "ranks",
    )
    assert done.returncode == 0, output(done)
    (result,) = results(run_dir)
    assert result["name"] == "transformer_ptb_diloco" and result["strategy"] == "OuterLoopStrategy"
    assert result["steps"] == 4 and result["world_size"] == 2 and result["compressor"] == "none"
    assert result["metric_name"] == "val/ppl" and math.isfinite(result["metric"]) and result["metric"] > 1
    # 2 syncs of 4 bytes per parameter, where dense DDP would have sent 4 steps' worth
    assert result["bytes_sent"] == 2 * 4 * result["params"] and result["wire_compression"] == pytest.approx(2.0)
    console = Console(file=io.StringIO(), width=250)
    report(run_dir, console)
    assert "1 run(s)" in console.file.getvalue()
