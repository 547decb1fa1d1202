"""OuterLoop: the DiLoCo-family outer loop over a process group (lightning_gc.runtime.outer).

The 2-rank cases run in one launch of ``workers/outer_worker.py`` (shared by the tests below);
the argument checks and the sync cadence run in this process over a real group of one rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import launch_ranks

from lightning_gc.runtime.outer import OuterLoop, OuterSGD, Streaming
from lightning_gc.runtime.outer_fragments import partition

CASES = ["equivalence", "diloco", "compressed", "resume", "mismatch", "unstreamed", "stagger", "streaming_resume"]
CASES += ["buffers"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_ranks("outer_worker.py", {"cases": CASES}, tmp_path_factory.mktemp("outer"), world_size=2)


def assert_bitwise_equal(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert list(mine) == list(theirs)
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), f"{what}: {name} differs"


def test_one_step_exact_average_is_ddp(ranks):
    """H = 1, no compression, outer SGD lr 1 without momentum, inner SGD: synchronous DDP."""
    for rank in ranks:
        case = rank["equivalence"]
        assert case["syncs"] == 5
        for name, value in case["outer"].items():
            torch.testing.assert_close(value, case["ddp"][name], rtol=0, atol=1e-5)
    assert_bitwise_equal(ranks[0]["equivalence"]["outer"], ranks[1]["equivalence"]["outer"], "equivalence")


def test_diloco_learns_and_ranks_agree_after_every_sync(ranks):
    mine, theirs = ranks[0]["diloco"], ranks[1]["diloco"]
    assert mine["syncs"] == theirs["syncs"] == 6
    assert len(mine["synced"]) == 6
    for t, (a, b) in enumerate(zip(mine["synced"], theirs["synced"])):
        assert_bitwise_equal(a, b, f"sync {t}")  # parameters and BatchNorm buffers
        for name, before in mine["before_sync"][t].items():  # the mean of the ranks' own, not one rank's
            mean = (before + theirs["before_sync"][t][name]) / 2
            assert not torch.equal(before, theirs["before_sync"][t][name]), (t, name)
            torch.testing.assert_close(a[name], mean, rtol=0, atol=1e-6)
    assert mine["end"] < 0.25 * mine["start"], (mine["start"], mine["end"])


def test_compressed_pseudo_gradients_agree_and_send_little(ranks):
    mine, theirs = ranks[0]["compressed"], ranks[1]["compressed"]
    assert mine["syncs"] == 6
    for t, (a, b) in enumerate(zip(mine["synced"], theirs["synced"])):
        assert_bitwise_equal(a, b, f"sync {t}")
    dense = mine["syncs"] * mine["numel"] * 4
    for rank in ranks:
        assert 0 < rank["compressed"]["bytes_sent"] < 0.25 * dense


def test_resume_between_syncs_is_bit_for_bit(ranks):
    for rank in ranks:
        case = rank["resume"]
        assert case["saved_at"] == (10, 2)  # two syncs and two inner steps into the third interval
        assert case["straight"]["syncs"] == case["resumed"]["syncs"] == 4
        assert_bitwise_equal(case["straight"]["model"], case["resumed"]["model"], "module")
        assert_bitwise_equal(case["straight"]["global"], case["resumed"]["global"], "theta_g")


def test_different_starting_parameters_are_refused(ranks):
    for rank in ranks:
        error = rank["mismatch"]["error"]
        assert error is not None and "same starting parameters" in error and "'0.weight'" in error


def test_one_fragment_without_delay_equals_the_unstreamed_loop(ranks):
    for rank in ranks:
        assert_bitwise_equal(rank["unstreamed"]["streamed"], rank["unstreamed"]["reference"], "P=1, tau=0")


def test_fragments_land_at_their_staggered_steps(ranks):
    """H = 4, P = 2 (offsets 0 and 2), tau = 1: fragment 0 launches at steps 4, 8, 12 and lands
    at 5, 9; fragment 1 at 2, 6, 10 and lands at 3, 7, 11. Its theta_g changes only then, and
    its theta_r is set to theta_g then (mix 0); the ranks hold the same theta_g at every step."""
    mine, theirs = ranks[0]["stagger"], ranks[1]["stagger"]
    assert mine["sizes"] == [32 * 64 + 64, 64 * 64 + 64 + 64 + 1]  # cut nearest to half of the elements
    lands = {0: {5, 9}, 1: {3, 7, 11}}
    for fragment, steps in lands.items():
        changed = set()
        for step in range(2, 13):
            before, after = mine["globals"][step - 2][fragment], mine["globals"][step - 1][fragment]
            if not all(torch.equal(a, b) for a, b in zip(before, after)):
                changed.add(step)
        assert changed == steps, (fragment, changed)
        for step in steps:
            assert mine["local_is_global"][step - 1][fragment], (fragment, step)
            assert not mine["local_is_global"][step - 2][fragment], (fragment, step)  # trained meanwhile
    assert mine["landed"] == [step in {3, 5, 7, 9, 11} for step in range(1, 13)]
    assert mine["flying"] == [[1] if s in (2, 6, 10) else [0] if s in (4, 8, 12) else [] for s in range(1, 13)]
    assert mine["syncs"] == 5
    for step, (a, b) in enumerate(zip(mine["globals"], theirs["globals"]), start=1):
        for fragment, (x, y) in enumerate(zip(a, b)):
            assert all(torch.equal(u, v) for u, v in zip(x, y)), (step, fragment)


def test_streaming_resume_with_an_exchange_in_flight_is_bit_for_bit(ranks):
    for rank in ranks:
        case = rank["streaming_resume"]
        assert case["in_flight"] == case["resumed_in_flight"] == [1]  # launched at step 10, lands at 11
        assert case["straight"]["syncs"] == case["resumed"]["syncs"] == 7  # fragment 0: 5, 9, 13; 1: 3, 7, 11, 15
        assert case["bytes"][0] == case["bytes"][1]
        assert_bitwise_equal(case["straight"]["model"], case["resumed"]["model"], "module")
        assert_bitwise_equal(case["straight"]["global"], case["resumed"]["global"], "theta_g")
    assert_bitwise_equal(
        ranks[0]["streaming_resume"]["resumed"]["global"], ranks[1]["streaming_resume"]["resumed"]["global"], "ranks"
    )


def test_global_weights_hold_the_buffers_averaged_at_the_last_sync(ranks):
    """Validation and checkpoints (inside global_weights()) pair theta_g with the float buffers of
    the last sync, the same on every rank; outside, each rank keeps its own running statistics."""
    mine, theirs = ranks[0]["buffers"], ranks[1]["buffers"]
    running = [name for name in mine["local"] if name.endswith(("running_mean", "running_var"))]
    assert running and all(not torch.equal(mine["local"][n], theirs["local"][n]) for n in running)
    assert_bitwise_equal(mine["inside"], theirs["inside"], "buffers inside global_weights()")
    for rank in ranks:
        case = rank["buffers"]
        assert_bitwise_equal(case["after"], case["local"], "the rank's own buffers back after the block")
        assert all(torch.equal(case["state"][n], case["inside"][n]) for n in running)


# ---------------------------------------------------------------- one process
def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def built(arguments: dict[str, Any]) -> OuterLoop:
    """``OuterLoop(small(), sync_every=2, ...)`` with the outer SGD's and streaming's settings by
    their front-end names (``outer_lr``, ``fragments``, ...)."""
    arguments = {"sync_every": 2, **arguments}
    sgd = {k[len("outer_") :]: arguments.pop(k) for k in list(arguments) if k.startswith("outer_")}
    streaming = {k: arguments.pop(k) for k in ("fragments", "sync_delay", "mix") if k in arguments}
    return OuterLoop(small(), outer=OuterSGD(**sgd), streaming=Streaming(**streaming), **arguments)


@pytest.mark.parametrize(
    "arguments, match",
    [
        ({"sync_every": 0}, "`sync_every` must be an integer >= 1, got 0"),
        ({"sync_every": 2.0}, "`sync_every` must be an integer"),
        ({"error_decay": 0.0}, r"`error_decay` must be in \(0, 1\], got 0.0"),
        ({"error_decay": 1.5}, "`error_decay`"),
        ({"outer_lr": 0.0}, r"`outer_lr` must be in \(0, inf\]"),
        ({"outer_momentum": 1.0}, r"`outer_momentum` must be in \[0, 1\)"),
        ({"outer_momentum": 0.0}, "`outer_nesterov=True` needs `outer_momentum` > 0"),
        ({"outer_nesterov": "yes"}, "`outer_nesterov` must be True or False"),
        ({"compressor": "nope"}, r"`compressor` must be one of \[.*\], got 'nope'"),
        ({"compressor": "topk", "ratio": 0.1}, r"compressor 'topk' takes no argument\(s\) \['ratio'\]"),
        ({"fragments": 0}, "`fragments` must be an integer >= 1, got 0"),
        ({"fragments": 5}, "`fragments=5` must be at most the module's 4 trainable parameter tensors"),
        ({"sync_delay": -1}, "`sync_delay` must be an integer >= 0, got -1"),
        (
            {"sync_every": 4, "fragments": 2, "sync_delay": 2},
            r"`sync_delay` must be below sync_every / fragments = 4/2 = 2, got 2",
        ),
        ({"sync_every": 2, "sync_delay": 2}, r"`sync_delay` must be below sync_every / fragments = 2/1 = 2, got 2"),
        ({"mix": 1.0}, r"`mix` must be in \[0, 1\), got 1.0"),
        ({"mix": -0.1}, r"`mix` must be in \[0, 1\), got -0.1"),
        (
            {"compressor": "qsgd", "error_decay": 0.9},
            r"`error_decay=0.9` needs error feedback, which compressor 'qsgd' \(unbiased\) does not keep",
        ),
        ({"error_decay": 0.5}, r"`error_decay=0.5` needs error feedback, which compressor 'none'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(world_of_one, arguments, match):
    with pytest.raises(ValueError, match=match) as caught:
        built(arguments)
    assert "\n" not in str(caught.value)


def test_a_module_without_trainable_parameters_is_refused(world_of_one):
    frozen = small().requires_grad_(False)
    with pytest.raises(ValueError, match="`module` \\(Sequential\\) has no trainable parameters"):
        OuterLoop(frozen, sync_every=2)


@pytest.mark.parametrize("sync_every", [1, 3])
def test_syncs_exactly_every_sync_every_steps(world_of_one, sync_every):
    model = small()
    outer = OuterLoop(model, sync_every=sync_every)
    done = [outer.inner_step_done() for _ in range(3 * sync_every)]
    assert done == ([False] * (sync_every - 1) + [True]) * 3
    assert (outer.inner_steps, outer.syncs) == (3 * sync_every, 3)


def test_one_rank_sync_lands_on_the_local_parameters(world_of_one):
    """One rank, exact average, outer SGD lr 1 without momentum: theta_g <- theta_r."""
    model = small()
    outer = OuterLoop(model, sync_every=1, outer=OuterSGD(lr=1.0, momentum=0.0, nesterov=False))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    local = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert outer.inner_step_done()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, local[name], rtol=0, atol=1e-6)
        assert torch.equal(p, outer.global_parameters[name])
    assert outer.bytes_sent > 0


def test_a_state_for_another_module_is_refused(world_of_one):
    outer = OuterLoop(small(), sync_every=2)
    state = outer.state_dict()
    torch.manual_seed(0)
    other = OuterLoop(torch.nn.Sequential(torch.nn.Linear(4, 8)), sync_every=2)
    with pytest.raises(ValueError, match="the state holds parameters"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("numels", "parts", "ranges"),
    [
        ([10, 10, 10, 10], 2, [(0, 2), (2, 4)]),
        ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),  # the big tensor alone: each fragment keeps one at least
        ([1, 1, 1, 100], 3, [(0, 2), (2, 3), (3, 4)]),  # the big tensor alone
        ([5, 5, 5], 3, [(0, 1), (1, 2), (2, 3)]),
        ([7, 3], 1, [(0, 2)]),
    ],
)
def test_fragments_are_contiguous_and_balanced_by_elements(numels, parts, ranges):
    assert partition(numels, parts) == ranges


def test_mix_keeps_part_of_the_steps_taken_in_flight(world_of_one):
    """One rank, exact average, outer SGD lr 1 without momentum: theta_g <- theta_r at launch;
    tau = 1 step later theta_r <- lerp(theta_g, theta_r, 0.25). With mix 0 it is theta_g."""
    for mix in (0.0, 0.25):
        model = small()
        outer = OuterLoop(
            model, sync_every=2, outer=OuterSGD(1.0, 0.0, False), streaming=Streaming(sync_delay=1, mix=mix)
        )
        moves = []
        for step in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1 * (step + 1))
            moves.append([p.detach().clone() for p in model.parameters()])
            assert outer.inner_step_done() == (step == 2)
        assert outer.in_flight == [] and outer.syncs == 1
        for p, g, at_launch, now in zip(model.parameters(), outer.global_parameters.values(), moves[1], moves[2]):
            torch.testing.assert_close(g, at_launch, rtol=0, atol=1e-6)
            assert torch.equal(p, torch.lerp(g, now, mix))
        assert outer.pending == (mix > 0)
        assert outer.sync() == (mix > 0)
        assert all(torch.equal(p, g) for p, g in zip(model.parameters(), outer.global_parameters.values()))
        assert not outer.pending and not outer.sync()


def test_a_final_sync_lands_what_is_in_flight_then_sends_the_rest(world_of_one):
    model = small()
    outer = OuterLoop(model, sync_every=4, streaming=Streaming(fragments=2, sync_delay=1))
    for _ in range(4):  # fragment 1 launched at 2, landed at 3; fragment 0 launched at 4
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        outer.inner_step_done()
    assert outer.in_flight == [0] and outer.syncs == 1 and outer.pending
    assert outer.sync()
    assert outer.syncs == 3  # fragment 0 landed (mix 0: theta_r <- theta_g), then fragment 1, trained since step 3
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), outer.global_parameters.values()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # one more local step: theta_r != theta_g
    theta_r = [p.detach().clone() for p in model.parameters()]
    theta_g = list(outer.global_parameters.values())
    assert not any(torch.equal(r, g) for r, g in zip(theta_r, theta_g))
    with outer.global_weights() as own:
        assert all(torch.equal(p, g) for p, g in zip(model.parameters(), theta_g))
        assert all(torch.equal(kept, r) for kept, r in zip(own.parameters.values(), theta_r))
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), theta_r))


def test_a_state_with_other_fragments_is_refused(world_of_one):
    state = OuterLoop(small(), sync_every=2).state_dict()
    other = OuterLoop(small(), sync_every=2, streaming=Streaming(fragments=2))
    with pytest.raises(ValueError, match=r"fragments=1 in the state, fragments=2 here"):
        other.load_state_dict(state)


def test_a_final_sync_with_mix_lands_what_is_in_flight_once(world_of_one):
    """mix > 0: the end of the run lands the exchange in flight with mix 0 (theta_r <- theta_g) and
    does not send that fragment again: one outer step for it, not two at the same step."""
    model = small()
    outer = OuterLoop(model, sync_every=2, streaming=Streaming(sync_delay=1, mix=0.5))
    for _ in range(2):  # launched at step 2, due to land at 3
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        outer.inner_step_done()
    assert outer.in_flight == [0] and outer.syncs == 0
    assert outer.sync()
    assert outer.syncs == 1 and outer.fragments[0].averager.calls == 1
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), outer.global_parameters.values()))
    assert not outer.pending and not outer.sync()


def test_a_fragment_refuses_a_second_launch_while_one_is_in_flight(world_of_one):
    outer = OuterLoop(small(), sync_every=2, streaming=Streaming(sync_delay=1))
    outer.inner_step_done()
    outer.inner_step_done()  # launched at step 2
    with pytest.raises(RuntimeError, match=r"fragment 0 launched at step 2 is still in flight") as caught:
        outer.fragments[0].launch(3)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("saved", "loaded", "match"),
    [
        ({"sync_every": 2}, {"sync_every": 3}, r"sync_every=2 in the state, sync_every=3 here"),
        ({"sync_every": 4, "sync_delay": 1}, {"sync_every": 4}, r"sync_delay=1 in the state, sync_delay=0 here"),
        ({"mix": 0.5}, {"mix": 0.25}, r"mix=0.5 in the state, mix=0.25 here"),
        ({"fragments": 2}, {}, r"fragments=2 in the state, fragments=1 here"),
    ],
)
def test_a_state_with_other_outer_settings_is_refused_in_one_line(world_of_one, saved, loaded, match):
    state = built(saved).state_dict()
    with pytest.raises(ValueError, match=match) as caught:
        built(loaded).load_state_dict(state)
    assert "\n" not in str(caught.value)


def test_the_final_sync_applies_the_partial_delta_with_the_outer_lr_and_no_momentum(world_of_one):
    """After a scheduled sync has filled the outer momentum: a final sync of a pseudo-gradient of 0
    leaves theta_g (and the momentum) as they were; one of d moves theta_g by -lr d exactly."""
    for move in (0.0, 0.05):
        model = small()
        outer = OuterLoop(model, sync_every=2, outer=OuterSGD(lr=0.7, momentum=0.9, nesterov=True))
        for _ in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1)
            outer.inner_step_done()
        assert outer.syncs == 1
        optimizer = outer.fragments[0].outer_optimizer
        momenta = [optimizer.state[g]["momentum_buffer"].clone() for g in outer.fragments[0].globals]
        before = {name: g.clone() for name, g in outer.global_parameters.items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(move)
        outer.inner_step_done()  # one step of the next interval: a partial pseudo-gradient
        assert outer.sync() and outer.syncs == 2
        for name, g in outer.global_parameters.items():
            delta = before[name] - (before[name] + move)
            assert torch.equal(g, before[name].add(delta, alpha=-0.7)), name
        for g, momentum in zip(outer.fragments[0].globals, momenta):
            assert torch.equal(optimizer.state[g]["momentum_buffer"], momentum)
        assert all(torch.equal(p, g) for p, g in zip(model.parameters(), outer.global_parameters.values()))


def wide() -> torch.nn.Module:
    """Two weights of 2048 elements (compressed by chunk_topk), one per fragment when P = 2."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 64))


def test_each_fragment_runs_its_own_codec_and_builds_its_plan_once(world_of_one, monkeypatch):
    from lightning_gc.compressors import create
    from lightning_gc.compressors.chunk_topk import ChunkTopKCompressor

    builds = []
    original = ChunkTopKCompressor.build_plan

    def counted(self, *args):
        builds.append(id(self))
        return original(self, *args)

    monkeypatch.setattr(ChunkTopKCompressor, "build_plan", counted)

    def run(fragments: int, compressor: Any, **arguments: Any) -> OuterLoop:
        model = wide()
        streaming = Streaming(fragments=fragments)
        outer = OuterLoop(model, sync_every=2, compressor=compressor, streaming=streaming, **arguments)
        for step in range(6):  # 3 syncs of every fragment
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)), alpha=0.01)
            outer.inner_step_done()
        return outer

    codec = create("chunk_topk", compress_ratio=0.05)
    outer = run(2, codec)
    assert outer.syncs == 6 and len(builds) == 2  # once per fragment, not at every sync
    compressors = [f.averager.compressor for f in outer.fragments]
    assert len({id(c) for c in compressors}) == 2 and id(codec) not in {id(c) for c in compressors}  # a template
    builds.clear()
    # one fragment: the same as before, bit for bit
    by_object, by_name = run(1, codec), run(1, "chunk_topk", compress_ratio=0.05)
    assert len(builds) == 2
    pairs = zip(by_object.global_parameters.values(), by_name.global_parameters.values())
    assert all(torch.equal(a, b) for a, b in pairs)
    assert by_object.bytes_sent == by_name.bytes_sent


def test_the_residual_follows_error_feedback_with_decay_through_the_outer_loop(world_of_one):
    """One rank, top-k 10 %, beta = 0.9, outer SGD lr 1 without momentum (so y = theta_g before -
    theta_g after): at every sync e <- beta e + Delta - y, read through averager.residual()."""
    model = wide()
    beta = 0.9
    outer = OuterLoop(
        model, sync_every=1, compressor="topk", compress_ratio=0.1, error_decay=beta, outer=OuterSGD(1.0, 0.0, False)
    )
    averager = outer.fragments[0].averager
    residual = torch.zeros(averager.numel)
    for step in range(4):
        before = torch.cat([g.reshape(-1) for g in outer.global_parameters.values()])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)), alpha=0.01)
        delta = before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert outer.inner_step_done()
        y = before - torch.cat([g.reshape(-1) for g in outer.global_parameters.values()])
        residual = beta * residual + delta - y
        assert (y != 0).float().mean() < 0.2  # top-k sent a part only: the rest is in the residual
        torch.testing.assert_close(averager.residual(), residual, rtol=0, atol=1e-6)


def test_a_bfloat16_module_keeps_theta_g_and_the_outer_momentum_in_float32(world_of_one):
    """Outer steps below bfloat16's spacing (weights at 1, Delta = 2^-7 each sync, outer lr 0.1:
    at most 0.0016 a step, under half of bfloat16's 2^-8 below 1) add up in a float32 theta_g; kept
    in the parameters' dtype each rounded back to 1. The module gets theta_g rounded to bfloat16."""
    model = torch.nn.Linear(16, 16, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    outer = OuterLoop(model, sync_every=1, outer=OuterSGD(lr=0.1, momentum=0.5, nesterov=False))
    (theta_g,) = outer.global_parameters.values()
    reference = torch.ones(16, 16, requires_grad=True)  # float32 SGD on the same constant gradient
    sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.5)
    for _ in range(10):
        with torch.no_grad():
            model.weight.sub_(2**-7)  # one inner step: Delta = round(theta_g) - theta_r = 2^-7
        outer.inner_step_done()
        reference.grad = torch.full((16, 16), 2**-7)
        sgd.step()
    assert theta_g.dtype == torch.float32
    assert outer.fragments[0].outer_optimizer.state[theta_g]["momentum_buffer"].dtype == torch.float32
    torch.testing.assert_close(theta_g, reference.detach(), rtol=0, atol=1e-6)
    assert theta_g.max() < 0.99  # moved by ~0.013
    assert model.weight.dtype == torch.bfloat16 and torch.equal(model.weight, theta_g.to(torch.bfloat16))


def test_a_parameter_frozen_or_unfrozen_after_construction_is_refused_at_the_next_sync(world_of_one):
    for change in ("unfreeze", "freeze"):
        model = small()
        model[0].bias.requires_grad_(change == "freeze")
        outer = OuterLoop(model, sync_every=2)
        outer.inner_step_done()
        model[0].bias.requires_grad_(change == "unfreeze")  # e.g. a fine-tuning schedule, mid-run
        with pytest.raises(
            RuntimeError, match=r"trainable parameters changed since construction: .*'0.bias'"
        ) as caught:
            outer.inner_step_done()  # a sync step
        assert "\n" not in str(caught.value)
