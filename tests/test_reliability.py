"""Faults, bad setups and the Lightning features users combine with compression (2 real gloo ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, launch_ranks, start_ranks

from lightning_gc import available
from lightning_gc.compressors import DGCCompressor, create
from lightning_gc.core.guard import StepGuard
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.core.momentum import MomentumSpec
from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY

SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
SMALL = {"hidden": [64], **SGD}
STEPS_PER_EPOCH = 22  # 1,438 training digits, batch 32, 2 ranks
COMPRESSOR_ARGUMENTS = {
    "dgc": {"compress_ratio": 0.01},
    "topk": {"compress_ratio": 0.05},
    "fft": {"compress_ratio": 0.05},
}


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# DDP lays a bucket out afresh on the first iteration after a resume; MKL's matrix products
# (PowerSGD) round differently at different memory alignments unless asked not to.
REPRODUCIBLE_BLAS = {"MKL_CBWR": "COMPATIBLE"}


def test_every_compressor_resumes_exactly(tmp_path: Path) -> None:
    """Stop after epoch 0, resume from its checkpoint: parameters bitwise equal to the straight run."""
    names = available()
    fits = {
        name: {
            "strategy": {"kind": "gc", "compressor": name, **COMPRESSOR_ARGUMENTS.get(name, {})},
            "model": SMALL,
            "epochs": 2,
        }
        for name in names
    }
    for name, local_update in (("dgc delayed", False), ("dgc delayed od-sgd", True)):  # averages in flight
        delayed = {"delay": 1, "local_update": local_update, "sync_warmup_steps": 3}
        fits[name] = {**fits["dgc"], "strategy": {**fits["dgc"]["strategy"], **delayed}}
    for name in ("onebit", "qsgd"):  # server errors (onebit's) and worker residuals of the two-phase exchange
        fits[f"{name} two-phase"] = {**fits[name], "strategy": {**fits[name]["strategy"], "exchange": "two_phase"}}
    straight = launch_ranks(
        "fit_worker.py",
        {"fits": [{**fit, "checkpoint_dir": str(tmp_path / name)} for name, fit in fits.items()]},
        tmp_path / "straight",
        env=REPRODUCIBLE_BLAS,
    )
    resumed = launch_ranks(
        "fit_worker.py",
        {"fits": [{**fit, "resume_from": str(tmp_path / name / "epoch=0.ckpt")} for name, fit in fits.items()]},
        tmp_path / "resumed",
        env=REPRODUCIBLE_BLAS,
    )
    for index, name in enumerate(fits):
        for rank in range(2):
            assert torch.equal(resumed[rank][index]["params"], straight[rank][index]["params"]), name
        assert resumed[0][index]["hook_step"] == straight[0][index]["hook_step"] == 2 * STEPS_PER_EPOCH
        assert resumed[0][index]["totals"] == straight[0][index]["totals"], name


_VALIDATE_ON_ONE_PROCESS = """
import sys
import lightning as L
from lightning_gc import GradientCompressionStrategy
from recipes.quickstart import DigitsClassifier, DigitsDataModule
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=GradientCompressionStrategy("randomk", compress_ratio=0.01),
                    logger=False, enable_progress_bar=False, enable_model_summary=False)
metrics = trainer.validate(DigitsClassifier(hidden=[32]), DigitsDataModule(), ckpt_path=sys.argv[1], verbose=False)
print("val/acc", metrics[0]["val/acc"])
"""


def test_a_second_fit_on_the_same_trainer_resumes_exactly_and_evaluation_takes_any_world_size(
    tmp_path: Path,
) -> None:
    """randomk's indices depend on the step counter, so a refit that lost it would diverge; a
    checkpoint of 2 ranks validates on 1 process (evaluation exchanges no gradients)."""
    fit = {"strategy": {"kind": "gc", "compressor": "randomk", "compress_ratio": 0.01}, "model": {"hidden": [32]}}
    checkpoints = tmp_path / "ckpts"
    straight = launch_ranks(
        "fit_worker.py",
        {"fits": [{**fit, "epochs": 2, "checkpoint_dir": str(checkpoints)}]},
        tmp_path / "straight",
    )[0][0]
    refit = launch_ranks(
        "fit_worker.py",
        {"fits": [{**fit, "epochs": 1, "refit": {"epochs": 2, "resume_from": str(checkpoints / "epoch=0.ckpt")}}]},
        tmp_path / "refit",
    )[0][0]
    assert refit["hook_step"] == straight["hook_step"] == 2 * STEPS_PER_EPOCH
    assert torch.equal(refit["params"], straight["params"])
    assert refit["totals"] == straight["totals"]  # the running byte counts continue too

    script = tmp_path / "validate.py"
    script.write_text(_VALIDATE_ON_ONE_PROCESS)
    done = subprocess.run(
        [sys.executable, str(script), str(checkpoints / "epoch=1.ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("val/acc")[1]) > 0.5


def test_a_checkpoint_saved_after_fit_keeps_the_compression_state_and_owes_nothing(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after ``fit`` (the model is unwrapped from DDP by then) keeps the
    compression state; the end of training applied what the delayed steps owed, so the checkpoint
    owes nothing, and a run resumed from it ends where the first one did, on every rank."""
    fit = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.01, "delay": 1, "local_update": True, "sync_warmup_steps": 3},
        "model": SMALL,
        "epochs": 1,
    }
    after = tmp_path / "after_fit.ckpt"
    first = launch_ranks("fit_worker.py", {"fits": [{**fit, "save_after_fit": str(after)}]}, tmp_path / "first")
    entry = torch.load(after, weights_only=False)[CHECKPOINT_KEY]
    assert [rank["step"] for rank in entry["ranks"]] == [STEPS_PER_EPOCH] * 2
    assert [rank["delayed"] for rank in entry["ranks"]] == [{}, {}]  # the end of training paid what was owed
    resumed = launch_ranks("fit_worker.py", {"fits": [{**fit, "resume_from": str(after)}]}, tmp_path / "resumed")
    for rank in range(2):
        assert torch.equal(resumed[rank][0]["params"], first[rank][0]["params"])
    # the ranks' own terms were swapped for the averages at the end: equal up to rounding
    torch.testing.assert_close(first[0][0]["params"], first[1][0]["params"], rtol=1e-5, atol=1e-6)


def test_a_killed_rank_stops_the_survivor_quickly_and_the_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    fit = {"strategy": {"kind": "dgc", "compress_ratio": 0.01, "timeout": 60}, "model": SMALL, "epochs": 2}
    ckpts = tmp_path / "ckpts"
    started = time.monotonic()
    faults = [{"rank": 1, "step": STEPS_PER_EPOCH + 5, "kind": "kill"}]
    codes, logs = start_ranks(
        "fit_worker.py",
        {"fits": [{**fit, "checkpoint_dir": str(ckpts), "faults": faults}]},
        tmp_path / "killed",
        timeout=240,
    )
    assert codes[1] == -9  # SIGKILL
    assert codes[0] not in (0, None), "the survivor must exit with an error, not hang"
    assert time.monotonic() - started < 120
    assert "lightning_gc: the gradient exchange of bucket" in logs[0] and "a peer process died" in logs[0]

    entry = torch.load(ckpts / "epoch=0.ckpt", weights_only=True)[CHECKPOINT_KEY]  # intact, both ranks' memory
    assert len(entry["ranks"]) == 2
    straight = launch_ranks("fit_worker.py", {"fits": [fit]}, tmp_path / "straight")
    resumed = launch_ranks(
        "fit_worker.py", {"fits": [{**fit, "resume_from": str(ckpts / "epoch=0.ckpt")}]}, tmp_path / "resumed"
    )
    for rank in range(2):
        assert torch.equal(resumed[rank][0]["params"], straight[rank][0]["params"])


def test_non_finite_gradient_raises_naming_the_parameter(tmp_path: Path) -> None:
    fit = {"strategy": {"kind": "dgc", "compress_ratio": 0.01, "timeout": 60}, "model": SMALL, "epochs": 1}
    fit["faults"] = [{"rank": 1, "step": 3, "kind": "nan"}]
    codes, logs = start_ranks("fit_worker.py", {"fits": [fit]}, tmp_path / "nan", timeout=180)
    assert codes[1] not in (0, None) and codes[0] not in (0, None)
    assert "FloatingPointError: lightning_gc: non-finite gradient on rank 1 in ['net.0.weight'] (step 3)" in logs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_finiteness_screen_sees_any_single_bad_element(dtype: torch.dtype, bad: float) -> None:
    from lightning_gc.core.guard import all_finite

    values = torch.randn(10_001, generator=torch.Generator().manual_seed(0)).to(dtype) * 1e3
    values[0], values[1] = torch.finfo(dtype).max, torch.finfo(dtype).min  # finite extremes: no false alarm
    assert bool(all_finite(values))
    for position in (0, 5_000, 10_000):
        spoiled = values.clone()
        spoiled[position] = bad
        assert not bool(all_finite(spoiled)), (dtype, bad, position)


@pytest.mark.parametrize("name", available())
def test_zero_size_parameters_pass_every_compressor_and_a_nan_is_still_named(tmp_path: Path, name: str) -> None:
    """Zero-size parameters (1-D and 2-D in a bucket with others, or alone in their own float64
    bucket) are exchanged as nothing; a NaN elsewhere still raises naming its parameter."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gc.compressors import create
    from lightning_gc.core.memory import CompensationMemory
    from lightning_gc.runtime.hook import CompressionHookState, compression_hook

    class WithEmpty(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.empty = torch.nn.Parameter(torch.zeros(0))
            self.empty_matrix = torch.nn.Parameter(torch.zeros(0, 8))
            self.empty64 = torch.nn.Parameter(torch.zeros(0, dtype=torch.float64))  # a bucket of its own

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.empty.sum() + self.empty_matrix.sum() + self.empty64.sum().float()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = WithEmpty()
        ddp = DistributedDataParallel(model)
        names = {id(p): (n, i) for i, (n, p) in enumerate(model.named_parameters())}
        memory = CompensationMemory(momentum_correction=False, momentum_masking=True, clip_norm=None)
        compressor = create(name, **COMPRESSOR_ARGUMENTS.get(name, {}))
        ddp.register_comm_hook(CompressionHookState(compressor, memory, names), compression_hook)
        x = torch.randn(2, 4)
        for _ in range(2):
            ddp(x).sum().backward()
        assert model.lin.weight.grad.isfinite().all()
        x[0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match=r"\['lin.weight'\]"):
            ddp(x).sum().backward()
    finally:
        dist.destroy_process_group()


def test_non_finite_steps_are_skipped_on_every_rank_and_rolled_back(run_ranks) -> None:
    common = {"model": SMALL, "epochs": 2}
    faults = [{"rank": 1, "step": 4, "kind": "nan"}, {"rank": 0, "step": 30, "kind": "nan"}]
    fits = [
        {**common, "strategy": {"kind": "dgc", "compress_ratio": 0.01, "nonfinite": "skip"}, "faults": faults},
        {**common, "strategy": {"kind": "gc", "compressor": "powersgd", "nonfinite": "skip"}, "faults": faults},
        # fp16 with a grad scaler: overflowing steps are the scaler's to skip, whatever the policy
        {
            **common,
            "strategy": {"kind": "dgc", "compress_ratio": 0.01},
            "faults": faults,
            "trainer": {"fp16_with_scaler": True},
        },
        # delayed: the skipped step's exchange is drained before the roll-back; the average it
        # would have handed over is handed over by the step that replaces it
        {
            **common,
            "strategy": {"kind": "dgc", "compress_ratio": 0.01, "nonfinite": "skip", "delay": 1},
            "faults": faults,
        },
        {
            **common,
            "strategy": {"kind": "dgc", "compress_ratio": 0.01, "delay": 1, "sync_warmup_steps": 2},
            "faults": [{"rank": 1, "step": 4, "kind": "nan"}, {"rank": 0, "step": 15, "kind": "nan"}],
            "trainer": {"fp16_with_scaler": True, "accumulate_grad_batches": 2},
        },
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    assert rank0[2]["grad_scale"] == rank1[2]["grad_scale"] == 2.0**16 / 4  # backed off twice, on every rank
    optimizer_steps = [2 * STEPS_PER_EPOCH] * 4 + [STEPS_PER_EPOCH]  # the last accumulates 2 batches
    for ours, theirs, steps in zip(rank0, rank1, optimizer_steps):
        assert ours["totals"]["skipped_steps"] == theirs["totals"]["skipped_steps"] == 2
        assert torch.equal(ours["params"], theirs["params"]) and torch.isfinite(ours["params"]).all()
        assert all(torch.isfinite(t).all() for entry in ours["memory"].values() for t in entry.values())
        assert ours["hook_step"] == steps - 2  # the skipped steps were rolled back
        losses = [m["train/loss_epoch"] for m in ours["epoch_metrics"]]
        assert losses[-1] < losses[0]


def test_the_guard_rolls_memory_back_exactly(world_of_one: None) -> None:
    params = [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(30))]
    names = {id(p): (f"p{i}", i) for i, p in enumerate(params)}
    from lightning_gc.common.layout import BucketLayout

    layout = BucketLayout.build(0, params, names, 1230)
    memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=None)
    memory.set_specs({"p0": MomentumSpec(0.9), "p1": MomentumSpec(0.9)})
    state = memory.bucket(layout, torch.zeros(1230))
    memory.compensate(state, torch.randn(1230), params, world_size=2)
    before = memory.state_dict()
    compressor = create("dgc")
    guard = StepGuard("skip", memory, compressor)
    bad = torch.full((1230,), float("nan"))
    guard.screen(bad, layout, state, step=5, loss_scaled=False)
    memory.compensate(state, bad, params, world_size=2)
    guard.screen(
        bad, layout, state, step=5, loss_scaled=False
    )  # a second back-up in the same step keeps the first copy
    memory.compensate(state, bad, params, world_size=2)
    assert guard.settle() == 5  # the step to return to
    after = memory.state_dict()
    assert all(torch.equal(after[name][key], before[name][key]) for name in before for key in before[name])
    guard.screen(torch.zeros(1230), layout, state, step=5, loss_scaled=False)
    assert guard.settle() is None  # a finite step stands


def test_ranks_set_up_differently_fail_at_setup_naming_the_difference(tmp_path: Path) -> None:
    fit = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.001},
        "rank_strategy": {"1": {"compress_ratio": 0.01}},
        "model": SMALL,
        "epochs": 1,
    }
    codes, logs = start_ranks("fit_worker.py", {"fits": [fit]}, tmp_path / "mismatch", timeout=180)
    assert all(code not in (0, None) for code in codes)  # 1, or SIGABRT from gloo's teardown
    message = "rank 0 and rank 1 are set up differently at compressor.compress_ratio: 0.001 vs 0.01"
    assert message in logs[0] and message in logs[1]


def test_a_checkpoint_of_another_format_is_refused_naming_both(tmp_path: Path) -> None:
    from lightning_gc import GradientCompressionStrategy
    from lightning_gc.runtime.checkpoint import CHECKPOINT_FORMAT, READABLE_FORMATS

    path = tmp_path / "future.ckpt"
    torch.save({CHECKPOINT_KEY: {"format": CHECKPOINT_FORMAT + 1, "world_size": 1, "ranks": [{}]}}, path)
    readable = re.escape(str(list(READABLE_FORMATS)))
    with pytest.raises(ValueError, match=rf"format {CHECKPOINT_FORMAT + 1}.*reads formats {readable}"):
        GradientCompressionStrategy("topk").load_checkpoint(path)


def test_identical_non_finite_parameters_are_not_called_a_divergence(tmp_path: Path) -> None:
    import torch.distributed as dist

    from lightning_gc.runtime.consistency import verify_same_parameters

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        module = torch.nn.Linear(3, 2)
        with torch.no_grad():
            module.weight[0, 0] = float("nan")
        verify_same_parameters(module)  # NaN != NaN, but the bits are the same
    finally:
        dist.destroy_process_group()


def test_periodic_check_catches_ranks_that_diverged(tmp_path: Path) -> None:
    fit = {"strategy": {"kind": "dgc", "verify_every_n_steps": 1}, "model": SMALL, "epochs": 1}
    fit["faults"] = [{"rank": 1, "step": 5, "kind": "perturb"}]
    codes, logs = start_ranks("fit_worker.py", {"fits": [fit]}, tmp_path / "diverged", timeout=180)
    assert codes == [1, 1]
    assert "parameters differ between ranks, first at 'net.0.weight'" in logs[0]


def test_lightning_features_combined_with_compression(run_ranks) -> None:
    """DDP's results with AMP (bf16; fp16 with its grad scaler) and gradient accumulation: exactly
    through our path with compression off, within AMP's rounding with DGC at compress_ratio=1;
    clipping, unused parameters, param groups with a scheduler and validate/test/predict after fit
    work with compression on."""
    dense, dgc, none = {"kind": "ddp"}, {"kind": "dgc", "compress_ratio": 1.0}, {"kind": "gc", "compressor": "none"}
    twins = [{"precision": "bf16-mixed"}, {"fp16_with_scaler": True}, {"accumulate_grad_batches": 3}]
    # AMP rounds activations to a few bits, so float-order differences between momentum in memory
    # and in SGD (1e-7 in fp32) can flip roundings and grow; the exact path must match exactly.
    tolerances = [1e-3, 1e-3, 1e-5]
    fits = []
    for trainer in twins:
        fits += [{"strategy": s, "model": SMALL, "epochs": 1, "trainer": trainer} for s in (dense, dgc, none)]
    compressed = {"kind": "dgc", "compress_ratio": 0.01}
    fits += [
        {"strategy": compressed, "model": SMALL, "epochs": 2, "trainer": {"gradient_clip_val": 0.5}},
        {
            "strategy": {**compressed, "clip_norm": 1.0},
            "model": SMALL,
            "epochs": 2,
            "trainer": {"gradient_clip_val": 0.5},
        },
        {"strategy": {**compressed, "find_unused_parameters": True}, "variant": "unused", "model": SMALL, "epochs": 2},
        {"strategy": compressed, "variant": "groups", "model": SMALL, "epochs": 2},
        {
            "strategy": compressed,
            "variant": "evaluable",
            "model": SMALL,
            "epochs": 1,
            "after_fit": True,
            "limit_val_batches": 1.0,
        },
        {
            "strategy": {**compressed, "compress_ratio": 0.05},
            "model": SMALL,
            "epochs": 2,
            "trainer": {"fp16_with_scaler": True},
        },
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    for index, trainer in enumerate(twins):
        ddp, ours, exact = rank0[3 * index : 3 * index + 3]
        assert ddp["global_step"] == ours["global_step"] > 0, trainer
        assert _relative_difference(ours["params"], ddp["params"]) < tolerances[index], trainer
        assert torch.equal(exact["params"], ddp["params"]), trainer
    assert rank0[4]["grad_scale"] is not None and rank0[4]["grad_scale"] >= 1  # fp16: memory saw unscaled gradients
    accumulated = rank0[7]
    assert accumulated["hook_step"] == accumulated["global_step"]  # one exchange per optimizer step

    for ours, theirs in zip(rank0, rank1):
        assert torch.equal(ours["params"], theirs["params"])
        assert torch.isfinite(ours["params"]).all()
    for result in rank0[9:13] + rank0[14:]:
        losses = [m["train/loss_epoch"] for m in result["epoch_metrics"]]
        assert losses[-1] < losses[0], losses
    unused = rank0[11]["memory"]["unused.weight"]
    assert set(unused) == {"velocity", "momentum"}  # it keeps its state, untouched: no gradient, no decay
    assert torch.count_nonzero(unused["velocity"]) == 0 and torch.count_nonzero(unused["momentum"]) == 0
    after_fit = rank0[13]
    assert 0.5 < after_fit["validate"][0]["val/acc"] <= 1.0 and after_fit["test"][0]["test/loss"] < 2.0
    assert sum(len(batch) for batch in after_fit["predict"]) > 0
    assert rank0[14]["grad_scale"] is not None


TWO_OPTIMIZERS = """
import lightning as L, torch
from lightning_gc import DGCStrategy
from recipes.quickstart import DigitsClassifier, DigitsDataModule

class TwoOptimizers(DigitsClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False  # Lightning's rule for several optimizers

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        first, second = self.net[0].parameters(), self.net[2].parameters()
        return [torch.optim.SGD(first, lr=0.1, momentum=0.9), torch.optim.SGD(second, lr=0.1)]

trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DGCStrategy(), max_steps=1, logger=False,
                    enable_checkpointing=False)
trainer.fit(TwoOptimizers(hidden=[16]), DigitsDataModule())
"""


def test_several_optimizers_with_momentum_correction_are_refused() -> None:
    # In a process of its own: Lightning stops at setup with a process group and a TCP store open.
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-c", TWO_OPTIMIZERS], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "momentum_correction=True moves one optimizer's momentum" in done.stderr
    assert "the model configures 2 optimizers" in done.stderr


def test_dgc_compressor_checkpoint_holds_no_state() -> None:
    compressor = DGCCompressor()
    assert compressor.state_dict() == {}
    with pytest.raises(ValueError, match="keeps no state"):
        compressor.load_state_dict({"q": {}})


@pytest.mark.parametrize("local_update", [False, True], ids=["stale", "od-sgd"])
def test_delayed_training_learns_and_ends_with_the_same_parameters_on_every_rank(
    tmp_path: Path, local_update: bool
) -> None:
    """Each step applies the average of the step before; what is owed at the end is applied then,
    before the callbacks' ``on_train_end``. With OD-SGD's local update the ranks differ during
    training by their own latest terms only."""
    strategy = {"kind": "dgc", "compress_ratio": 0.01, "delay": 1, "local_update": local_update}
    rank0, rank1 = launch_ranks(
        "fit_worker.py", {"fits": [{"strategy": strategy, "model": SMALL, "epochs": 3}]}, tmp_path / "delayed"
    )
    ours, theirs = rank0[0], rank1[0]
    losses = [m["train/loss_epoch"] for m in ours["epoch_metrics"]]
    assert losses[-1] < 0.5 * losses[0], losses
    during = ours["epoch_params"][-1], theirs["epoch_params"][-1]
    if local_update:
        assert not torch.equal(*during)  # each rank has applied its own newest contribution
        # swapping those own terms for the average at the end is all that separates the ranks
        torch.testing.assert_close(ours["params"], theirs["params"], rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(*during) and torch.equal(ours["params"], theirs["params"])
    assert not torch.equal(ours["params"], during[0])  # the owed average was applied after the last step
    # ... before any callback's on_train_end reads the weights (weight averaging swaps its own in there)
    assert torch.equal(ours["train_end_params"], ours["params"])


def test_delay_settings_are_checked_at_construction_and_local_update_needs_sgd(tmp_path: Path) -> None:
    from lightning_gc import DGCStrategy, GradientCompressionStrategy

    with pytest.raises(ValueError, match=r"`delay` must be an integer >= 0, got -1"):
        DGCStrategy(delay=-1)
    with pytest.raises(ValueError, match=r"`local_update=True` needs `delay` >= 1, got delay=0"):
        DGCStrategy(local_update=True)
    with pytest.raises(ValueError, match=r"`sync_warmup_steps` must be an integer >= 0, got 1.5"):
        DGCStrategy(delay=1, sync_warmup_steps=1.5)
    with pytest.raises(ValueError, match=r"compressor 'powersgd' knows what it sent only from the average"):
        GradientCompressionStrategy("powersgd", delay=1, local_update=True)
    fit = {
        "strategy": {"kind": "gc", "compressor": "topk", "compress_ratio": 0.05, "delay": 1, "local_update": True},
        "model": {"hidden": [32], "optimizer": "adam", "lr": 0.01},
        "epochs": 1,
    }
    codes, logs = start_ranks("fit_worker.py", {"fits": [fit]}, tmp_path / "adam", timeout=180)
    assert all(code not in (0, None) for code in codes)
    assert "exact only for a linear update (torch.optim.SGD); the model configures ['Adam']" in logs[0]


def test_a_checkpoint_resumes_only_with_the_compressor_and_momentum_correction_that_wrote_it() -> None:
    """A DGC memory holds momentum-corrected velocity: read as plain residuals (or by another
    compressor, whose state and residual terms differ) the run would not continue exactly, so the
    resume is refused naming both values; entries written before the record resume with any."""
    from lightning_gc.compressors.registry import create as create_compressor
    from lightning_gc.runtime.checkpoint import CHECKPOINT_FORMAT, IncompatibleCheckpoint
    from lightning_gc.runtime.session import CompressionSession
    from lightning_gc.runtime.settings import CompressionSettings

    def entry(compressor: str, saved: dict) -> dict:
        rank = {"step": 5, "memory": {}, "compressor": {}, "resume_settings": saved}
        return {"format": CHECKPOINT_FORMAT, "world_size": 1, "compressor": {"name": compressor}, "ranks": [rank]}

    def session(compressor: str, corrected: bool) -> CompressionSession:
        return CompressionSession(create_compressor(compressor), CompressionSettings(momentum_correction=corrected))

    corrected = entry("dgc", {"momentum_correction": True})
    with pytest.raises(IncompatibleCheckpoint) as error:
        session("dgc", False).resume(corrected, source="x.ckpt", rank=0, world_size=1)
    assert "momentum_correction=True" in str(error.value) and "momentum_correction=False" in str(error.value)
    for other in ("topk", "powersgd"):
        with pytest.raises(IncompatibleCheckpoint) as error:
            session(other, True).resume(corrected, source="x.ckpt", rank=0, world_size=1)
        assert "'dgc'" in str(error.value) and repr(other) in str(error.value)
    session("dgc", True).resume(corrected, source="x.ckpt", rank=0, world_size=1)
    session("dgc", False).resume(entry("dgc", {}), source="x.ckpt", rank=0, world_size=1)
