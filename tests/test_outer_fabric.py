"""The outer loop under Lightning Fabric (lightning_gc.integrations.outer_fabric): registration and
argument errors in this process; on 2 gloo ranks (``workers/outer_fabric_worker.py``), streaming
with gradient accumulation, evaluation on theta_g, and fabric.save / fabric.load resuming bit for
bit with an exchange in flight, loaded before and after ``fabric.setup``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import launch_ranks
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_gc
from lightning_gc.integrations.outer_attach import OUTER_PRESETS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch_ranks("outer_fabric_worker.py", {}, tmp_path_factory.mktemp("outer_fabric"), world_size=2)


def equal(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    return list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_inner_steps_send_nothing_and_theta_g_is_evaluated_and_saved(ranks):
    mine, theirs = ranks[0]["straight"], ranks[1]["straight"]
    assert not equal(mine["local_after_step"][1], theirs["local_after_step"][1])  # no gradient averaging
    assert mine["in_flight_at_save"] == [1]  # fragment 1, launched at step 6
    assert equal(mine["global_at_save"], theirs["global_at_save"])
    assert mine["evaluated_global"] and mine["restored_local"]
    assert mine["finished"] and mine["inner_steps"] == 10
    assert equal(mine["params"], mine["global"]) and equal(mine["params"], theirs["params"])
    # fragment 1 lands at 3, 7, 11 (at the end, without mix); fragment 0 at 5, 9; the end sends fragment 0 (mixed at 9)
    assert mine["syncs"] == 6


def test_checkpoint_holds_theta_g_and_every_ranks_state(ranks, tmp_path_factory):
    path = next(p for p in tmp_path_factory.getbasetemp().rglob("step6.ckpt"))
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["step"] == 6
    assert equal(
        {k: checkpoint["model"][k] for k in ranks[0]["straight"]["global_at_save"]},
        ranks[0]["straight"]["global_at_save"],
    )
    entry = checkpoint["lightning_gc_outer"]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    for rank, own in zip(ranks, entry["ranks"]):
        assert equal(own["local"], rank["straight"]["local_after_step"][6])
        assert [f["in_flight"] is not None for f in own["outer"]["fragments"]] == [False, True]
    first, second = (own["optimizers"][0]["state"][0]["exp_avg"] for own in entry["ranks"])
    assert not torch.equal(first, second)  # each rank's inner AdamW, not rank 0's twice


@pytest.mark.parametrize("resume", ["before_setup", "after_setup"])
def test_resume_between_syncs_with_an_exchange_in_flight_is_bit_for_bit(ranks, resume: str):
    for rank in ranks:
        straight, resumed = rank["straight"], rank[resume]
        assert resumed["loaded_step"] == 6 and resumed["inner_steps"] == 10
        assert (resumed["syncs"], resumed["bytes"]) == (straight["syncs"], straight["bytes"])
        for step in (7, 8, 9, 10):
            assert equal(resumed["local_after_step"][step], straight["local_after_step"][step]), step
        assert equal(resumed["params"], straight["params"]) and equal(resumed["global"], straight["global"])


# ---------------------------------------------------------------------- construction, in this process
def test_presets_are_registered_with_fabric_and_take_the_outer_loop_names():
    for name in OUTER_PRESETS:
        strategy = STRATEGY_REGISTRY.get(name)
        assert isinstance(strategy, lightning_gc.FabricOuterLoopStrategy) and strategy.outer_arguments.preset == name
    strategy = lightning_gc.FabricOuterLoopStrategy(
        "sparseloco", sync_every=30, fragments=3, sync_delay=9, mix=0.5, compress_ratio=0.05, timeout=60
    )
    arguments = strategy.outer_arguments
    assert (arguments.sync_every, arguments.fragments, arguments.sync_delay, arguments.mix) == (30, 3, 9, 0.5)
    assert arguments.compressor.compress_ratio == 0.05
    with pytest.raises(RuntimeError, match=r"exists once fabric.setup\(model, optimizer\) has run"):
        _ = strategy.outer


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"sync_every": 6, "fragments": 3, "sync_delay": 2},
            r"`sync_delay` must be below sync_every / fragments = 6/3 = 2, got 2",
        ),
        ({"mix": 1.0}, r"`mix` must be in \[0, 1\), got 1.0"),
        ({"fragments": 0}, r"`fragments` must be an integer >= 1, got 0"),
        ({"delay": 1}, r"\{'delay': 1\} for FabricOuterLoopStrategy \(`delay` is a per-step"),
        ({"fragmnets": 2}, r"did you mean `fragments`\?"),
        ({"ddp_comm_hook": None}, r"installs its own DDP comm hook"),
    ],
)
def test_a_bad_argument_fails_at_construction_in_one_line(arguments: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message) as caught:
        lightning_gc.FabricOuterLoopStrategy(**arguments)
    assert "\n" not in str(caught.value)


def test_a_checkpoint_without_outer_state_loads_only_before_setup(world_of_one, tmp_path, caplog):
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    plain = tmp_path / "plain.ckpt"  # what a run without the outer loop (or a user's torch.save) leaves
    weights = {k: v + 1.0 for k, v in net.state_dict().items()}
    torch.save({"model": weights, "optimizer": optimizer.state_dict()}, plain)

    fabric = Fabric(accelerator="cpu", devices=1, strategy=lightning_gc.FabricOuterLoopStrategy("diloco", sync_every=2))
    fabric.launch()
    with caplog.at_level("INFO"):
        fabric.load(plain, {"model": net, "optimizer": optimizer})  # before set-up: the outer loop starts there
    assert "holds no outer-loop state; the outer loop starts afresh" in caplog.text
    model, optimizer = fabric.setup(net, optimizer)
    outer = fabric.strategy.outer
    assert all(torch.equal(outer.global_parameters[k], weights[k]) for k in outer.global_parameters)
    assert not fabric.strategy.finish()  # nothing to sync yet
    fabric.backward(model(torch.randn(4, 8)).square().mean())
    optimizer.step()
    with pytest.raises(ValueError, match="holds no outer-loop state, and this run's outer loop is built"):
        fabric.load(plain, {"model": model, "optimizer": optimizer})
    assert fabric.strategy.finish() and outer.syncs == 1
    assert all(torch.equal(p, outer.global_parameters[k]) for k, p in net.named_parameters())

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class CountedReads(TorchCheckpointIO):
        reads = 0

        def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            CountedReads.reads += 1
            return super().load_checkpoint(*args, **kwargs)

    fabric.save(tmp_path / "outer.ckpt", {"model": model, "optimizer": optimizer})
    real_io, fabric.strategy.checkpoint_io = fabric.strategy.checkpoint_io, CountedReads()
    fabric.load(tmp_path / "outer.ckpt", {"model": model, "optimizer": optimizer})  # after set-up: checked, then loaded
    assert CountedReads.reads == 1  # the file is read once
    with pytest.raises(ValueError, match="holds no outer-loop state"):
        fabric.load(plain, {"model": model, "optimizer": optimizer})
    assert CountedReads.reads == 2 and isinstance(fabric.strategy.checkpoint_io, CountedReads)
    fabric.strategy.checkpoint_io = real_io
