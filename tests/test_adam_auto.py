"""The Adam hand-over's length (lightning_gc.runtime.adam_plan): ``adam_warmup_steps="auto"`` resolved
from the run's length (the Trainer's ``estimated_stepping_batches``, ``total_steps`` of ``attach``
and Fabric), kept by a resumed run; the one-line errors and the warning; and the density floor
``max(r, min(1, c / T))`` after the freeze, which a short run gets and a long one does not."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import lightning_gc
from lightning_gc.compressors.base import AdjustableRatio
from lightning_gc.integrations.attach import AttachedCompression
from lightning_gc.runtime.adam_plan import (
    AdamPlan,
    RatioFloor,
    auto_warmup_steps,
    density_floor,
    known_length,
    plan_adam,
)
from lightning_gc.runtime.build import build_session

STEPS_PER_EPOCH = 22  # 1,437 digits / (2 ranks x 32)
ADAMW = {"hidden": [64, 64], "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.01}


# ---------------------------------------------------------------------- the rule, as pure functions
def test_the_density_floor_lets_every_element_leave_c_times_and_falls_to_the_ratio_in_long_runs() -> None:
    r, c = 0.001, 8.0
    # the fine-tune: 600 steps frozen at 120, 480 compressed: 0.48 sends at r, 8 with the floor
    assert density_floor(r, 480, c) == pytest.approx(8 / 480)
    assert density_floor(r, 480, c) * 480 == pytest.approx(c)
    assert density_floor(r, 1600, c) == pytest.approx(0.005)  # 2,000 steps frozen at 400
    assert density_floor(r, 4000, c) == pytest.approx(0.002)  # 5,000 frozen at 1,000
    assert density_floor(r, 8000, c) == r  # from T = c / r on: compress_ratio itself
    assert density_floor(r, 80_000, c) == r
    floors = [density_floor(r, t, c) for t in (5, 10, 100, 480, 1000, 4000, 8000, 20_000)]
    assert floors == sorted(floors, reverse=True) and floors[0] == 1.0  # T <= c: every element, every step
    assert density_floor(0.05, 480, c) == 0.05  # a ratio above the floor is kept
    assert density_floor(r, 480, 0.0) == r  # adam_min_sends=0: off
    assert density_floor(r, None, c) == r and density_floor(r, 0, c) == r  # length unknown, or nothing compressed


def test_auto_is_a_fraction_of_the_run_and_unknown_lengths_are_refused_in_one_line() -> None:
    assert auto_warmup_steps(600, 0.2) == 120 and auto_warmup_steps(44, 0.2) == 9 and auto_warmup_steps(2, 0.2) == 1
    assert known_length(float("inf")) is None and known_length(-1) is None and known_length(None) is None
    assert known_length(lambda: 600) == 600 and known_length(600.0) == 600
    assert plan_adam("auto", 0.25, 2000, recorded=None, length_hint="-") == AdamPlan(500, 2000, "auto")
    assert plan_adam("auto", 0.2, 2000, recorded=120, length_hint="-") == AdamPlan(120, 2000, "checkpoint")
    with pytest.raises(ValueError) as error:
        plan_adam("auto", 0.2, float("inf"), recorded=None, length_hint="set Trainer(max_steps=...)")
    message = str(error.value)
    assert "\n" not in message and "20 %" in message and "set Trainer(max_steps=...)" in message
    assert "fixed adam_warmup_steps" in message


def test_a_fixed_warm_up_at_least_the_runs_length_warns_once_naming_both_numbers() -> None:
    with pytest.warns(UserWarning, match=r"adam_warmup_steps=1000 is not below this run's 600 optimizer steps"):
        assert plan_adam(1000, 0.2, 600, recorded=None, length_hint="-") == AdamPlan(1000, 600, "fixed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_adam(100, 0.2, 600, recorded=None, length_hint="-").compressed_steps == 500
        assert plan_adam(100, 0.2, None, recorded=None, length_hint="-").compressed_steps is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"adam_warmup_steps": "Auto"}, "`adam_warmup_steps` must be 'auto' or an integer >= 1, got 'Auto'"),
        ({"adam_warmup_fraction": 1.0}, "`adam_warmup_fraction` must be in (0, 1), got 1.0"),
        ({"adam_warmup_fraction": 0}, "`adam_warmup_fraction` must be in (0, 1), got 0"),
        ({"adam_min_sends": -1}, "`adam_min_sends` must be in [0, inf], got -1"),
    ],
)
def test_bad_length_settings_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        lightning_gc.DGCStrategy(**kwargs)
    assert str(error.value) == message


class _Ratio(AdjustableRatio):
    sends_all_at_one = True

    def __init__(self, ratio: float) -> None:
        self.compress_ratio = ratio


def test_the_floor_holds_for_each_step_and_gives_the_users_ratio_back_between_steps() -> None:
    """Before the freeze nothing changes; from it on each step's exchange sends at least the floor,
    and between steps the compressor shows what its user (or a SparsityWarmup stage) set, also when
    they set it between accumulated micro-batches; a stage above the floor is kept."""
    compressor = _Ratio(0.001)
    floor = RatioFloor(compressor, 0.02, since=5)
    floor.hold(4)
    assert compressor.compress_ratio == 0.001 and floor.release() is None
    floor.hold(5)
    assert compressor.compress_ratio == 0.02
    floor.hold(5)  # the next micro-batch of the same step
    assert compressor.compress_ratio == 0.02 and floor.release() == 0.02 and compressor.compress_ratio == 0.001
    floor.hold(6)
    compressor.compress_ratio = 0.25  # a warm-up stage set between micro-batches
    floor.hold(6)
    assert compressor.compress_ratio == 0.25 and floor.release() is None and compressor.compress_ratio == 0.25
    compressor.compress_ratio = 0.001
    floor.hold(7)
    compressor.compress_ratio = 0.005  # set during the step: kept, not overwritten by the release
    floor.release()
    assert compressor.compress_ratio == 0.005


def test_sgd_runs_never_ask_for_the_runs_length() -> None:
    """The length is asked only where the Adam hand-over runs: an SGD fit starts with a length
    that would fail if read, and Adam without momentum correction (plain error feedback) too."""

    def unreadable() -> int:
        raise AssertionError("the run's length was read")

    net = torch.nn.Linear(4, 2)
    session = build_session("dgc", {}, owner="test", preset="dgc")
    session.start_fit([torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)], unreadable)
    assert session.adam_plan is None
    plain = build_session("dgc", {"momentum_correction": False}, owner="test")
    plain.start_fit([torch.optim.AdamW(net.parameters())], unreadable)
    assert plain.adam_plan is None
    session.start_fit([torch.optim.AdamW(net.parameters())], lambda: 50)
    assert session.adam_plan == AdamPlan(10, 50, "auto")


def test_momentum_masking_auto_masks_sgd_momentum_and_not_adams_first_moment() -> None:
    """``momentum_masking="auto"`` (the default): DGC's masking with SGD's momentum, none under the
    Adam hand-over (masking Adam's ``m`` costs +24 % perplexity at 600 steps against +7 % without);
    an explicit choice holds for both; a bad value is refused in one line."""
    net = torch.nn.Linear(4, 2)
    sgd, adamw = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), torch.optim.AdamW(net.parameters())
    session = build_session("dgc", {}, owner="test", preset="dgc")
    session.start_fit([sgd], 100)
    assert session.memory.momentum_masking is True
    session.start_fit([adamw], 100)
    assert session.memory.momentum_masking is False
    session.start_fit([sgd], 100)  # a later fit decides again
    assert session.memory.momentum_masking is True
    for explicit in (True, False):
        chosen = build_session("dgc", {"momentum_masking": explicit}, owner="test", preset="dgc")
        for optimizer in (sgd, adamw):
            chosen.start_fit([optimizer], 100)
            assert chosen.memory.momentum_masking is explicit
    with pytest.raises(ValueError, match=r"^`momentum_masking` must be True, False or 'auto', got 'yes'$"):
        build_session("dgc", {"momentum_masking": "yes"}, owner="test", preset="dgc")


# ---------------------------------------------------------------------- plain DDP: attach
def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)


def _attached(optimizer: str, **kwargs) -> tuple[torch.nn.Module, torch.optim.Optimizer, AttachedCompression]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    ddp = DistributedDataParallel(net)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, opt, lightning_gc.attach(ddp, opt, "dgc", **kwargs)


def _train(net: torch.nn.Module, optimizer, gc, steps: range) -> list[dict]:
    metrics = []
    for step in steps:
        x, y = _batches(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(gc.ddp(x), y).backward()
        metrics.append(gc.step())
    return metrics


def test_attach_resolves_auto_from_total_steps_and_refuses_adam_without_them(world_of_one) -> None:
    net, opt, gc = _attached("adamw", total_steps=40)
    assert gc.session.adam_plan == AdamPlan(8, 40, "auto")
    metrics = _train(net, opt, gc, range(40))
    assert all(m["gc/wire_ratio"] == 1.0 and "gc/density_floor" not in m for m in metrics[:8])  # plain Adam
    # 32 compressed steps at compress_ratio=0.001: each element leaves 8 times at 25 %
    assert all(m["gc/density_floor"] == 0.25 and m["gc/density"] >= 0.25 for m in metrics[8:])
    assert gc.compress_ratio == 0.001  # what the user set, between steps
    gc.finish()

    with pytest.raises(ValueError, match=re.escape("pass total_steps=N (the run's optimizer steps) to attach")):
        _attached("adamw")
    net, opt, sgd = _attached("sgd")  # SGD needs no length
    assert sgd.session.adam_plan is None
    sgd.finish()


def test_the_floor_costs_the_bytes_it_sends_and_a_long_run_costs_none(world_of_one) -> None:
    """The floor's sends are counted like any: the run's totals with it exceed those without it
    by the extra elements' bytes; at a length where ``r T >= c`` it is not in force at all."""
    totals = {}
    for sends in (8.0, 0.0):
        net, opt, gc = _attached("adamw", total_steps=30, compress_ratio=0.01, adam_min_sends=sends)
        _train(net, opt, gc, range(30))
        gc.finish()
        totals[sends] = dict(gc.totals)
    assert totals[8.0]["dense_bytes"] == totals[0.0]["dense_bytes"]
    # 6 dense steps, then 24 at a third of each tensor (index and value: 2/3 of its dense bytes) or at 1 %
    assert totals[8.0]["bytes_sent"] > 2 * totals[0.0]["bytes_sent"]
    net, opt, gc = _attached("adamw", total_steps=100, compress_ratio=0.1)  # T = 80 = c / r
    metrics = _train(net, opt, gc, range(22))
    assert "gc/density_floor" not in metrics[-1] and metrics[-1]["gc/density"] < 0.15  # 10 %, and 138 biases
    gc.finish()


def test_a_resumed_run_keeps_the_warm_up_it_resolved(world_of_one) -> None:
    """Saved after the freeze of a 30-step run (``auto``: 6), resumed by runs planned for 30 and
    for 100 steps: both keep 6 (the memory holds that freeze's state), the first continues bit for
    bit, and the second's floor follows its own length."""
    net, opt, gc = _attached("adamw", total_steps=30)
    _train(net, opt, gc, range(10))
    saved = copy.deepcopy({"model": net.state_dict(), "optimizer": opt.state_dict()})
    entry = copy.deepcopy(gc.state_dict())
    assert entry["adam_warmup_steps"] == 6
    _train(net, opt, gc, range(10, 30))
    gc.finish()
    straight = torch.cat([p.detach().flatten() for p in net.parameters()])

    for total in (30, 100):
        net, opt, again = _attached("adamw", total_steps=total)
        assert again.session.adam_plan.warmup_steps == round(0.2 * total)  # before loading: its own
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        again.load_state_dict(entry)
        assert again.session.adam_plan == AdamPlan(6, total, "checkpoint")
        metrics = _train(net, opt, again, range(10, 30))
        assert metrics[-1]["gc/density_floor"] == pytest.approx(8 / (total - 6))
        again.finish()
        if total == 30:
            assert torch.equal(torch.cat([p.detach().flatten() for p in net.parameters()]), straight)


# ---------------------------------------------------------------------- Fabric and the Trainer
def test_fabric_takes_total_steps_and_refuses_auto_without_them(world_of_one) -> None:
    from lightning.fabric import Fabric

    def set_up(total_steps: int | None, optimizer: type) -> lightning_gc.FabricCompressionStrategy:
        strategy = lightning_gc.FabricCompressionStrategy("dgc", total_steps=total_steps)
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        fabric.launch()
        net = torch.nn.Linear(64, 10)
        fabric.setup(net, optimizer(net.parameters(), lr=0.1))
        return strategy

    assert set_up(50, torch.optim.AdamW).session.adam_plan == AdamPlan(10, 50, "auto")
    assert set_up(None, torch.optim.SGD).session.adam_plan is None  # SGD needs no length
    with pytest.raises(ValueError, match=r"FabricCompressionStrategy\(compressor, total_steps=N\)"):
        set_up(None, torch.optim.AdamW)


def test_the_trainer_resolves_auto_from_its_estimated_steps_and_refuses_an_endless_fit(world_of_one) -> None:
    import lightning as L

    from recipes.quickstart import DigitsClassifier, DigitsDataModule

    def fit(**trainer_kwargs) -> lightning_gc.DGCStrategy:
        strategy = lightning_gc.DGCStrategy()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **trainer_kwargs,
        )  # fmt: skip
        trainer.fit(DigitsClassifier(hidden=[16], optimizer="adamw", lr=1e-3), DigitsDataModule(batch_size=256))
        return strategy

    strategy = fit(max_epochs=2, limit_train_batches=5)  # 10 estimated steps
    assert strategy.session.adam_plan == AdamPlan(2, 10, "auto") and strategy.totals["steps"] == 10
    with pytest.raises(ValueError, match=r"length is unknown: a Trainer with max_steps=-1 and max_epochs=-1"):
        fit(max_epochs=-1, limit_train_batches=5)


def test_a_trainer_fit_freezes_at_a_fifth_and_a_resumed_fit_keeps_that_freeze(run_ranks, tmp_path: Path) -> None:
    """Two ranks, digits, AdamW under ``dgc_ddp``'s defaults: a 2-epoch fit (44 steps) freezes at
    9 and sends ``8 / 35`` of each tensor after it (``compress_ratio`` stays 0.001 between steps);
    resumed from its first epoch into a 4-epoch fit (88 steps: ``auto`` alone would say 18), the
    freeze stays at 9; ``adam_min_sends=0`` sends ``compress_ratio`` and fewer bytes."""
    checkpoints = tmp_path / "ckpts"
    common = {"strategy": {"kind": "dgc"}, "model": ADAMW}
    fits = [
        {**common, "epochs": 2, "checkpoint_dir": str(checkpoints)},
        {**common, "epochs": 4, "resume_from": str(checkpoints / "epoch=0.ckpt")},
        {**common, "strategy": {"kind": "dgc", "adam_min_sends": 0}, "epochs": 2},
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    floored, resumed, unfloored = rank0
    assert floored["adam_plan"] == (9, 2 * STEPS_PER_EPOCH, "auto")
    assert resumed["adam_plan"] == (9, 4 * STEPS_PER_EPOCH, "checkpoint")
    assert unfloored["adam_plan"] == (9, 2 * STEPS_PER_EPOCH, "auto")
    steps = floored["step_metrics"]
    assert all(s["gc/wire_ratio"] == 1.0 and "gc/density_floor" not in s for s in steps[:9])
    assert all(s["gc/density_floor"] == pytest.approx(8 / 35) and s["compress_ratio"] == 0.001 for s in steps[9:])
    assert resumed["step_metrics"][-1]["gc/density_floor"] == pytest.approx(8 / (4 * STEPS_PER_EPOCH - 9))
    # 8,192 of the 8,970 elements compressed, the rest (biases, the 640-element head) sent dense
    assert unfloored["step_metrics"][-1]["gc/density"] < 0.1 and steps[-1]["gc/density"] > 0.25
    assert floored["totals"]["bytes_sent"] > unfloored["totals"]["bytes_sent"]
    for fit0, fit1 in zip(rank0, rank1):
        assert torch.equal(fit0["params"], fit1["params"])
