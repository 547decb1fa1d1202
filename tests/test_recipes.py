"""Every paper recipe trains through ``train.py`` on 2 CPU processes (made-up data of the real shapes),
launched as torchrun launches it (tests/conftest.py's ``train_under_torchrun``: warm ranks)."""

from __future__ import annotations

import math
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
from apprun import REPO, SHARED_DATA, output, results
from conftest import train_under_torchrun
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch import nn

RECIPES = ["resnet20_cifar10", "resnet110_cifar10", "resnet50", "lstm_ptb", "deepspeech_librispeech"]
SMOKE = ["data.synthetic=true", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2"]
# per recipe: 2 samples per process and batch -> 2 steps per epoch, then one validation pass;
# the recurrent models are narrowed to keep the CPU run short (their code paths are unchanged).
SMALL = {
    "resnet20_cifar10": ["data.batch_size=2", "data.synthetic_size=8"],
    "resnet50": ["data.batch_size=2", "data.synthetic_size=8", "data.image_size=32"],
    "lstm_ptb": ["data.batch_size=2", "data.synthetic_size=8", "model.embedding_size=64", "model.hidden_size=64"],
    "transformer_ptb": [  # AdamW: one plain step, then the variance freezes (a one-step v: small lr)
        "model.lr=1e-5",
        "data.batch_size=2",
        "data.synthetic_size=8",
        "model.d_model=32",
        "model.ff_size=64",
        "strategy.adam_warmup_steps=1",
        "strategy.adam_min_sends=0",  # no density floor: 1 compressed step would send every element
        "trainer.val_check_interval=null",
    ],
    "deepspeech_librispeech": [
        "data.batch_size=2",
        "data.synthetic_size=8",
        "data.synthetic_frames=64",
        "model.hidden_size=64",
        "model.rnn_layers=2",
    ],
    # the recipe's own small model; 512 frames -> 64 after its time stride of 8, room for the 20-60 letters
    "speech_yesno": ["data.batch_size=2", "data.synthetic_size=8", "data.synthetic_frames=512"],
}
# AdamW: one plain step, then compressed at the recipe's ratio (no floor: 1 step would send every element)
DGC_ONLY = {"speech_yesno": ["strategy.adam_warmup_steps=1", "strategy.adam_min_sends=0"]}
COMPRESS_RATIO = {"speech_yesno_dgc": 0.01}  # the recipes' strategy.compress_ratio where not the paper's 0.001


@pytest.mark.parametrize(
    "recipe",
    # resnet110_cifar10 is resnet20_cifar10 deeper (test_resnet110_recipe_builds_110_layers); lstm_ptb_dgc
    # trains in test_a_run_that_stops_before_its_first_validation_validates_once_at_the_end
    ["resnet20_cifar10_dgc", "resnet50_dgc", "deepspeech_librispeech_dgc"]
    + ["lstm_ptb_dense", "transformer_ptb_dgc", "speech_yesno_dgc"],
)
def test_recipe_trains_two_steps_on_two_processes(recipe: str, tmp_path: Path) -> None:
    task = recipe.rsplit("_", 1)[0]
    asked = ["trainer.enable_checkpointing=true"] if recipe == "lstm_ptb_dense" else []
    small = [*SMALL[task], *(DGC_ONLY.get(task, []) if recipe.endswith("_dgc") else [])]
    run_dir = tmp_path / "run"
    done = train_under_torchrun(
        f"+recipe={recipe}", *SMOKE, *small, *asked, f"hydra.run.dir={run_dir}", logs=tmp_path / "ranks"
    )
    # made-up data writes no checkpoint unless asked (they reach hundreds of MB)
    assert bool(list(run_dir.rglob("*.ckpt"))) == bool(asked)
    _assert_two_steps_of(recipe, done, run_dir)


def _assert_two_steps_of(recipe: str, done: CompletedProcess[str], run_dir: Path) -> dict[str, Any]:
    """The run of ``recipe`` made 2 steps on 2 processes, validated, and sent what its strategy sends."""
    assert done.returncode == 0, output(done)
    (result,) = results(run_dir)
    assert result["name"] == recipe
    assert result["steps"] == 2 and result["world_size"] == 2
    assert result["metric"] is not None and math.isfinite(result["metric"]), result
    assert f"[{recipe}] {result['metric_name']}" in done.stdout  # the run's summary line
    if recipe.endswith("_dgc"):
        assert result["strategy"] == "DGCStrategy" and result["compress_ratio"] == COMPRESS_RATIO.get(recipe, 0.001)
        assert result["bytes_sent"] < result["dense_bytes"]  # warm-up already sends only 25 % (Adam: step 2)
    else:
        assert result["strategy"] == "DDPStrategy" and result["compress_ratio"] is None
        assert result["bytes_sent"] == result["dense_bytes"] > 0
    return result


def test_resnet110_recipe_builds_110_layers() -> None:
    """The paper's ResNet-110 recipe: resnet20_cifar10's training, 109 3x3 convolutions and the classifier."""
    model = instantiate(_compose("+recipe=resnet110_cifar10_dgc").model, _convert_="all")
    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convolutions) + len([m for m in model.modules() if isinstance(m, nn.Linear)]) == 110


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


def test_yesno_twins_differ_only_in_the_exchange() -> None:
    """The yesno recipes (not in the paper): AdamW, whose plain steps before the variance freezes are
    DGC's warm-up, so neither twin has a sparsity warm-up; the same 200 steps of the same model."""
    dgc, dense = _compose("+recipe=speech_yesno_dgc"), _compose("+recipe=speech_yesno_dense")
    for key in ("model", "data", "trainer", "paper", "seed"):
        assert dgc[key] == dense[key], key
    assert dgc.model.optimizer == "adamw" and dgc.data.corpus == "yesno" and dgc.data.n_mels == 40
    assert dgc.trainer.devices == 2 and dgc.trainer.max_epochs == 40
    assert dgc.strategy._target_ == "lightning_gc.DGCStrategy" and dgc.strategy.compress_ratio == 0.01
    assert 0 < dgc.strategy.adam_warmup_steps <= 5 * dgc.trainer.max_epochs // 4  # 5 steps per epoch
    assert dense.strategy._target_.endswith("DDPStrategy") and dgc.warmup is None and dense.warmup is None
    model = instantiate(dgc.model, _convert_="all")
    assert model.time_strides == (2, 4) and sum(p.numel() for p in model.parameters()) < 600_000


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
    run_dir = tmp_path / "run"
    done = train_under_torchrun(
        "+recipe=lstm_ptb_dgc", *SMOKE, *small, "data.synthetic_size=32", f"hydra.run.dir={run_dir}", logs=tmp_path
    )
    result = _assert_two_steps_of("lstm_ptb_dgc", done, run_dir)  # of 8 in the first epoch
    assert len(result["curve"]) == 1 and result["curve"][0][1] == 2
    assert f"{result['metric_name']} {result['metric']:.4f}" in done.stdout
    assert "v_num" not in done.stdout  # the progress bar shows metrics, not the logger's version
    # the PTB task tests the final model on the test split (test_after_fit=true)
    assert result["test_metric_name"] == "test/ppl" and math.isfinite(result["test_metric"]), result
    assert result["test_metric"] != result["metric"]  # another split (made up with another seed)
    assert f"test/ppl {result['test_metric']:.4f}" in done.stdout


def test_deepspeech_front_end_options_keep_the_default_and_name_bad_values() -> None:
    import torch

    from recipes.speech import DeepSpeech

    default = DeepSpeech(rnn_layers=1, hidden_size=8)  # DeepSpeech 2's front end, as the LibriSpeech recipe has it
    assert [tuple(m.kernel_size) for m in default.conv if isinstance(m, torch.nn.Conv2d)] == [(11, 41), (11, 21)]
    assert [tuple(m.stride) for m in default.conv if isinstance(m, torch.nn.Conv2d)] == [(2, 2), (1, 2)]
    assert default.rnn.input_size == 32 * 20 and default.time_strides == (2, 1)
    small = DeepSpeech(
        n_mels=40, conv_channels=4, conv_kernels=[[5, 5], [3, 5]], conv_strides=[[2, 2], [4, 2]], hidden_size=8
    )
    assert small.rnn.input_size == 4 * 10 and small.hparams.conv_strides == [[2, 2], [4, 2]]
    for frames in (1, 7, 8, 9, 64, 101):  # the computed lengths are the frames the convolutions produce
        log_probs, lengths = small(torch.randn(2, frames, 40), torch.tensor([frames, max(1, frames // 2)]))
        assert log_probs.shape[1] == lengths[0] == (frames - 1) // 8 + 1
    for bad, message in [
        ({"conv_kernels": [[4, 5], [5, 5]]}, "`model.conv_kernels\\[0\\]\\[0\\]` must be odd, got 4"),
        ({"conv_kernels": [[5, 5]]}, "`model.conv_kernels` must be two \\[time, frequency\\] pairs"),
        ({"conv_strides": [[2, 0], [1, 2]]}, "`model.conv_strides\\[0\\]\\[1\\]` must be an integer >= 1, got 0"),
        ({"conv_strides": [[2, 2], 3]}, "`model.conv_strides\\[1\\]` must be a \\[time, frequency\\] pair"),
        ({"hidden_size": 0}, "`model.hidden_size` must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            DeepSpeech(**bad)


@pytest.mark.skipif(not (SHARED_DATA / "yesno").is_dir(), reason=f"no yesno corpus in {SHARED_DATA}")
def test_yesno_dgc_recipe_learns_the_real_corpus(tmp_path: Path) -> None:
    """Half the recipe (20 epochs, 100 steps: 50 plain AdamW, 50 at the floor's 16 % density) on the real corpus,
    2 CPU processes, validated once at the end: the DGC run leaves CTC's all-blank plateau at about
    epoch 13 and reaches val/wer 0.02 by epoch 17 here (seed 0); the bound leaves room for other
    machines' numerics to shift that by a few epochs."""
    root = SHARED_DATA / "yesno"
    quick = ["trainer.max_epochs=20", "+trainer.check_val_every_n_epoch=20", "trainer.enable_checkpointing=false"]
    run_dir = tmp_path / "run"
    done = train_under_torchrun(
        "+recipe=speech_yesno_dgc", f"data.root={root}", *quick, f"hydra.run.dir={run_dir}", logs=tmp_path
    )
    assert done.returncode == 0, output(done)
    (result,) = results(run_dir)
    assert result["steps"] == 100 and result["world_size"] == 2 and result["final_ratio"] == 0.01
    assert result["metric"] < 0.5, result["curve"]
    # 50 dense steps, then 50 at the Adam hand-over's density floor, 8 sends per element over 50
    # compressed steps: 16 % of the values, ~1/3 of the bytes with their indices (small tensors dense)
    assert 0.6 < result["bytes_sent"] / result["dense_bytes"] < 0.7
