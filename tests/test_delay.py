"""The delay line on its own (lightning_gc.exchanges.delay); the hook's delayed training is in
test_hook_reference.py."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

import lightning_gc
from lightning_gc.common.layout import BucketLayout
from lightning_gc.compressors import create
from lightning_gc.core.memory import CompensationMemory
from lightning_gc.exchanges.delay import CARRY_KINDS, DelayLine
from lightning_gc.exchanges.transport import Transport
from lightning_gc.integrations.attach import AttachedCompression
from lightning_gc.perfmodel.calibration import layout_of_shapes
from lightning_gc.runtime.checkpoint import IncompatibleCheckpoint
from lightning_gc.runtime.hook import CompressionHookState
from lightning_gc.runtime.hook_options import HookOptions

SHAPES = [(6, 5), (4,)]


def test_bad_settings_are_refused_naming_the_value(world_of_one: None) -> None:
    with pytest.raises(ValueError, match=r"`delay` must be an integer >= 1, got 0"):
        DelayLine(0)
    with pytest.raises(ValueError, match=r"`local_update` must be True or False, got 'yes'"):
        DelayLine(1, local_update="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`delay` must be an integer >= 0, got -1"):
        HookOptions(delay=-1)
    with pytest.raises(ValueError, match=r"`local_update=True` needs `delay` >= 1"):
        HookOptions(local_update=True)
    with pytest.raises(ValueError, match=r"`verify_every_n_steps=10` .* differ by design.*local_update=False"):
        lightning_gc.DGCStrategy(delay=1, local_update=True, verify_every_n_steps=10)


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
        grad = torch.full((layout.numel,), -1.0)
        applied = line.hand_over(bucket, step, grad)
        # nothing to add: the slot itself goes to DDP, which copies it into the gradients anyway
        assert (applied is bucket.averages[line.slots(step)[1]]) is not local_update
        assert bool((grad == -1).all()) is not local_update
        written = line.hand_over(bucket, step, torch.empty(layout.numel), writable=True)
        torch.testing.assert_close(written, applied)  # a caller that scales the result gets its own copy
        assert written is not applied or local_update
        handed.append(applied.clone())  # the read slot is written again by the next step
    expected_1 = averages[0] + ((owns[1] - owns[0]) if local_update else 0)
    torch.testing.assert_close(handed[1], expected_1)
    torch.testing.assert_close(handed[0], owns[0] if local_update else torch.zeros(layout.numel))

    restored = DelayLine(1, local_update=local_update)
    restored.load_state_dict(line.state_dict())
    restored.bucket(layout, torch.zeros(layout.numel))
    (owed,) = restored.pending(step=3)  # step 2's average was not handed over yet
    first = layout.segments[0]
    want = averages[2] - (owns[2] if local_update else 0)
    torch.testing.assert_close(owed[first.name], first.of(want))
    assert list(restored.pending(step=3, since=3)) == []  # nothing owed from before the first delayed step


class LaggingTransport(Transport):
    """The real collectives, each round landing ``lag`` seconds after it completed: a slow network,
    so that a step starts while the previous step's exchanges are still decoding."""

    def __init__(self, inner: Transport, lag: float) -> None:
        self.inner, self.lag = inner, lag
        self.world_size, self.rank = inner.world_size, inner.rank

    def launch(self, payload: Any) -> Future[Any]:
        late: Future[Any] = Future()

        def landed(done: Future[Any]) -> None:
            threading.Timer(self.lag, lambda: late.set_result(done.value())).start()

        self.inner.launch(payload).add_done_callback(landed)
        return late


class SlowBackward(torch.nn.Module):
    """Identity whose backward takes 0.1 s: the next bucket's exchange starts that much later."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:
            x.register_hook(lambda grad: (time.sleep(0.1), grad)[1])
        return x


def _lagging_powersgd(**settings: Any) -> tuple[AttachedCompression, torch.nn.Module, Any]:
    """PowerSGD delayed by one step over two buckets (``world_of_one``), on a lagging network."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), SlowBackward(), torch.nn.Linear(64, 64))
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)  # one bucket per layer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gc = lightning_gc.attach(model, optimizer, "powersgd", delay=1, sync_warmup_steps=0, **settings)
    state = gc.session.hook_state
    state.exchange.transport = LaggingTransport(state.exchange.transport, lag=0.3)

    def step(scale: float = 1.0) -> None:
        optimizer.zero_grad()
        (model(torch.ones(8, 64)).pow(2).sum() * scale).backward()
        gc.step()

    return gc, model, step


def _compression_state(gc: AttachedCompression) -> dict[str, Any]:
    gc.session.hook_state.delay_line.drain()
    return {"memory": gc.session.memory.state_dict(), "q": gc.session.compressor.state_dict()["q"]}


def _assert_same_state(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_state_read_while_the_previous_exchanges_land_is_the_state_after_them(world_of_one: None) -> None:
    """PowerSGD's decode writes its residual and Q, and under a delay it runs while the next step
    computes. A checkpoint taken then, and the snapshot a skipped step rolls back to, must both be
    the state after those decodes (the later bucket's lands 0.1 s after the earlier's)."""
    gc, _, step = _lagging_powersgd(nonfinite="skip")
    for _ in range(3):
        step()
    saved = gc.session.hook_state.state_dict()  # straight away: exchanges still in flight
    settled = _compression_state(gc)
    _assert_same_state({"memory": saved["memory"], "q": saved["compressor"]["q"]}, settled)
    gc.finish()

    skipped, _, step = _lagging_powersgd(nonfinite="skip")
    for _ in range(3):
        step()
    step(scale=float("nan"))  # at once: rolled back to the state after step 2's exchanges
    assert skipped.totals["skipped_steps"] == 1
    _assert_same_state(_compression_state(skipped), settled)
    skipped.finish()


def test_what_a_checkpoint_owes_is_applied_once_at_the_end_of_training(world_of_one: None) -> None:
    """A checkpoint taken mid-run owes the last delayed average: finishing straight after resuming
    it (no step taken, nothing bound to a bucket yet) applies that average exactly as the original
    run's end did. After :meth:`finish` nothing is owed, so a checkpoint written then owes nothing."""
    gc, model, step = _lagging_powersgd()
    for _ in range(3):
        step()
    entry = gc.state_dict()  # owes step 2's average
    at_checkpoint = [p.detach().clone() for p in model.parameters()]
    gc.finish()
    finished = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(at_checkpoint, finished))  # something was owed
    assert gc.state_dict()["ranks"][0]["delayed"] == {}

    again, model, _ = _lagging_powersgd()
    with torch.no_grad():
        for param, value in zip(model.parameters(), at_checkpoint):
            param.copy_(value)
    again.load_state_dict(entry)
    again.finish()
    for param, value in zip(model.parameters(), finished):
        assert torch.equal(param, value)


def test_a_rebuild_into_fewer_buckets_leaves_no_stale_bucket_behind() -> None:
    """DDP's rebuild can merge buckets: the slots move to the new bucket by name, and what the
    end of training owes is read from there only."""
    first, second = layout_of_shapes([(3,)]), layout_of_shapes([(3,), (2,)])
    second_alone = BucketLayout(index=1, segments=(replace(second.segments[1], start=0),), param_ids=(1,))
    line = DelayLine(1)
    for layout in (first, second_alone):
        line.bucket(layout, torch.zeros(layout.numel)).averages[0].fill_(1.0)  # step 0's averages
    merged = line.bucket(second, torch.zeros(second.numel))  # one bucket of both
    assert torch.equal(merged.averages[0], torch.ones(5))  # taken over by name
    merged.averages[0].fill_(2.0)  # as a later decode would
    (owed,) = line.pending(step=1)
    assert sorted(owed) == ["t0", "t1"] and all(bool((value == 2.0).all()) for value in owed.values())


def test_the_performance_model_hides_the_exchange_behind_the_whole_next_step() -> None:
    from lightning_gc.perfmodel import CodecCost, Network
    from lightning_gc.perfmodel.step import Workload, predict

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
    ``delay`` 1 and 2, with OD-SGD's local update, across a skipped step (which must not carry
    twice), and with gradients zeroed in place (an unused parameter's ``grad`` is then a zero
    tensor: unused is what autograd says, as for DDP, not ``grad is None``)."""
    lr, steps = 0.1, 10
    runs = [
        {"settings": {"delay": 1}},
        {"settings": {"delay": 2}},
        {"settings": {"delay": 1, "local_update": True}},
        # step 4 (which does not use it) carries step 3's average for it, and is skipped and retried
        {"settings": {"delay": 1, "nonfinite": "skip"}, "nan_at": 4},
        # gradients zeroed in place: unused, `side` keeps a zero grad (not None), as DDP sees it unused
        {"settings": {"delay": 1}, "set_to_none": False},
        {"settings": {"delay": 2, "local_update": True}, "set_to_none": False},
    ]
    ranks = run_ranks({"runs": runs, "lr": lr, "steps": steps}, worker="delay_unused_worker.py")
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    from delay_unused_worker import side_input

    expected = -lr * sum((side_input(0, t) + side_input(1, t)) / 2 for t in range(steps) if t % 3 == 0)
    for rank in ranks:
        for run, trained in zip(runs, rank):
            torch.testing.assert_close(trained[:16], expected, rtol=1e-5, atol=1e-6, msg=str(run))


def test_a_static_graph_may_leave_a_parameter_unused_under_delay(run_ranks) -> None:
    """DDP's ``static_graph=True`` lets a parameter go unused (the same one every step) and leaves
    its gradient alone, as ``find_unused_parameters`` does: the delayed hand-over carries for it
    there too (it raised for want of a carry), and trains exactly as under ``find_unused_parameters``."""
    never = {"side_every": None}
    runs = [
        {"settings": {"delay": 1}, "ddp": {"static_graph": True}, **never},
        {"settings": {"delay": 1}, "ddp": {"find_unused_parameters": True}, **never},
    ]
    ranks = run_ranks({"runs": runs, "lr": 0.1, "steps": 6}, worker="delay_unused_worker.py")
    for static, found in ranks:
        assert torch.equal(static, found) and not static[:16].any()
    assert torch.equal(ranks[0][0], ranks[1][0])


def _heavy_ball_grows(step: float, momentum: float, delay: int, iterations: int = 4000) -> bool:
    """Run the delayed heavy-ball recurrence of lightning_gc.core.staleness on one curvature direction."""
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

    from lightning_gc.core.staleness import stable_step_limit

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
    from lightning_gc.core.handover import MomentumHandOver

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


def test_a_carry_is_resumed_only_by_a_run_that_would_apply_it() -> None:
    """A checkpoint of a run that expected unused parameters holds their carries: a run without
    ``find_unused_parameters`` takes them when nothing is owed (dropped) and refuses them, naming
    the parameters and the setting, when something is."""
    layout = layout_of_shapes([(6, 5), (4,)])
    carrying = DelayLine(1, carry_unused=True)
    bucket = carrying.bucket(layout, torch.zeros(layout.numel))
    plain = DelayLine(1)
    plain.load_state_dict(carrying.state_dict())  # all zero: nothing owed
    assert plain.state_dict() and not any(
        kind in CARRY_KINDS for entry in plain.state_dict().values() for kind in entry
    )
    bucket.carries[1][30:].fill_(0.5)  # t1's carry
    with pytest.raises(
        IncompatibleCheckpoint, match=r"owed to parameters unused when they were due \(t1\).*find_unused"
    ):
        DelayLine(1).load_state_dict(carrying.state_dict())
    resumed = DelayLine(1, carry_unused=True)
    resumed.load_state_dict(carrying.state_dict())
    assert torch.equal(resumed.state_dict()["t1"]["carry.1"], torch.full((4,), 0.5))


@pytest.mark.parametrize("local_update", [False, True])
def test_what_is_carried_joins_the_oldest_owed_step_not_a_step_of_its_own(local_update: bool) -> None:
    """At the end of training a carry is added to the oldest owed average, as training adds it to
    the next step that uses the parameter: one optimizer step per owed step (a step of its own
    would apply weight decay and optimizer momentum to every parameter once more)."""
    layout = layout_of_shapes([(6, 5), (4,)])
    line = DelayLine(2, local_update=local_update, carry_unused=True)
    bucket = line.bucket(layout, torch.zeros(layout.numel))
    for slot, average in enumerate(bucket.averages):
        average.fill_(float(slot + 1))
    for slot, own in enumerate(bucket.owns):
        own.fill_(10.0 * (slot + 1))
    bucket.carries[(5 - 1) % 2][30:].fill_(0.5)  # what step 4 carried for t1
    owed = list(line.pending(step=5))  # steps 3 and 4 owe their averages
    assert len(owed) == 2
    for j, entry in zip((3, 4), owed):
        slot = j % 3
        want = torch.full((layout.numel,), float(slot + 1)) - (10.0 * (slot + 1) if local_update else 0.0)
        if j == 3:
            want[30:] += 0.5
        for segment in layout.segments:
            torch.testing.assert_close(entry[segment.name], segment.of(want))


def test_a_resume_keeps_the_delayed_history_and_refuses_to_end_it_early(world_of_one: None) -> None:
    """A checkpoint written at step 5 of a run delayed since step 2: a resume may not make step 5
    or later synchronous again (``sync_warmup_steps`` > 5, set at once or later by a sparsity
    warm-up's length), which would drop the averages in flight; one that keeps it owes the end of
    training every delayed step's average from step 2 on. A run resumed inside its synchronous
    warm-up, or from a synchronous checkpoint, is delayed from the later of the two steps."""

    def hook_state(sync_warmup_steps: int) -> CompressionHookState:
        memory = CompensationMemory(momentum_correction=False, momentum_masking=False, clip_norm=None)
        return CompressionHookState(
            create("none"), memory, {}, options=HookOptions(delay=1, sync_warmup_steps=sync_warmup_steps)
        )

    writer = hook_state(2)
    writer.step = 5
    saved = writer.state_dict()
    with pytest.raises(IncompatibleCheckpoint, match=r"step 5 of a run delayed since step 2.*sync_warmup_steps <= 5"):
        hook_state(6).load_state_dict(saved)
    resumed = hook_state(0)
    resumed.load_state_dict(saved)
    with pytest.raises(IncompatibleCheckpoint, match=r"sync_warmup_steps=9 would make steps 5 to 8 synchronous"):
        resumed.sync_warmup_steps = 9  # as a SparsityWarmup sets it when training starts
    resumed.sync_warmup_steps = 5
    assert resumed.first_delayed_step() == 2 and resumed.delayed(5)
    assert resumed.state_dict()["delayed_since"] == 2  # and so on through every later resume

    warm = hook_state(8)
    warm.step = 3  # still synchronous
    inside = hook_state(8)
    inside.load_state_dict(warm.state_dict())
    inside.sync_warmup_steps = 2  # shortened: nothing is in flight to drop
    assert inside.first_delayed_step() == 3 and inside.delayed(3)
    synchronous = {**warm.state_dict(), "delay": (0, False)}
    del synchronous["delayed"], synchronous["delayed_since"]
    later = hook_state(0)
    later.load_state_dict(synchronous)
    assert later.first_delayed_step() == 3
