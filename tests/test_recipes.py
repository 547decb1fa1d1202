"""Every paper recipe trains through ``train.py`` on 2 CPU processes (made-up data of the real shapes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from apprun import REPO, output, results, train
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

RECIPES = ["resnet20_cifar10", "resnet110_cifar10", "resnet50", "lstm_ptb", "deepspeech_librispeech"]
SMOKE = ["data.synthetic=true", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2"]
# per recipe: 2 samples per process and batch -> 2 steps per epoch, then one validation pass;
# the recurrent models are narrowed to keep the CPU run short (their code paths are unchanged).
SMALL = {
    "resnet20_cifar10": ["data.batch_size=2", "data.synthetic_size=8"],
    "resnet110_cifar10": ["data.batch_size=2", "data.synthetic_size=8"],
    "resnet50": ["data.batch_size=2", "data.synthetic_size=8", "data.image_size=32"],
    "lstm_ptb": ["data.batch_size=2", "data.synthetic_size=8", "model.embedding_size=64", "model.hidden_size=64"],
    "transformer_ptb": [  # AdamW: one plain step, then the variance freezes (a one-step v: small lr)
        "model.lr=1e-5",
        "data.batch_size=2",
        "data.synthetic_size=8",
        "model.d_model=32",
        "model.ff_size=64",
        "strategy.adam_warmup_steps=1",
        "trainer.val_check_interval=null",
    ],
    "deepspeech_librispeech": [
        "data.batch_size=2",
        "data.synthetic_size=8",
        "data.synthetic_frames=64",
        "model.hidden_size=64",
        "model.rnn_layers=2",
    ],
}


@pytest.mark.parametrize("recipe", [f"{r}_dgc" for r in RECIPES] + ["lstm_ptb_dense", "transformer_ptb_dgc"])
def test_recipe_trains_two_steps_on_two_processes(recipe: str, tmp_path: Path) -> None:
    task = recipe.rsplit("_", 1)[0]
    asked = ["trainer.enable_checkpointing=true"] if recipe == "lstm_ptb_dense" else []
    done = train(f"+recipe={recipe}", *SMOKE, *SMALL[task], *asked, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, output(done)
    # made-up data writes no checkpoint unless asked (they reach hundreds of MB)
    assert bool(list(tmp_path.rglob("*.ckpt"))) == bool(asked)
    (result,) = results(tmp_path)
    assert result["name"] == recipe
    assert result["steps"] == 2 and result["world_size"] == 2
    assert result["metric"] is not None and math.isfinite(result["metric"]), result
    assert f"[{recipe}] {result['metric_name']}" in done.stdout  # the run's summary line
    if recipe.endswith("_dgc"):
        assert result["strategy"] == "DGCStrategy" and result["compress_ratio"] == 0.001
        assert result["bytes_sent"] < result["dense_bytes"]  # warm-up already sends only 25 % (Adam: step 2)
    else:
        assert result["strategy"] == "DDPStrategy" and result["compress_ratio"] is None
        assert result["bytes_sent"] == result["dense_bytes"] > 0


def _compose(*overrides: str):
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("task", RECIPES)
def test_dense_twin_differs_from_the_dgc_recipe_only_in_the_exchange(task: str) -> None:
    dgc, dense = _compose(f"+recipe={task}_dgc"), _compose(f"+recipe={task}_dense")
    for key in ("model", "data", "paper", "seed"):
        assert dgc[key] == dense[key], key
    assert {k: v for k, v in dgc.trainer.items() if k != "gradient_clip_val"} == {
        k: v for k, v in dense.trainer.items() if k != "gradient_clip_val"
    }
    assert dgc.strategy.clip_norm == dense.trainer.gradient_clip_val  # same clipping threshold, local for DGC
    assert dgc.strategy._target_ == "lightning_gc.DGCStrategy" and dgc.warmup is not None
    assert dense.strategy._target_.endswith("DDPStrategy") and dense.warmup is None
    assert dgc.paper.baseline is not None


def test_every_strategy_config_builds() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    names = sorted(p.stem for p in (REPO / "configs" / "strategy").glob("*.yaml"))
    from lightning_gc import available

    assert {"dense", *available()} <= set(names)  # a config for every registered compressor
    for name in names:
        sparse = name in ("dgc", "topk", "randomk", "fft")
        cfg = _compose(f"strategy={name}", *(["strategy.compress_ratio=0.05"] if sparse else []))
        strategy = instantiate(cfg.strategy)
        assert isinstance(strategy, DDPStrategy), name
        if sparse:
            assert strategy.compress_ratio == 0.05


def test_a_run_that_stops_before_its_first_validation_validates_once_at_the_end(tmp_path: Path) -> None:
    """``trainer.max_steps`` below one epoch (8 steps here): the run validates once after the fit,
    so its result and summary line carry the metric instead of ``n/a``."""
    small = [o for o in SMALL["lstm_ptb"] if not o.startswith("data.synthetic_size")]
    done = train("+recipe=lstm_ptb_dgc", *SMOKE, *small, "data.synthetic_size=32", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, output(done)
    (result,) = results(tmp_path)
    assert result["steps"] == 2  # of 8 in the first epoch
    assert result["metric"] is not None and math.isfinite(result["metric"]), result
    assert len(result["curve"]) == 1 and result["curve"][0][1] == 2
    assert f"{result['metric_name']} {result['metric']:.4f}" in done.stdout
    assert "v_num" not in done.stdout  # the progress bar shows metrics, not the logger's version
    # the PTB task tests the final model on the test split (test_after_fit=true)
    assert result["test_metric_name"] == "test/ppl" and math.isfinite(result["test_metric"]), result
    assert result["test_metric"] != result["metric"]  # another split (made up with another seed)
    assert f"test/ppl {result['test_metric']:.4f}" in done.stdout
