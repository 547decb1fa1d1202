"""Resuming at another world size (lightning_gc.runtime.reshard): every new rank takes the saved
ranks' mean, so what the next updates owe is kept; synthetic entries for each kind of state, then
a plain-DDP run on 2 -> 3 -> 2 gloo ranks (tests/workers/reshard_worker.py) and a Trainer run
that resumes a 2-rank checkpoint on 3 (tests/workers/fit_worker.py)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import launch_ranks, layout_of
from test_two_phase import simulate

from lightning_gc.common.layout import piece_bounds
from lightning_gc.compressors import registry
from lightning_gc.exchanges.transport import LocalTransport
from lightning_gc.exchanges.two_phase import TwoPhaseExchange
from lightning_gc.runtime.checkpoint import CHECKPOINT_FORMAT, IncompatibleCheckpoint, rank_state
from lightning_gc.runtime.reshard import reshard

SHAPES = [(30, 20), (50,), (7, 9), (100,), (16, 16)]
DELAY_KINDS = ["average.0", "average.1", "own.0", "own.1", "carry.0", "carry.1"]


def entry_of(ranks: list[dict[str, Any]], compressor: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "world_size": len(ranks),
        "compressor": compressor or {"name": "dgc"},
        "ranks": ranks,
        "totals": {"steps": 7, "bytes_sent": 123.0, "dense_bytes": 456.0, "skipped_steps": 1},
    }


def synthetic(world_size: int, values: Any, seed: int = 0) -> dict[str, Any]:
    """Every kind of state a delayed, local-update DGC rank keeps; ``values(n, generator)`` draws a
    rank's own tensor, the delayed averages are the same on every rank (as decoded averages are)."""
    shared = torch.Generator().manual_seed(seed + 1000)
    averages = {kind: values(12, shared) for kind in DELAY_KINDS if kind.startswith("average")}
    ranks = []
    for rank in range(world_size):
        own = torch.Generator().manual_seed(seed + rank)
        ranks.append(
            {
                "step": 9,
                "memory": {
                    "w": {"velocity": values(12, own), "momentum": values(12, own)},
                    "b": {"velocity": values(5, own)},
                },
                "compressor": {},
                "delay": (1, True),
                "delayed": {"w": {k: averages[k].clone() if k in averages else values(12, own) for k in DELAY_KINDS}},
                "delayed_since": 3,
                "resume_settings": {"momentum_correction": True},
                "parameters": {"w": values(12, own)},
                "optimizer_states": [
                    {"state": {0: {"momentum_buffer": values(12, own)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
                ],
            }
        )
    return entry_of(ranks)


def integers(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(-50, 50, (n,), generator=generator).float()


def divisible_by_six(entry: dict[str, Any]) -> dict[str, Any]:
    """The last rank's tensors shifted so that every element's sum over ranks divides by 6: its mean
    over 2 or 3 ranks is an integer, and float32 computes every mean below exactly (the mean of
    copies, ``M a / M``, is exact anyway)."""
    for tensors in tensors_by_path(entry).values():
        if not all(torch.equal(t, tensors[0]) for t in tensors):  # what ranks hold alike stays alike
            tensors[-1] -= torch.remainder(torch.stack(tensors).sum(0), 6)
    return entry


def tensors_by_path(entry: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Every tensor of the ranks' states by its path, one per rank."""
    found: dict[str, list[torch.Tensor]] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(path, []).append(value)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    for state in entry["ranks"]:
        walk(state, "")
    return found


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two entries hold the same tensors, bit for bit."""
    left, right = tensors_by_path(a), tensors_by_path(b)
    return left.keys() == right.keys() and all(
        len(left[k]) == len(right[k]) and all(torch.equal(x, y) for x, y in zip(left[k], right[k])) for k in left
    )


def assert_mean_kept_exactly(old: dict[str, Any], new: dict[str, Any]) -> None:
    """For every tensor: the same on every new rank, and its mean over the new ranks equals the
    mean over the old ones, computed in float32 (exact on :func:`divisible_by_six` values)."""
    before, after = tensors_by_path(old), tensors_by_path(new)
    assert before.keys() == after.keys()
    for path, tensors in before.items():
        assert len(after[path]) == new["world_size"]
        assert all(torch.equal(t, after[path][0]) for t in after[path]), path
        assert torch.equal(
            torch.stack(after[path]).sum(0) / new["world_size"], torch.stack(tensors).sum(0) / len(tensors)
        )


@pytest.mark.parametrize("sizes", [(2, 3, 2), (3, 2)])
def test_every_rank_takes_the_saved_mean_so_what_is_owed_is_kept_exactly(sizes: tuple[int, ...]) -> None:
    entries = [divisible_by_six(synthetic(sizes[0], integers))]
    pristine = copy.deepcopy(entries[0])
    for size in sizes[1:]:
        with pytest.warns(UserWarning, match=rf"state of {entries[-1]['world_size']} ranks and this run has {size}"):
            entries.append(reshard(entries[-1], size, source="x.ckpt"))
        assert_mean_kept_exactly(entries[-2], entries[-1])
    assert_mean_kept_exactly(entries[0], entries[-1])  # 2 -> 3 -> 2: the same mean at the end
    assert same_bits(pristine, entries[0])  # the saved entry is left as it was
    last = entries[-1]
    old = entries[0]["ranks"][0]
    for state in last["ranks"]:  # what every rank holds alike is kept: counters, settings, averages bit for bit
        assert (state["step"], state["delay"], state["delayed_since"]) == (9, (1, True), 3)
        assert state["resume_settings"] == {"momentum_correction": True} and state["compressor"] == {}
        assert state["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]
        for kind in ("average.0", "average.1"):
            assert torch.equal(state["delayed"]["w"][kind], old["delayed"]["w"][kind])
    assert last["totals"] == entries[0]["totals"] and last["format"] == CHECKPOINT_FORMAT
    assert len({id(state) for state in last["ranks"]}) == len(last["ranks"])  # a resume pops from its own
    assert rank_state(entries[0], source="x.ckpt", rank=0, world_size=sizes[0]) is entries[0]["ranks"][0]


def test_random_values_keep_the_mean_to_one_rounding_and_a_round_trip_keeps_the_bits() -> None:
    """Means of arbitrary floats are computed in float64 and rounded once to float32: within 1e-6
    of the saved mean (relative), not always equal to it. What every new rank holds alike comes
    back bit for bit: 2 -> 3 -> 2 ends on the bits of 2 -> 3."""
    saved = synthetic(2, lambda n, generator: torch.randn(n, generator=generator))
    with pytest.warns(UserWarning):
        three = reshard(saved, 3)
        two = reshard(three, 2)
    for path, tensors in tensors_by_path(saved).items():
        mean = torch.stack([t.double() for t in tensors]).mean(0)
        for resumed in (three, two):
            for t in tensors_by_path(resumed)[path]:
                torch.testing.assert_close(t.double(), mean, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(tensors_by_path(three)[path], tensors_by_path(two)[path]))
    # a rank that never bound a tensor holds zeros for it: the mean counts it
    saved["ranks"][1]["memory"].pop("b")
    with pytest.warns(UserWarning):
        alone = reshard(saved, 3)["ranks"][2]["memory"]["b"]["velocity"]
    assert torch.equal(alone, (saved["ranks"][0]["memory"]["b"]["velocity"].double() / 2).float())


# ---------------------------------------------------------------------- two-phase server errors
ALL_2D = {"min_compress_numel": 1}


def two_phase_entry(exchange: str, world_size: int, legacy: bool = False) -> dict[str, Any]:
    """A checkpoint of ``world_size`` signsgd ranks with server errors (and whole residuals); with
    ``legacy``, written as before the errors moved from the compressor's state to the exchange's."""
    config = {"name": "signsgd", "exchange": exchange, "server_feedback": True, **ALL_2D}
    compressors = [ranked(config, world_size, r) for r in range(world_size)]
    simulate(compressors, [torch.randn(layout_of(SHAPES).numel) for _ in range(world_size)], layout_of(SHAPES), step=0)
    generator = torch.Generator().manual_seed(3)
    memory = {
        f"p{i}": {"velocity": torch.randn(torch.Size(s).numel(), generator=generator)} for i, s in enumerate(SHAPES)
    }
    ranks = [
        {
            "step": 1,
            "memory": {k: {"velocity": v["velocity"] * (r + 1)} for k, v in memory.items()},
            **({"compressor": c.state_dict()} if legacy else {"compressor": {}, "exchange": c.state_dict()}),
        }
        for r, c in enumerate(compressors)
    ]
    return entry_of(ranks, config)


def ranked(config: dict[str, Any], world_size: int, rank: int) -> TwoPhaseExchange:
    """Rank ``rank``'s two-phase exchange of the compressor ``config`` (rounds run by hand)."""
    return TwoPhaseExchange(LocalTransport(world_size, rank), registry.create(**config))


def server_state(state: dict[str, Any]) -> dict[str, Any]:
    """A rank's server error state: the exchange's, or the compressor's in the form before it moved."""
    return state["exchange"] if "exchange" in state else state.get("compressor", {})


def whole_server_errors(entry: dict[str, Any], numels: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Each tensor's server error (of ``numels`` elements; default: SHAPES') put together from its
    owners' pieces, checking that each rank holds exactly its piece."""
    numels = numels or {f"p{i}": torch.Size(shape).numel() for i, shape in enumerate(SHAPES)}
    size, wholes = entry["world_size"], {}
    for name, numel in numels.items():
        parts = []
        for rank, state in enumerate(entry["ranks"]):
            piece = server_state(state).get("server", {}).get(name)
            low, high = piece_bounds(numel, rank, size)
            assert (piece is None) == (low == high)
            parts.append(torch.zeros(0) if piece is None else piece["server"])
        wholes[name] = torch.cat(parts)
    return wholes


@pytest.mark.parametrize("legacy", [False, True])
def test_two_phase_server_errors_are_cut_again_for_the_new_chunks_bit_for_bit(legacy: bool) -> None:
    saved = two_phase_entry("two_phase", 2, legacy)
    errors = whole_server_errors(saved)
    assert any(e.abs().sum() > 0 for e in errors.values())
    entry = saved
    for size in (3, 2):
        with pytest.warns(UserWarning):
            entry = reshard(entry, size)
        wholes = whole_server_errors(entry)
        assert all(torch.equal(wholes[name], errors[name]) for name in errors)
        resumed = [ranked(saved["compressor"], size, r) for r in range(size)]
        for compressor, state in zip(resumed, entry["ranks"]):
            assert state["exchange"]["world_size"] == size and state["compressor"] == {}  # converted, if legacy
            compressor.load_state_dict(state["exchange"])  # the pieces fit this world's chunks: it runs
        simulate(resumed, [torch.randn(layout_of(SHAPES).numel) for _ in range(size)], layout_of(SHAPES), step=1)


def test_server_errors_join_every_residual_where_the_new_world_runs_no_two_phase_form() -> None:
    """``exchange="auto"`` gathers on 2 ranks: the server error, owed to the mean, is added to
    every rank's velocity, so ``mean(v) + e`` is kept (to one float32 rounding)."""
    saved = two_phase_entry("auto", 3)
    errors = whole_server_errors(saved)
    with pytest.warns(UserWarning) as notes:
        resumed = reshard(saved, 2)
    folded = r"'signsgd' with exchange='auto' runs no two-phase exchange on 2 ranks: the server errors of p0, p1, p2"
    assert any(re.search(folded, str(note.message)) for note in notes)
    for name, error in errors.items():
        owed = torch.stack([s["memory"][name]["velocity"].double() for s in saved["ranks"]]).mean(0) + error.double()
        for state in resumed["ranks"]:
            assert state["compressor"] == {} and "exchange" not in state
            assert torch.equal(state["memory"][name]["velocity"], owed.float())
            torch.testing.assert_close(state["memory"][name]["velocity"].double(), owed, rtol=1e-6, atol=1e-7)
    registry.create(**saved["compressor"]).load_state_dict(resumed["ranks"][0]["compressor"])


def test_powersgd_keeps_the_factors_every_rank_shares_and_restarts_the_others_with_a_notice() -> None:
    shared, other = torch.randn(6, 2), torch.randn(4, 1)
    ranks = [{"step": 2, "memory": {}, "compressor": {"q": {"a": shared.clone(), "b": other + r}}} for r in range(2)]
    with pytest.warns(UserWarning) as notes:
        resumed = reshard(entry_of(ranks, {"name": "powersgd", "rank": 1}), 3)
    restarted = r"'powersgd': the warm-start factors Q of b differ across the 2 saved ranks and restart"
    assert any(re.search(restarted, str(note.message)) for note in notes)
    assert len(notes) == 2 and all("\n" not in str(note.message) for note in notes)  # one line each
    for state in resumed["ranks"]:
        assert state["compressor"]["q"].keys() == {"a"} and torch.equal(state["compressor"]["q"]["a"], shared)
    registry.create("powersgd").load_state_dict(resumed["ranks"][1]["compressor"])


def test_what_cannot_be_resharded_is_refused_in_one_line_naming_it() -> None:
    node = [{"step": 1, "memory": {}, "compressor": {}, "hierarchy": (2, 2)} for _ in range(4)]
    whole = [
        {"step": 1, "memory": {}, "compressor": {"exchange": "two_phase", "server": {"p": {"server": torch.ones(4)}}}}
        for _ in range(2)
    ]
    unknown = [{"step": 1, "memory": {}, "compressor": {"codebook": torch.full((3,), float(r))}} for r in range(2)]
    cases = [
        (
            entry_of(node),
            r"x.ckpt holds the compression state of 4 ranks under hierarchy='node'.*resume with 4 processes",
        ),
        (entry_of(whole, {"name": "onebit"}), r"'onebit' holds its server error feedback as whole tensors"),
        (entry_of(unknown, {"name": "toy"}), r"'toy' keeps state \['codebook'\] that differs across the 2 saved ranks"),
    ]
    for entry, message in cases:
        with pytest.raises(IncompatibleCheckpoint, match=message) as refused:
            rank_state(entry, source="x.ckpt", rank=0, world_size=3)
        assert "\n" not in str(refused.value)
    same = [{"step": 1, "memory": {}, "compressor": {"codebook": torch.ones(3)}} for _ in range(2)]
    with pytest.warns(UserWarning):
        assert torch.equal(
            rank_state(entry_of(same), source="x", rank=2, world_size=3)["compressor"]["codebook"], torch.ones(3)
        )
    with pytest.raises(IncompatibleCheckpoint, match="format 99"):
        rank_state({**entry_of(same), "format": 99}, source="x.ckpt", rank=0, world_size=3)


# ---------------------------------------------------------------------- real runs
RUNS = [
    {"name": "dgc", "compressor": "dgc", "kwargs": {"compress_ratio": 0.05}},
    {
        "name": "dgc_delayed",
        "compressor": "dgc",
        "kwargs": {"compress_ratio": 0.05, "delay": 1, "local_update": True, "sync_warmup_steps": 0},
    },
    {"name": "onebit", "compressor": "onebit", "kwargs": {"exchange": "two_phase", "server_feedback": True}},
    {"name": "powersgd", "compressor": "powersgd", "kwargs": {"rank": 2}},
]


def test_plain_ddp_trains_on_2_then_3_then_2_ranks_keeping_the_mean_residual(tmp_path: Path) -> None:
    """``attach``: 2 ranks train and save, 3 ranks load and train on, 2 ranks again. Each rank's
    loaded state is the saved ranks' mean (residuals, momenta, own delayed terms), the server
    errors are re-cut, PowerSGD's shared Q kept, and the held-out loss keeps falling."""
    plan = {"runs": RUNS, "steps": 8}
    launches = []
    for i, size in enumerate((2, 3, 2)):
        step = {
            **plan,
            "seed": 100 * i,
            "save": str(tmp_path / f"ckpt{i}"),
            "load": str(tmp_path / f"ckpt{i - 1}") if i else None,
        }
        launches.append(launch_ranks("reshard_worker.py", step, tmp_path / f"out{i}", world_size=size))
    for i, ranks in enumerate(launches):
        for spec in RUNS:
            name = spec["name"]
            for rank in ranks:
                assert rank[name]["loss_after"] < rank[name]["loss_before"], (i, name)
            if not i:
                continue
            if name != "dgc_delayed":  # the saved weights (local updates resume each rank's mean weights)
                assert launches[i][0][name]["loss_before"] == launches[i - 1][0][name]["loss_after"]
            saved = torch.load(tmp_path / f"ckpt{i - 1}" / f"{name}.pt", weights_only=False)["gc"]
            loaded = [rank[name]["loaded"] for rank in ranks]
            assert all(state["step"] == saved["ranks"][0]["step"] == 8 * i for state in loaded)
            differ = 0
            for tensor, kinds in saved["ranks"][0]["memory"].items():
                for kind in kinds:
                    old = [s["memory"][tensor][kind] for s in saved["ranks"]]
                    new = [s["memory"][tensor][kind] for s in loaded]
                    differ += not all(torch.equal(t, old[0]) for t in old)
                    mean = torch.stack(old).double().mean(0).to(old[0].dtype)  # rounded once, as the rule does
                    assert all(torch.equal(t, mean) for t in new)  # every rank holds the saved mean ...
                    assert torch.equal(torch.stack(new).double().mean(0), mean.double())  # ... so the mean is kept
            assert differ > 0  # residuals are per rank: a mean, not a copy
            if name == "dgc_delayed":
                for tensor, kinds in saved["ranks"][0]["delayed"].items():
                    for kind in kinds:
                        mean = torch.stack([s["delayed"][tensor][kind].double() for s in saved["ranks"]]).mean(0)
                        assert all(torch.equal(s["delayed"][tensor][kind], mean.float()) for s in loaded)
            if name == "onebit":
                assert any(state["exchange"]["server"] for state in saved["ranks"])
                as_loaded = entry_of([{"exchange": s["exchange"]} for s in loaded])
                numels = {k: v["velocity"].numel() for k, v in saved["ranks"][0]["memory"].items()}
                wholes = whole_server_errors(saved, numels)
                assert any(error.abs().sum() > 0 for error in wholes.values())
                resumed_wholes = whole_server_errors(as_loaded, numels)
                assert all(torch.equal(resumed_wholes[k], error) for k, error in wholes.items())  # re-cut, bit for bit
            if name == "powersgd":
                assert all(
                    torch.equal(s["compressor"]["q"][k], q)
                    for s in loaded
                    for k, q in saved["ranks"][0]["compressor"]["q"].items()
                )
    final = [launches[-1][0][spec["name"]]["loss_after"] for spec in RUNS]
    first = [launches[0][0][spec["name"]]["loss_before"] for spec in RUNS]
    assert all(f < 0.9 * b for f, b in zip(final, first)), (first, final)


def test_the_trainer_resumes_a_2_rank_checkpoint_on_3_ranks_and_the_loss_keeps_falling(tmp_path: Path) -> None:
    """DGCStrategy: one epoch on 2 ranks, then two more from its checkpoint on 3: the step counter
    goes on from the checkpoint's and each epoch's mean training loss is below the one before."""
    fit = {"strategy": {"kind": "dgc", "compress_ratio": 0.01}, "model": {"hidden": [64], "lr": 0.05}}
    checkpoints = tmp_path / "ckpts"
    ((two,), _) = launch_ranks(
        "fit_worker.py", {"fits": [{**fit, "epochs": 1, "checkpoint_dir": str(checkpoints)}]}, tmp_path / "two"
    )
    three = launch_ranks(
        "fit_worker.py",
        {"fits": [{**fit, "epochs": 3, "resume_from": str(checkpoints / "epoch=0.ckpt")}]},
        tmp_path / "three",
        world_size=3,
    )
    assert torch.load(checkpoints / "epoch=0.ckpt", weights_only=False)["lightning_gc"]["world_size"] == 2
    for (resumed,) in three:
        losses = [m["train/loss_epoch"] for m in two["epoch_metrics"] + resumed["epoch_metrics"]]
        assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
        assert resumed["hook_step"] == resumed["global_step"] > two["hook_step"] > 0  # the step counter went on
