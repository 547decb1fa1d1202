"""OuterLoop: the DiLoCo-family outer loop over a process group (lightning_gc.runtime.outer).

The 2-rank cases run in one launch of ``workers/outer_worker.py`` (shared by the tests below);
the argument checks and the sync cadence run in this process over a real group of one rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import launch_ranks

from lightning_gc.runtime.outer import OuterLoop

CASES = ["equivalence", "diloco", "compressed", "resume", "mismatch"]


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


# ---------------------------------------------------------------- one process
def small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


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
    ],
)
def test_bad_settings_are_refused_in_one_line(world_of_one, arguments, match):
    with pytest.raises(ValueError, match=match):
        OuterLoop(small(), **{"sync_every": 2, **arguments})


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
    outer = OuterLoop(model, sync_every=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
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
