"""The delay line on its own (lightning_gc.delay); the hook's delayed training is in test_hook_reference.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_gc.calibration import layout_of_shapes
from lightning_gc.compressors import create
from lightning_gc.delay import DelayLine
from lightning_gc.hook import CompressionHookState
from lightning_gc.memory import CompensationMemory

SHAPES = [(6, 5), (4,)]


def test_bad_settings_are_refused_naming_the_value(world_of_one: None) -> None:
    with pytest.raises(ValueError, match=r"`delay` must be an integer >= 1, got 0"):
        DelayLine(0)
    with pytest.raises(ValueError, match=r"`local_update` must be True or False, got 'yes'"):
        DelayLine(1, local_update="yes")  # type: ignore[arg-type]
    memory = CompensationMemory(momentum_correction=False, momentum_masking=True, clip_norm=None)
    with pytest.raises(ValueError, match=r"`delay` must be an integer >= 0, got -1"):
        CompressionHookState(create("none"), memory, {}, delay=-1)
    with pytest.raises(ValueError, match=r"`local_update=True` needs `delay` >= 1"):
        CompressionHookState(create("none"), memory, {}, local_update=True)


def test_slots_never_read_the_one_written_and_cycle_through_delay_plus_one() -> None:
    for delay in (1, 2, 3):
        line = DelayLine(delay)
        for step in range(20):
            write, read = line.slots(step)
            assert write != read
            assert line.slots(step - delay)[0] == read  # read what was written `delay` steps ago


@pytest.mark.parametrize("local_update", [False, True])
def test_hand_over_and_pending_follow_the_rule_and_survive_a_checkpoint(local_update: bool) -> None:
    layout = layout_of_shapes(SHAPES)
    line = DelayLine(1, local_update=local_update)
    bucket = line.bucket(layout, torch.zeros(layout.numel))
    averages = {step: torch.full((layout.numel,), float(step + 1)) for step in range(3)}
    owns = {step: torch.full((layout.numel,), 10.0 * (step + 1)) for step in range(3)}
    handed = []
    for step in range(3):
        write, _ = line.slots(step)
        bucket.averages[write].copy_(averages[step])  # as the exchange's decode would
        if local_update:
            bucket.owns[write].copy_(owns[step])  # as memory's commit would
        grad = torch.empty(layout.numel)
        line.hand_over(bucket, step, grad)
        handed.append(grad)
    expected_1 = averages[0] + ((owns[1] - owns[0]) if local_update else 0)
    torch.testing.assert_close(handed[1], expected_1)
    torch.testing.assert_close(handed[0], owns[0] if local_update else torch.zeros(layout.numel))

    restored = DelayLine(1, local_update=local_update)
    restored.load_state_dict(line.state_dict())
    restored.bucket(layout, torch.zeros(layout.numel))
    (owed,) = restored.pending(step=3)  # step 2's average was not handed over yet
    first = layout.segments[0]
    want = averages[2] - (owns[2] if local_update else 0)
    torch.testing.assert_close(owed[first.name], first.of(want).view(first.shape))
    assert list(restored.pending(step=3, since=3)) == []  # nothing owed from before the first delayed step


def test_the_performance_model_hides_the_exchange_behind_the_whole_next_step() -> None:
    from lightning_gc.perfmodel import CodecCost, Network, Workload, predict

    network = Network.from_bits(world_size=8, bits_per_second=1e9, host_bits_per_second=8e9)
    cost = CodecCost("fp16", summed_bytes=50_000_000, gathered_bytes=0, encode_s=0.004, decode_s=0.002)
    synchronous = Workload(gradient_numel=25_000_000, compute_s=0.2, overlap=0.5)
    delayed = Workload(gradient_numel=25_000_000, compute_s=0.2, overlap=0.5, delay=1)
    _, sync_row = predict(synchronous, network, [cost])
    _, delayed_row = predict(delayed, network, [cost])
    t_comm, t_host = sync_row.comm_s, sync_row.host_s
    assert delayed_row.step_s == pytest.approx(max(0.2, t_comm - t_host) + 0.006 + t_host)
    assert sync_row.step_s == pytest.approx(0.2 + 0.006 + t_host + max(0.0, t_comm - t_host - 0.1))
    assert delayed_row.step_s < sync_row.step_s
    with pytest.raises(ValueError, match=r"`delay` must be an integer >= 0, got -1"):
        Workload(gradient_numel=1, compute_s=0.1, delay=-1)


def test_an_average_owed_to_a_parameter_unused_in_a_later_step_is_applied_later(run_ranks) -> None:
    """``find_unused_parameters=True``: a parameter used every third step is unused on every rank
    in the step that would apply its delayed average, and DDP leaves such a parameter's gradient
    alone. The average is carried to the next step that uses it (or to the end of training), so
    nothing is lost: the parameter ends exactly at ``-lr * sum of its averaged gradients``, with
    ``delay`` 1 and 2, with OD-SGD's local update, and across a skipped step (which must not
    carry twice)."""
    lr, steps = 0.1, 10
    runs = [
        {"settings": {"delay": 1}},
        {"settings": {"delay": 2}},
        {"settings": {"delay": 1, "local_update": True}},
        # step 4 (which does not use it) carries step 3's average for it, and is skipped and retried
        {"settings": {"delay": 1, "nonfinite": "skip"}, "nan_at": 4},
    ]
    ranks = run_ranks({"runs": runs, "lr": lr, "steps": steps}, worker="delay_unused_worker.py")
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    from delay_unused_worker import side_input

    expected = -lr * sum((side_input(0, t) + side_input(1, t)) / 2 for t in range(steps) if t % 3 == 0)
    for rank in ranks:
        for run, side in zip(runs, rank):
            torch.testing.assert_close(side, expected, rtol=1e-5, atol=1e-6, msg=str(run))


def _heavy_ball_grows(step: float, momentum: float, delay: int, iterations: int = 4000) -> bool:
    """Run the delayed heavy-ball recurrence of lightning_gc.staleness on one curvature direction."""
    w, velocities = 1.0, [0.0] * (delay + 1)  # u_{t-1}, ..., u_{t-1-delay}
    for _ in range(iterations):
        u = momentum * velocities[0] + step * w
        velocities = [u, *velocities[:-1]]
        w -= velocities[delay] if delay else u
        if abs(w) > 1e6:  # diverging (and before overflow turns it into NaN)
            return True
    return abs(w) > 1.0


def test_stable_step_limits_match_the_closed_forms_and_the_recurrence() -> None:
    import math

    from lightning_gc.staleness import stable_step_limit

    for momentum in (0.0, 0.5, 0.9):
        assert stable_step_limit(momentum, 0) == pytest.approx(2 * (1 + momentum))
        assert stable_step_limit(momentum, 1) == pytest.approx(1 - momentum, rel=1e-6)
        limits = [stable_step_limit(momentum, d) for d in range(5)]
        assert limits == sorted(limits, reverse=True)  # more delay, smaller steps
        for delay, limit in enumerate(limits):  # the recurrence itself: converges below, diverges above
            assert not _heavy_ball_grows(0.97 * limit, momentum, delay)
            assert _heavy_ball_grows(1.03 * limit, momentum, delay)
    for delay in (1, 2, 3, 4):  # plain SGD with stale gradients: 2 sin(pi / (4d + 2))
        assert stable_step_limit(0.0, delay) == pytest.approx(2 * math.sin(math.pi / (4 * delay + 2)), rel=1e-6)


def test_a_delay_of_momentum_sgd_without_the_local_update_warns_with_the_factor() -> None:
    from lightning_gc.handover import MomentumHandOver

    memory = CompensationMemory(momentum_correction=True, momentum_masking=True, clip_norm=None)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    hand_over = MomentumHandOver(memory, None, "test")
    with pytest.warns(UserWarning, match=r"delay=1 .* with momentum 0.9 the largest stable learning rate shrinks 38x"):
        hand_over.check([sgd], local_update=False, delay=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hand_over.check([sgd], local_update=True, delay=1)  # own update fresh: no warning
        hand_over.check([sgd], local_update=False, delay=0)
        plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        hand_over.check([plain], local_update=False, delay=1)  # no momentum: 2x, as any stale SGD
        unit = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=1.0)
        hand_over.check([unit], local_update=False, delay=1)  # no bound to state (and no error)
