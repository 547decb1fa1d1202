"""End-to-end DGC training on two real gloo processes (see tests/workers/fit_worker.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY
from recipes.quickstart import NUM_CLASSES, NUM_FEATURES

SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_dense_limit_equals_ddp_with_the_same_sgd(run_ranks) -> None:
    """compress_ratio=1: DGC == DDP + SGD(momentum=0.9, weight_decay=1e-4), plain and Nesterov."""
    fits = []
    for nesterov in (False, True):
        model = {"hidden": [64, 64], **SGD, "nesterov": nesterov}
        fits += [
            {"strategy": {"kind": "ddp"}, "model": model, "epochs": 2},
            {"strategy": {"kind": "dgc", "compress_ratio": 1.0}, "model": model, "epochs": 2},
        ]
    rank0, rank1 = run_ranks({"fits": fits})
    for ddp, dgc in (rank0[0:2], rank0[2:4]):
        assert ddp["global_step"] == dgc["global_step"] >= 20
        assert _relative_difference(dgc["params"], ddp["params"]) < 1e-5
        # and it really trained: parameters moved far more than the tolerance
        assert _relative_difference(dgc["epoch_params"][0], dgc["params"]) > 1e-2
    assert torch.equal(rank0[1]["params"], rank1[1]["params"])


def test_channels_last_weights_pair_their_bucket_slices_with_the_right_elements(run_ranks) -> None:
    """DDP lays a channels_last weight's gradient out N, H, W, C in its bucket: weight decay at
    ratio 1 still equals DDP's, the average a delayed run owes at the end lands where a contiguous
    twin's does, and Adam's first moment handed to the memory at the freeze matches a contiguous
    twin's (a row-major reading of the weights pairs each gradient with another element). Ranks
    end bitwise equal in every run, OD-SGD's local update included (its own-term swaps round
    differently on each rank, so the end of training takes rank 0's parameters)."""
    sgd = {"hidden": [8], **SGD, "weight_decay": 0.05}
    dgc = {"kind": "dgc", "compress_ratio": 1.0, "min_compress_numel": 1}
    delayed = {**dgc, "compress_ratio": 0.1, "delay": 1, "sync_warmup_steps": 0}
    adamw = {"hidden": [8], "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01}
    frozen = {**dgc, "compress_ratio": 0.1, "adam_warmup_steps": 5}
    fits = [
        {"strategy": strategy, "model": {**model, "channels_last": layout}, "variant": "conv", "epochs": 2}
        for strategy, model, layouts in (
            ({"kind": "ddp"}, sgd, (True,)),
            (dgc, sgd, (True,)),
            (delayed, sgd, (True, False)),
            ({**delayed, "local_update": True}, sgd, (True,)),
            (frozen, adamw, (True, False)),
        )
        for layout in layouts
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    ddp, at_ratio_one, delayed_last, delayed_contiguous, _, adam_last, adam_contiguous = rank0
    assert ddp["global_step"] == at_ratio_one["global_step"] >= 20
    assert _relative_difference(at_ratio_one["params"], ddp["params"]) < 1e-5
    assert _relative_difference(ddp["epoch_params"][0], ddp["params"]) > 1e-2  # the decay mattered
    assert _relative_difference(delayed_last["params"], delayed_contiguous["params"]) < 1e-5
    assert _relative_difference(adam_last["params"], adam_contiguous["params"]) < 1e-5
    for run in range(len(fits)):  # OD-SGD's local update too: its own-term swaps round differently per rank
        assert torch.equal(rank0[run]["params"], rank1[run]["params"])


def test_schedules_that_rewrite_momentum_and_decay_are_followed(run_ranks) -> None:
    """Momentum cycled every step, weight decay raised mid-run, then momentum set to 0, plain and
    Nesterov, and a second fit's new optimizer: DGC at ratio 1 still equals DDP, so the memory
    followed all four (and the optimizer applied none a second time). Nesterov's memory keeps
    SGD's own buffer: kept as DGC's paper writes it, ``m`` times the buffer, a changed ``m``
    multiplied last step's buffer (5e-2 off)."""
    fits = [
        {"strategy": strategy, "model": {"hidden": [64], **SGD, "nesterov": nesterov}, "epochs": 2}
        | {"variant": "rewrites_optimizer"}
        for nesterov in (False, True)
        for strategy in ({"kind": "ddp"}, {"kind": "dgc", "compress_ratio": 1.0})
    ]
    # a second fit on the same Trainer builds a new optimizer, whose momentum starts at zero under
    # DDP: the first fit's compression memory must not carry into it (it did: 0.78 off)
    fits += [
        {"strategy": strategy, "model": {"hidden": [64], **SGD}, "epochs": 1, "refit": {"epochs": 2}}
        for strategy in ({"kind": "ddp"}, {"kind": "dgc", "compress_ratio": 1.0})
    ]
    rank0, _ = run_ranks({"fits": fits})
    for ddp, dgc in (rank0[:2], rank0[2:4], rank0[4:]):
        assert ddp["global_step"] == dgc["global_step"] >= 20
        assert _relative_difference(dgc["params"], ddp["params"]) < 1e-5


def test_a_parameter_unused_on_one_rank_only_still_equals_ddp(run_ranks) -> None:
    """find_unused_parameters=True with a layer each rank skips on alternate batches: where it is
    unused locally but used globally, DDP averages a zero from this rank, so memory must take a
    zero local gradient (momentum decays, weight decay applies) rather than set it aside."""
    model = {"hidden": [64], **SGD}
    fits = [
        {
            "strategy": {**kind, "find_unused_parameters": True},
            "model": model,
            "variant": "used_on_one_rank",
            "epochs": 2,
        }
        for kind in ({"kind": "ddp"}, {"kind": "dgc", "compress_ratio": 1.0})
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    ddp, dgc = rank0
    assert ddp["global_step"] == dgc["global_step"] >= 20
    assert _relative_difference(dgc["params"], ddp["params"]) < 1e-5
    assert torch.equal(rank0[1]["params"], rank1[1]["params"])


def test_dgc_at_0_1_percent_on_a_million_parameters(run_ranks) -> None:
    """ratio 0.001, 1.1 M params: ranks stay identical, <= 1/250 of dense bytes, loss falls."""
    hidden = [1024, 1024]
    fit = {"strategy": {"kind": "dgc", "compress_ratio": 0.001}, "model": {"hidden": hidden, **SGD}, "epochs": 4}
    rank0, rank1 = run_ranks({"fits": [fit]})
    ours, theirs = rank0[0], rank1[0]
    assert ours["params"].numel() >= 1_000_000
    for epoch, (a, b) in enumerate(zip(ours["epoch_params"], theirs["epoch_params"])):
        assert torch.equal(a, b), f"ranks diverged after epoch {epoch}"

    widths = [NUM_FEATURES, *hidden, NUM_CLASSES]
    compressed_numel = sum(a * b for a, b in zip(widths[:-1], widths[1:]))  # weight matrices
    dense_numel = sum(widths[1:])  # biases go dense, 4 bytes each
    metrics = ours["epoch_metrics"][-1]
    compressed_bytes_sent = metrics["gc/bytes_sent"] - 4 * dense_numel
    assert 0 < compressed_bytes_sent <= 4 * compressed_numel / 250
    assert metrics["gc/dense_bytes"] == 4 * (compressed_numel + dense_numel)
    assert metrics["gc/wire_ratio"] == pytest.approx(metrics["gc/dense_bytes"] / metrics["gc/bytes_sent"])

    losses = [m["train/loss_epoch"] for m in ours["epoch_metrics"]]
    assert losses[-1] < 0.5 * losses[0], losses


def test_momentum_given_to_the_strategy_equals_momentum_taken_from_sgd(run_ranks) -> None:
    base = {"hidden": [128], "lr": 0.05, "weight_decay": 0.0}
    from_sgd = {"strategy": {"kind": "dgc", "compress_ratio": 0.01}, "model": {**base, "momentum": 0.9}, "epochs": 1}
    explicit = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.01, "momentum": 0.9},
        "model": {**base, "momentum": 0.0},
        "epochs": 1,
    }
    plain = {"strategy": {"kind": "dgc", "compress_ratio": 0.01}, "model": {**base, "momentum": 0.0}, "epochs": 1}
    (a, b, c), _ = run_ranks({"fits": [from_sgd, explicit, plain]})
    assert torch.equal(a["params"], b["params"])
    assert not torch.allclose(a["params"], c["params"])  # momentum made a difference


def test_adam_trains_with_plain_error_feedback(run_ranks) -> None:
    """momentum_correction=False: the compressed raw gradient under Adam's own state (the Adam
    hand-over, the default with momentum correction, is tested in test_adam.py)."""
    fit = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.01, "momentum_correction": False},
        "model": {"hidden": [256], "lr": 1e-2, "optimizer": "adam"},
        "epochs": 3,
    }
    rank0, rank1 = run_ranks({"fits": [fit]})
    assert torch.equal(rank0[0]["params"], rank1[0]["params"])
    losses = [m["train/loss_epoch"] for m in rank0[0]["epoch_metrics"]]
    assert losses[-1] < 0.6 * losses[0], losses
    assert rank0[0]["memory_entries"] == ["velocity"]  # no momentum kept: the optimizer has its own


def test_bucket_rebuild_and_exact_resume(run_ranks, tmp_path: Path) -> None:
    """>= 3 buckets across DDP's rebuild for 3 epochs; resuming a mid-run checkpoint gives the same parameters."""
    ckpt_dir = tmp_path / "ckpts"
    common = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.01, "bucket_cap_mb": 0.004, "value_dtype": "float16"},
        "model": {"hidden": [128, 128], **SGD, "nesterov": True},
        "warmup": {"densities": [0.25, 0.05]},
        "epochs": 3,
    }
    straight = run_ranks({"fits": [{**common, "checkpoint_dir": str(ckpt_dir)}]}, name="straight")
    mid_run = ckpt_dir / "epoch=0.ckpt"
    resumed = run_ranks({"fits": [{**common, "resume_from": str(mid_run)}]}, name="resumed")

    full = straight[0][0]
    assert len(full["buckets"]) >= 3
    assert full["layouts_built"] > len(full["buckets"])  # iteration 0's layout, then the rebuilt ones
    for rank in range(2):
        assert torch.equal(resumed[rank][0]["params"], full["params"])
    assert resumed[0][0]["hook_step"] == full["hook_step"]

    checkpoint = torch.load(mid_run, weights_only=True)
    entry = checkpoint[CHECKPOINT_KEY]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    assert entry["compressor"]["name"] == "dgc"
    assert entry["ranks"][0]["resume_settings"] == {"momentum_correction": True}  # what the memory holds
    v0 = entry["ranks"][0]["memory"]["net.0.weight"]["velocity"]
    v1 = entry["ranks"][1]["memory"]["net.0.weight"]["velocity"]
    assert v0.abs().sum() > 0 and not torch.equal(v0, v1)  # residuals are per rank
    optimizer_group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert (optimizer_group["momentum"], optimizer_group["nesterov"]) == (0.9, True)  # the user's values
    assert not checkpoint["optimizer_states"][0]["state"]  # but SGD itself kept no momentum buffers


def test_stats_reach_the_csv_logger(run_ranks, tmp_path: Path) -> None:
    csv_dir = tmp_path / "csv"
    fit = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.01},
        "model": {"hidden": [256], **SGD},
        "epochs": 1,
        "csv_dir": str(csv_dir),
    }
    run_ranks({"fits": [fit]})
    rows = list(csv.DictReader(open(csv_dir / "version_0" / "metrics.csv")))
    stat_rows = [r for r in rows if r.get("gc/bytes_sent")]
    assert len(stat_rows) >= 20  # one per optimizer step
    for row in stat_rows:
        sent, dense = float(row["gc/bytes_sent"]), float(row["gc/dense_bytes"])
        assert float(row["gc/wire_ratio"]) == pytest.approx(dense / sent, rel=1e-5)
        assert 0 < float(row["gc/density"]) < 0.05
        assert float(row["gc/compress_s"]) > 0
    assert float(stat_rows[-1]["gc/wire_ratio"]) > 20


def test_spawn_preset_trains_through_lightnings_own_launcher() -> None:
    """``strategy="dgc_ddp_spawn"``: Lightning spawns the 2 processes itself (the strategy is pickled)."""
    import lightning as L

    import lightning_gc  # noqa: F401  (registers the names)
    from recipes.quickstart import DigitsClassifier, DigitsDataModule

    L.seed_everything(0, verbose=False)
    model = DigitsClassifier(hidden=(128,))
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="dgc_ddp_spawn",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DigitsDataModule())
    assert type(trainer.strategy).__name__ == "DGCStrategy" and trainer.strategy.compress_ratio == 0.001
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.allclose(before, after)
    assert float(trainer.callback_metrics["val/acc"]) > 0.8


_EXIT_PROBE = """
import atexit, sys, weakref
import torch.distributed as dist
atexit.register(lambda: print("process group up at exit:", dist.is_initialized()))  # runs last
import lightning as L
import lightning_gc  # noqa: F401
from lightning.pytorch.demos.boring_classes import BoringModel

class FailsAtStep1(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)

def fit():  # the trainer and its DDP model are garbage once this returns
    model = FailsAtStep1() if sys.argv[1] == "fails" else BoringModel()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="dgc_ddp", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model)
    except RuntimeError as error:
        print("fit raised:", error)
    weakref.finalize(trainer.strategy.model, print, "DDP model freed")

fit()
print("process group up after fit:", dist.is_initialized())
"""


@pytest.mark.parametrize("run", ["ends", "fails"])
def test_the_gloo_process_group_is_shut_down_at_exit_after_training_ends(tmp_path: Path, run: str) -> None:
    """Lightning leaves gloo groups to interpreter finalization, where a gloo thread dropping one of
    our hook's Python callbacks can abort a finished run; the strategy shuts the group down at exit
    once training has ended normally (not after a failure: a rank with collectives in flight
    would wait in the shutdown until the timeout)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(_EXIT_PROBE)
    done = subprocess.run([sys.executable, str(script), run], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("fit raised: boom" in done.stdout) == (run == "fails")
    if run == "ends":
        assert "process group up after fit: True" in done.stdout  # later fits and tests reuse it
    assert f"process group up at exit: {run == 'fails'}" in done.stdout
    if run == "ends":  # freed by the exit handler's collection, not left to interpreter finalization
        lines = done.stdout.splitlines()
        assert lines.index("DDP model freed") < lines.index("process group up at exit: False"), done.stdout


def test_powersgd_resumes_exactly_with_its_warm_start_factors(run_ranks, tmp_path: Path) -> None:
    """PowerSGD's Q is state: without it in the checkpoint a resumed run would restart the power iteration."""
    ckpt_dir = tmp_path / "ckpts"
    common = {
        "strategy": {"kind": "gc", "compressor": "powersgd", "rank": 2, "bucket_cap_mb": 0.05},
        "model": {"hidden": [128, 128], **SGD},
        "epochs": 2,
    }
    straight = run_ranks({"fits": [{**common, "checkpoint_dir": str(ckpt_dir)}]}, name="straight")
    mid_run = ckpt_dir / "epoch=0.ckpt"
    resumed = run_ranks({"fits": [{**common, "resume_from": str(mid_run)}]}, name="resumed")
    for rank in range(2):
        assert torch.equal(resumed[rank][0]["params"], straight[0][0]["params"])
    entry = torch.load(mid_run, weights_only=True)[CHECKPOINT_KEY]
    factors = entry["ranks"][0]["compressor"]["q"]
    assert factors["net.0.weight"].shape == (64, 2) and factors["net.2.weight"].shape == (128, 2)
    assert torch.equal(factors["net.0.weight"], entry["ranks"][1]["compressor"]["q"]["net.0.weight"])  # shared
