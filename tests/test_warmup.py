"""SparsityWarmup's schedule: the paper's exponential warm-up, explicit lists, step intervals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_gc import GradientCompressionStrategy, SparsityWarmup


def test_default_is_the_papers_schedule() -> None:
    warmup = SparsityWarmup()
    sparsity = [1 - warmup.ratio_at(stage, target=0.001) for stage in range(6)]
    assert sparsity[:3] == [0.75, 0.9375, 0.984375]
    assert sparsity[3] == pytest.approx(0.996, abs=5e-4)
    assert sparsity[4] == sparsity[5] == pytest.approx(0.999)


def test_stage_never_sends_less_than_the_target() -> None:
    warmup = SparsityWarmup([0.5, 0.01, 0.001])
    assert [warmup.ratio_at(s, target=0.02) for s in range(4)] == [0.5, 0.02, 0.02, 0.02]


def _fake_trainer(epoch: int, step: int, ratio: float) -> SimpleNamespace:
    strategy = GradientCompressionStrategy("dgc", compress_ratio=ratio)
    return SimpleNamespace(
        current_epoch=epoch, global_step=step, strategy=strategy, num_training_batches=8, accumulate_grad_batches=1
    )


def test_epoch_interval_sets_the_strategy_ratio() -> None:
    warmup = SparsityWarmup()
    trainer = _fake_trainer(epoch=0, step=0, ratio=0.001)
    warmup.setup(trainer, None, "fit")
    for epoch, expected in [(0, 0.25), (2, 0.015625), (7, 0.001), (1, 0.0625)]:
        trainer.current_epoch = epoch
        warmup.on_train_batch_start(trainer, None, None, 0)
        assert trainer.strategy.adjustable.compress_ratio == expected


def test_fractional_epochs_per_stage_count_the_epochs_batches() -> None:
    """Four stages in one epoch of 8 batches (the language-model warm-up): two batches a stage,
    then the target from the next epoch on; a resumed epoch continues the same schedule."""
    warmup = SparsityWarmup(epochs_per_stage=0.25)
    trainer = _fake_trainer(epoch=0, step=0, ratio=0.001)
    warmup.setup(trainer, None, "fit")
    seen = []
    for epoch, batch in [(0, 0), (0, 1), (0, 2), (0, 5), (0, 6), (0, 7), (1, 0), (3, 4)]:
        trainer.current_epoch = epoch
        warmup.on_train_batch_start(trainer, None, None, batch)
        seen.append(trainer.strategy.adjustable.compress_ratio)
    assert seen == [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]
    two_epochs = SparsityWarmup(epochs_per_stage=2)  # longer stages too
    assert two_epochs.epochs_per_stage == 2.0
    trainer.current_epoch = 3
    two_epochs.setup(trainer, None, "fit")
    two_epochs.on_train_batch_start(trainer, None, None, 7)
    assert trainer.strategy.adjustable.compress_ratio == 0.0625


def test_step_interval_and_target_captured_once() -> None:
    warmup = SparsityWarmup([0.3, 0.1], interval="step", steps_per_stage=10)
    trainer = _fake_trainer(epoch=0, step=0, ratio=0.01)
    warmup.setup(trainer, None, "fit")
    seen = []
    for step in (0, 9, 10, 19, 20, 500):
        trainer.global_step = step
        warmup.on_train_batch_start(trainer, None, None, 0)
        seen.append(trainer.strategy.adjustable.compress_ratio)
    assert seen == [0.3, 0.3, 0.1, 0.1, 0.01, 0.01]
    warmup.setup(_fake_trainer(0, 0, ratio=0.3), None, "fit")  # a second fit: the target stays 0.01
    assert warmup.target == 0.01


def test_needs_a_compressing_strategy() -> None:
    with pytest.raises(ValueError, match="compress_ratio.*got object$"):
        SparsityWarmup().setup(SimpleNamespace(strategy=object()), None, "fit")
    # duck typing is not enough: an `adjustable` attribute on another strategy is refused too
    impostor = SimpleNamespace(adjustable=SimpleNamespace(compress_ratio=0.1))
    with pytest.raises(ValueError, match="got SimpleNamespace$"):
        SparsityWarmup().setup(SimpleNamespace(strategy=impostor), None, "fit")


def test_the_ratio_set_reaches_the_next_encode() -> None:
    """A ratio changed between epochs makes the compressor plan afresh: each stage sends its own k."""
    import torch

    from lightning_gc.common.layout import BucketLayout, Segment
    from lightning_gc.compressors import EncodeContext

    layout = BucketLayout(index=0, segments=(Segment("w", 0, 0, (64, 64)),), param_ids=(0,))
    trainer = _fake_trainer(epoch=0, step=0, ratio=0.001)
    warmup = SparsityWarmup([0.25, 0.0625])
    warmup.setup(trainer, None, "fit")
    velocity = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    sent = []
    for epoch in range(3):
        trainer.current_epoch = epoch
        warmup.on_train_batch_start(trainer, None, None, 0)
        encoded = trainer.strategy.compressor.encode(
            velocity, torch.empty_like(velocity), EncodeContext(layout, step=epoch, world_size=1)
        )
        sent.append(encoded.payload.elements_sent)
    assert sent == [1024, 256, 5]  # ceil(ratio * 4096) at 0.25, 0.0625, then the target 0.001


def test_a_compressor_without_a_ratio_is_refused_by_name() -> None:
    assert GradientCompressionStrategy("randomk").adjustable is not None  # random-k has one, in (0, 1)
    with pytest.raises(ValueError, match="got GradientCompressionStrategy with compressor 'qsgd'"):
        SparsityWarmup().setup(SimpleNamespace(strategy=GradientCompressionStrategy("qsgd")), None, "fit")


def test_warmup_length_in_optimizer_steps() -> None:
    trainer = _fake_trainer(epoch=0, step=0, ratio=0.001)  # 8 batches an epoch
    assert SparsityWarmup().steps(trainer) == 32  # 4 stages of one epoch
    assert SparsityWarmup(epochs_per_stage=0.25).steps(trainer) == 8  # the language models' one epoch
    trainer.accumulate_grad_batches = 3
    assert SparsityWarmup(epochs_per_stage=0.25).steps(trainer) == 3  # ceil(8 / 3) optimizer steps
    assert SparsityWarmup().steps(trainer) == 12  # each epoch's last, partial accumulation steps too: 4 x 3
    assert SparsityWarmup(epochs_per_stage=0.375).steps(trainer) == 3 + 2  # 1.5 epochs: 3, then ceil(4 / 3)
    assert SparsityWarmup([0.3, 0.1], interval="step", steps_per_stage=10).steps(trainer) == 20


@pytest.mark.parametrize(("sync_warmup_steps", "expected"), [(None, 32), (0, 0), (5, 5)])
def test_a_delayed_exchange_stays_synchronous_through_the_warmup_by_default(
    sync_warmup_steps: int | None, expected: int
) -> None:
    """``sync_warmup_steps=None`` (the default) becomes the warm-up's length when training starts,
    before any step; an explicit value, 0 included, is kept."""
    strategy = GradientCompressionStrategy("dgc", compress_ratio=0.001, delay=1, sync_warmup_steps=sync_warmup_steps)
    strategy.session.hook_state = SimpleNamespace(sync_warmup_steps=sync_warmup_steps or 0)  # as setup builds it
    trainer = SimpleNamespace(
        current_epoch=0, global_step=0, strategy=strategy, num_training_batches=8, accumulate_grad_batches=1
    )
    SparsityWarmup().on_train_start(trainer, None)
    assert strategy.hook_state.sync_warmup_steps == expected
