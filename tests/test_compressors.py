"""Compressors by name: registry, presets, argument routing, and 2-rank training with each."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc import GradientCompressionStrategy, available
from lightning_gc.compressors import create
from recipes.quickstart import NUM_CLASSES, NUM_FEATURES

SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
HIDDEN = [1024, 1024]


def test_every_compressor_has_a_preset() -> None:
    assert {"none", "fp16", "bf16", "topk", "dgc"} <= set(available())
    for name in available():
        strategy = StrategyRegistry.get(f"{name}_ddp")
        assert isinstance(strategy, GradientCompressionStrategy) and strategy.compressor.name == name


def test_arguments_go_to_the_compressor_or_to_ddp() -> None:
    strategy = GradientCompressionStrategy("topk", compress_ratio=0.05, bucket_cap_mb=4, find_unused_parameters=True)
    assert strategy.compressor.config()["compress_ratio"] == 0.05
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 4, "find_unused_parameters": True}
    obj = GradientCompressionStrategy(create("fp16"))
    assert obj.compressor.name == "fp16"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compressor": "zip"}, "must be one of ['bf16', 'dgc', 'fp16', 'none', 'topk'"),
        ({"compressor": "topk", "levels": 2}, "unknown argument(s) ['levels']"),
        ({"compressor": "fp16", "compress_ratio": 0.1}, "compressor 'fp16' takes []"),
        ({"compressor": "topk", "bucket_cap": 4}, "DDP takes"),
        ({"compressor": "topk", "compress_ratio": 0}, "`compress_ratio` must be in (0, 1], got 0"),
        ({"compressor": 3}, "or a lightning_gc Compressor, got 3"),
    ],
)
def test_bad_compressor_arguments_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        GradientCompressionStrategy(**kwargs)
    assert message in str(error.value)


def test_training_with_each_compressor(run_ranks) -> None:
    """2 ranks: identical parameters, falling loss, and gc/wire_ratio == dense bytes / bytes sent."""
    names = ["none", "fp16", "bf16", "topk"]
    model = {"hidden": HIDDEN, **SGD}
    fits = [{"strategy": {"kind": "ddp"}, "model": model, "epochs": 3}]
    fits += [{"strategy": {"kind": "gc", "compressor": n}, "model": model, "epochs": 3} for n in names]
    rank0, rank1 = run_ranks({"fits": fits})
    ddp, results = rank0[0], dict(zip(names, rank0[1:]))

    widths = [NUM_FEATURES, *HIDDEN, NUM_CLASSES]
    weights = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    dense_bytes = 4 * (weights + sum(widths[1:]))
    for name, ours in results.items():
        assert torch.equal(ours["params"], rank1[1 + names.index(name)]["params"]), name
        losses = [m["train/loss_epoch"] for m in ours["epoch_metrics"]]
        assert losses[-1] < 0.5 * losses[0], (name, losses)
        metrics = ours["epoch_metrics"][-1]
        assert metrics["gc/dense_bytes"] == dense_bytes
        assert metrics["gc/wire_ratio"] == pytest.approx(dense_bytes / metrics["gc/bytes_sent"])

    # none: plain DDP through our path (error feedback of an exact send is a no-op)
    assert ((results["none"]["params"] - ddp["params"]).abs().max() / ddp["params"].abs().max()) < 1e-5
    assert results["none"]["epoch_metrics"][-1]["gc/wire_ratio"] == 1.0
    assert results["fp16"]["epoch_metrics"][-1]["gc/wire_ratio"] == 2.0
    assert results["bf16"]["epoch_metrics"][-1]["gc/wire_ratio"] == 2.0
    assert results["topk"]["epoch_metrics"][-1]["gc/wire_ratio"] >= 45  # 1 % of a 1.1 M-parameter model
