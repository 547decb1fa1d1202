"""Adam and AdamW through the strategy: dense warm-up, then frozen-variance compressed momentum
(lightning_gc.core.adam.AdamHandOver), on two real gloo processes (tests/workers/fit_worker.py and
adam_unused_worker.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_gc import DGCStrategy
from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY

ADAMW = {"hidden": [64, 64], "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.01}
STEPS_PER_EPOCH = 22  # 1,437 digits / (2 ranks x 32)


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_warm_up_is_plain_adamw_and_the_frozen_phase_matches_a_hand_written_reference(run_ranks) -> None:
    """Before the freeze: bitwise plain AdamW under DDP. After it, at compress_ratio=1: a
    hand-written frozen-variance AdamW (tests/workers/fit_worker.py) within 1e-5."""
    freeze = 10
    compressed = {"kind": "dgc", "compress_ratio": 1.0, "adam_warmup_steps": freeze}
    fits = [
        {"strategy": {"kind": "ddp"}, "model": ADAMW, "epochs": 2},
        {"strategy": {"kind": "dgc", "adam_warmup_steps": 1000}, "model": ADAMW, "epochs": 2},
        {
            "strategy": {"kind": "ddp"},
            "variant": "frozen_adamw_reference",
            "model": {**ADAMW, "freeze_after": freeze},
            "epochs": 2,
        },
        {"strategy": compressed, "model": ADAMW, "epochs": 2},
        {  # the memory weighted by sqrt(d): at ratio 1 every element leaves every step, so the same run
            "strategy": {**compressed, "adam_weighting": "decrease"},
            "model": ADAMW,
            "epochs": 2,
        },
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    ddp, warm, reference, frozen, weighted = rank0
    assert ddp["global_step"] == 2 * STEPS_PER_EPOCH
    assert torch.equal(warm["params"], ddp["params"])  # the whole run inside the warm-up: bit for bit
    assert warm["totals"]["bytes_sent"] == warm["totals"]["dense_bytes"]  # and nothing compressed
    assert _relative_difference(frozen["params"], reference["params"]) < 1e-5
    assert _relative_difference(weighted["params"], reference["params"]) < 1e-5
    for a, b in zip(weighted["exp_avg"], reference["exp_avg"]):
        assert _relative_difference(a, b) < 1e-4  # exp_avg = M' d^(1-a) is Adam's m again
    assert _relative_difference(frozen["params"], ddp["params"]) > 1e-3  # the freeze changed the run
    for a, b in zip(frozen["exp_avg_sq"], reference["exp_avg_sq"]):
        assert torch.equal(a, b)  # v frozen at the same value, never updated after step 10
    assert frozen["memory_entries"] == ["momentum", "velocity"]
    for fit0, fit1 in zip(rank0, rank1):
        assert torch.equal(fit0["params"], fit1["params"])


def test_dgc_compresses_adamw_momentum_and_trains_under_each_weighting(run_ranks) -> None:
    """At 1 % density each weighting trains with ranks identical, and the weighting changes which
    elements leave (so the runs differ) without changing how many (``adam_min_sends=0``: at
    1 % throughout, without the floor a 56-step compressed phase would get)."""
    at_one_percent = {"kind": "dgc", "compress_ratio": 0.01, "adam_warmup_steps": 10, "adam_min_sends": 0}
    fits = [
        {
            "strategy": {**at_one_percent, "adam_weighting": weighting},
            "model": {**ADAMW, "hidden": [256, 256]},
            "epochs": 3,
        }
        for weighting in ("step", "decrease")
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    for fit0, fit1 in zip(rank0, rank1):
        assert torch.equal(fit0["params"], fit1["params"])
        losses = [m["train/loss_epoch"] for m in fit0["epoch_metrics"]]
        assert losses[-1] < 0.3 * losses[0], losses
        assert fit0["epoch_metrics"][-1]["gc/wire_ratio"] > 20  # the last step was compressed
    step, decrease = rank0
    assert _relative_difference(decrease["params"], step["params"]) > 1e-3
    assert step["totals"]["bytes_sent"] == decrease["totals"]["bytes_sent"]


def test_onebit_and_dgc_with_warm_up_and_grad_scaler_train_under_the_hand_over(run_ranks) -> None:
    """The hand-over with other company: onebit (1-bit Adam's configuration) and DGC under DGC's
    step-based sparsity warm-up with fp16 autocast and a grad scaler. Each trains (loss falls
    to under 30 % of the first epoch's), ranks end identical, and the compressed phase compressed."""
    model = {**ADAMW, "hidden": [256, 256]}
    fits = [
        {
            "strategy": {"kind": "gc", "compressor": "onebit", "momentum_correction": True, "adam_warmup_steps": 10},
            "model": model,
            "epochs": 3,
        },
        {  # at 1 % after the warm-up's stages (adam_min_sends=0: without the short run's floor)
            "strategy": {"kind": "dgc", "compress_ratio": 0.01, "adam_warmup_steps": 10, "adam_min_sends": 0},
            "model": model,
            "epochs": 3,
            "warmup": {"densities": [0.25, 0.0625], "interval": "step", "steps_per_stage": 10},
            "trainer": {"fp16_with_scaler": True},
        },
    ]
    rank0, rank1 = run_ranks({"fits": fits})
    for fit0, fit1 in zip(rank0, rank1):
        assert torch.equal(fit0["params"], fit1["params"])
        losses = [m["train/loss_epoch"] for m in fit0["epoch_metrics"]]
        assert losses[-1] < 0.3 * losses[0], losses
        assert fit0["memory_entries"] == ["momentum", "velocity"]  # the first moment was handed over
    onebit, dgc = (fit["epoch_metrics"][-1] for fit in rank0)
    assert onebit["gc/wire_ratio"] > 25  # 1 bit per element (32x less some dense small tensors)
    assert dgc["gc/density"] < 0.02 and dgc["gc/wire_ratio"] > 20  # past the warm-up's stages, at 1 %


def test_exact_resume_across_the_freeze_and_the_checkpoint_loads_into_plain_adamw(run_ranks, tmp_path: Path) -> None:
    """Freeze at step 30 (inside epoch 2): resuming epoch 1's checkpoint (before the freeze) or
    epoch 2's (after it) gives the straight run's parameters bit for bit; epoch 2's optimizer
    state is a plain AdamW state that DDP + AdamW resumes from."""
    ckpt_dir = tmp_path / "ckpts"
    common = {
        "strategy": {"kind": "dgc", "compress_ratio": 0.05, "adam_warmup_steps": 30, "adam_weighting": "decrease"},
        "model": ADAMW,
        "epochs": 3,
    }
    straight = run_ranks({"fits": [{**common, "checkpoint_dir": str(ckpt_dir)}]}, name="straight")
    before, after = ckpt_dir / "epoch=0.ckpt", ckpt_dir / "epoch=1.ckpt"
    resumed = run_ranks(
        {"fits": [{**common, "resume_from": str(before)}, {**common, "resume_from": str(after)}]}, name="resumed"
    )
    for rank in range(2):
        for fit in resumed[rank]:
            assert torch.equal(fit["params"], straight[0][0]["params"])

    checkpoint = torch.load(after, weights_only=True)
    assert checkpoint[CHECKPOINT_KEY]["ranks"][0]["step"] == 2 * STEPS_PER_EPOCH
    plain = run_ranks(
        {"fits": [{"strategy": {"kind": "ddp"}, "model": ADAMW, "epochs": 3, "resume_from": str(after)}]},
        name="plain",
    )
    assert plain[0][0]["global_step"] == 3 * STEPS_PER_EPOCH
    assert torch.isfinite(plain[0][0]["params"]).all()
    assert torch.equal(plain[0][0]["params"], plain[1][0]["params"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"adam_warmup_steps": -1}, "`adam_warmup_steps` must be 'auto' or an integer >= 1, got -1"),
        ({"adam_warmup_steps": 2.5}, "`adam_warmup_steps` must be 'auto' or an integer >= 1, got 2.5"),
        # the freeze needs Adam's second moment: with no warm-up step there is none (it trained nothing)
        ({"adam_warmup_steps": 0}, "`adam_warmup_steps` must be 'auto' or an integer >= 1, got 0"),
        ({"adam_weighting": "loss"}, "`adam_weighting` must be one of ['step', 'decrease', 'gradient'], got 'loss'"),
    ],
)
def test_bad_adam_settings_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        DGCStrategy(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("optimizer", "settings", "message"),
    [
        (lambda p: torch.optim.AdamW(p, amsgrad=True), {}, "does not support AdamW(amsgrad=True)"),
        (lambda p: torch.optim.Adam(p), {"delay": 1}, "delay=1 with the Adam hand-over is not supported"),
    ],
)
def test_adam_settings_the_hand_over_cannot_honour_are_refused(optimizer, settings: dict, message: str) -> None:
    from lightning_gc.core.handover_choice import hand_over_for
    from lightning_gc.runtime.settings import CompressionSettings

    params = [torch.nn.Parameter(torch.zeros(3))]
    memory = CompressionSettings(momentum_correction=True).memory_for(DGCStrategy().compressor)
    hand_over = hand_over_for([optimizer(params)], memory, explicit_momentum=None, adam_warmup_steps=5, owner="X")
    with pytest.raises(ValueError, match=re.escape(message)):
        hand_over.check([optimizer(params)], local_update=False, delay=settings.get("delay", 0))


@pytest.mark.parametrize("weighting", ["step", "decrease", "gradient"])
def test_the_frozen_step_is_adams_update_with_the_preconditioned_momentum(weighting: str) -> None:
    """``p.grad`` = M' (momentum divided by ``d^(1-a)``, d = sqrt(v_hat) + eps the frozen
    denominator, ``a`` the weighting's power): the step is AdamW's with exp_avg = M' d^(1-a),
    decoupled decay and step t's first-moment bias correction, and leaves a plain AdamW state
    (exp_avg = the momentum, v untouched, step + 1), whatever the weighting."""
    from lightning_gc.core.adam import ADAM_WEIGHTINGS, FrozenScales, frozen_variance_step

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(50))
    optimizer = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        param.grad = torch.randn(50)
        optimizer.step()
    before, v = param.detach().clone(), optimizer.state[param]["exp_avg_sq"].clone()
    (b1, b2), t = optimizer.param_groups[0]["betas"], 4
    d = v.sqrt() / (1 - b2**3) ** 0.5 + 1e-8
    power = ADAM_WEIGHTINGS[weighting]
    momentum = torch.randn(50)
    param.grad = momentum / d ** (1 - power)
    frozen_variance_step(optimizer, {param: FrozenScales.split(d, power)})
    expected = before * (1 - 1e-2 * 0.1) - 1e-2 / (1 - b1**t) * momentum / d
    torch.testing.assert_close(param.detach(), expected)
    assert torch.equal(optimizer.state[param]["exp_avg_sq"], v)
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], momentum)
    assert float(optimizer.state[param]["step"]) == t


def test_a_checkpoint_of_the_weighted_memory_resumes_only_with_its_weighting() -> None:
    """The memory after the freeze holds elements scaled by the weighting's ``d^a``: a checkpoint
    written with one weighting is refused, naming both, by a run with another; entries without the
    record (written before the freeze, or by SGD) resume with any."""
    from lightning_gc.runtime.checkpoint import CHECKPOINT_FORMAT, IncompatibleCheckpoint
    from lightning_gc.runtime.session import CompressionSession
    from lightning_gc.runtime.settings import CompressionSettings

    strategy = DGCStrategy()

    def entry(saved: dict) -> dict:
        rank = {"step": 5, "memory": {}, "compressor": {}, "resume_settings": saved}
        return {"format": CHECKPOINT_FORMAT, "world_size": 1, "compressor": {}, "ranks": [rank], "totals": {}}

    def session(weighting: str) -> CompressionSession:
        settings = CompressionSettings(momentum_correction=True, adam_weighting=weighting)
        return CompressionSession(strategy.compressor, settings)

    with pytest.raises(IncompatibleCheckpoint) as error:
        session("step").resume(entry({"adam_weighting": "decrease"}), source="x.ckpt", rank=0, world_size=1)
    assert "adam_weighting='decrease'" in str(error.value) and "adam_weighting='step'" in str(error.value)
    session("decrease").resume(entry({"adam_weighting": "decrease"}), source="x.ckpt", rank=0, world_size=1)
    session("decrease").resume(entry({}), source="x.ckpt", rank=0, world_size=1)


class _LateHead(torch.nn.Module):
    """A body and a head used from the first step, and a second head first used at step ``late``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.late_head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, late: bool) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h) + (self.late_head(h) if late else 0)


def _batch(step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(size, 8, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def test_a_parameter_first_used_after_the_freeze_steps_over_the_mean_denominator(world_of_one) -> None:
    """A module Adam never stepped in the warm-up is frozen with the mean ``sqrt(v_hat)`` of the
    rest (it was never updated at all): its first step is Adam's first step, ``-lr g / (mean + eps)``,
    and it gets Adam's state from then on (a checkpoint still loads into plain AdamW)."""
    import lightning_gc

    model = _LateHead()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    lr, warm, late = 1e-2, 3, 5
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gc = lightning_gc.attach(ddp, optimizer, "dgc", compress_ratio=1.0, adam_warmup_steps=warm)
    for step in range(late + 1):
        if step == warm:  # the freeze: the mean over every element Adam's second moment holds
            beta2 = optimizer.param_groups[0]["betas"][1]
            roots = [optimizer.state[p]["exp_avg_sq"].sqrt() / (1 - beta2**warm) ** 0.5 for p in optimizer.state]
            mean = torch.cat([r[r > 0] for r in roots]).mean()
        x, y = _batch(step)
        if step == late:  # its raw gradient, on copies that carry none of the hand-over's gradient hooks
            copies = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
            loss = torch.nn.functional.cross_entropy(torch.func.functional_call(model, copies, (x, True)), y)
            (grad,) = torch.autograd.grad(loss, copies["late_head.weight"])
            before = model.late_head.weight.detach().clone()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x, step >= late), y).backward()
        gc.step()
    moved = model.late_head.weight.detach() - before
    torch.testing.assert_close(moved, -lr * grad / (mean + 1e-8), rtol=1e-4, atol=1e-9)
    state = optimizer.state[model.late_head.weight]
    assert float(state["step"]) == 1 and not state["exp_avg_sq"].any() and state["exp_avg"].any()
    gc.finish()


def test_adams_l2_decay_enters_once_per_step_however_many_micro_batches(world_of_one) -> None:
    """Adam's L2 term (``weight_decay`` of ``torch.optim.Adam``) enters the preconditioned gradient
    once per optimizer step: two accumulated micro-batches (``no_sync``) train as one batch of
    both does (it entered once per backward: 0.17 off at weight_decay=0.5)."""
    import lightning_gc

    def train(accumulate: bool) -> torch.Tensor:
        model = _LateHead()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.5)
        gc = lightning_gc.attach(ddp, optimizer, "dgc", compress_ratio=1.0, adam_warmup_steps=2)
        for step in range(8):
            x, y = _batch(step)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy
            if accumulate:
                with ddp.no_sync():
                    (loss(ddp(x[:8], True), y[:8]) / 2).backward()
                (loss(ddp(x[8:], True), y[8:]) / 2).backward()
            else:
                loss(ddp(x, True), y).backward()
            gc.step()
        gc.finish()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    one_batch = train(False)
    assert _relative_difference(train(True), one_batch) < 1e-5


def test_adams_l2_decay_reaches_the_average_from_a_rank_where_the_parameter_went_unused(run_ranks) -> None:
    """torch's Adam adds ``wd p`` to the averaged gradient of every parameter it steps, so a rank
    where a parameter went unused (find_unused_parameters) still owes its share of the L2 term,
    as if it had taken a zero gradient: the two train alike (without it the unused rank's share
    was missing from every such step)."""
    rank0, rank1 = run_ranks({"steps": 8}, worker="adam_unused_worker.py")
    assert torch.equal(rank0["skip"], rank1["skip"])
    assert _relative_difference(rank0["skip"], rank0["zero"]) < 1e-6


def test_a_skipped_step_leaves_adams_l2_decay_to_the_next_step_as_if_its_batch_were_left_out(world_of_one) -> None:
    """Under ``nonfinite="skip"`` a step whose gradient is non-finite is rolled back: after the
    freeze, with Adam's L2 decay, training on with it skipped equals training without its batch
    (the L2 term of the next step enters its gradient once, as any step's)."""
    import lightning_gc

    def train(batches: list[int], poisoned: int | None) -> torch.Tensor:
        model = _LateHead()
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.5)
        gc = lightning_gc.attach(ddp, optimizer, "dgc", compress_ratio=0.25, adam_warmup_steps=2, nonfinite="skip")
        for batch in batches:
            x, y = _batch(batch)
            if batch == poisoned:
                x[0, 0] = float("nan")
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x, True), y).backward()
            gc.step()
        assert gc.totals["skipped_steps"] == (poisoned is not None)
        gc.finish()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    kept = [0, 1, 2, 3, 5, 6, 7]
    assert torch.equal(train([0, 1, 2, 3, 4, 5, 6, 7], poisoned=4), train(kept, poisoned=None))


def test_the_weighting_is_recorded_after_the_fit_released_its_hooks(world_of_one) -> None:
    """A checkpoint written after ``finish()`` still holds the weighted memory: it names the
    weighting, so a resume with another is refused."""
    import lightning_gc

    model = _LateHead()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gc = lightning_gc.attach(ddp, optimizer, "dgc", compress_ratio=0.1, adam_warmup_steps=2, adam_weighting="decrease")
    for step in range(2):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x, True), y).backward()
        gc.step()
    assert "adam_weighting" not in gc.state_dict()["ranks"][0]["resume_settings"]  # the memory is empty yet
    for step in range(2, 4):
        x, y = _batch(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x, True), y).backward()
        gc.step()
    gc.finish()
    assert gc.state_dict()["ranks"][0]["resume_settings"]["adam_weighting"] == "decrease"


def test_a_freeze_without_any_second_moment_is_refused_naming_the_setting() -> None:
    from lightning_gc.core.adam import frozen_denominators

    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(RuntimeError, match=r"Adam holds none yet.*raise adam_warmup_steps"):
        frozen_denominators([torch.optim.AdamW(params)])
