"""The outer loop's front ends (lightning_gc.integrations.outer, outer_attach): the Trainer strategy
on 2 CPU ranks, its presets and argument checks, and the plain-PyTorch ``outer_loop``.

The 2-rank Trainer runs happen in one launch of ``workers/outer_fit_worker.py`` (fits in order:
plain DDP, DiLoCo with H = 1, H = 4 with checkpoints, its resume, accumulation with bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, launch_ranks

from lightning_gc.integrations.outer_attach import (
    OUTER_PRESETS,
    gather_outer_entry,
    outer_loop,
    outer_rank_state,
    resume_outer,
)

AS_DDP = {"kind": "outer", "preset": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
DILOCO_H4 = {"kind": "outer", "preset": "diloco", "sync_every": 4}
STREAMED = {"kind": "outer", "preset": "diloco", "sync_every": 5, "fragments": 2, "sync_delay": 1, "mix": 0.5}
"""Fragment 0 launches at steps 5 and 10, fragment 1 at 2 and 7; each lands a step later."""
DIGITS_NUMEL = 64 * 32 + 32 + 32 * 10 + 10  # the workers' MLP: 2410 parameters


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("outer_fit")
    # 2 epochs of 5 steps (718 samples a rank, batches of 128). The runs that resume end by max_epochs: Lightning 2.6
    # resumes an epoch-end checkpoint of a run with max_steps set with the data of the wrong epoch (plain DDP too)
    whole = {"max_epochs": 2, "data": {"batch_size": 128}}
    h4 = {"strategy": DILOCO_H4, **whole, "limit_val_batches": 1}  # validated after steps 5 and 10
    streamed = {**h4, "strategy": STREAMED, "fp16_scaler": True}  # with a GradScaler of its own on each rank
    fits = [
        {"name": "ddp", "strategy": {"kind": "ddp"}, **whole},
        {"name": "h1", "strategy": {**AS_DDP, "sync_every": 1}, **whole},
        {"name": "h4", **h4, "checkpoint_dir": str(out / "h4")},  # written during validation, theta_g swapped in
        {"name": "h4_resumed", **h4, "resume_from": str(out / "h4" / "epoch=0.ckpt")},
        # checkpoint after step 5, fragment 0's exchange in flight
        {"name": "streamed", **streamed, "checkpoint_dir": str(out / "streamed")},
        {"name": "streamed_resumed", **streamed, "resume_from": str(out / "streamed" / "epoch=0.ckpt")},
        {
            "name": "accumulated_bf16",
            "strategy": {**DILOCO_H4, "sync_every": 2},
            "max_steps": 5,  # not a multiple of 2
            "limit_train_batches": 6,  # 3 steps an epoch: validation between syncs
            "limit_val_batches": 1,
            "trainer": {"accumulate_grad_batches": 2, "precision": "bf16-mixed"},
        },
    ]
    ranks = launch_ranks("outer_fit_worker.py", {"fits": fits}, out, world_size=2)
    return [{**rank, "out": out} for rank in ranks]


def assert_equal(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert list(mine) == list(theirs), what
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), f"{what}: {name} differs"


def test_one_step_exact_average_with_outer_sgd_lr_1_is_ddp(runs):
    for rank in runs:
        assert rank["h1"]["syncs"] == 10 and rank["h1"]["global_step"] == 10
        for name, value in rank["h1"]["params"].items():
            torch.testing.assert_close(value, rank["ddp"]["params"][name], rtol=0, atol=1e-5)


def test_a_fit_of_steps_not_a_multiple_of_h_ends_with_a_final_sync(runs):
    """2 epochs of 5 steps with H = 4: syncs after steps 4 and 8, and a final one after step 10."""
    for rank in runs:
        run = rank["h4"]
        assert run["global_step"] == run["inner_steps"] == 10
        assert run["syncs"] == 3  # after steps 4 and 8, and the final one at 10
        assert_equal(run["params"], run["global"], "module after fit vs theta_g")
        assert run["totals"]["bytes_sent"] == 3 * 4 * DIGITS_NUMEL  # "none": the pseudo-gradient as float32
        assert run["totals"]["dense_bytes"] == 10 * 4 * DIGITS_NUMEL
        assert run["logged"] == {"outer/syncs": 2.0, "outer/bytes_sent": 2 * 4 * DIGITS_NUMEL}  # at step 10, before
    assert_equal(runs[0]["h4"]["params"], runs[1]["h4"]["params"], "rank 0 vs rank 1")


def test_validation_runs_on_theta_g_and_training_resumes_from_theta_r(runs):
    for rank in runs:
        for name, validations in (("h4", 2), ("accumulated_bf16", 1)):  # (that one stops mid-epoch)
            run = rank[name]
            assert run["validated_on_global"] == [True] * validations, name
            assert run["differed_before_validation"] == [True] * validations, name  # theta_r was not theta_g
            assert run["resumed_local"] == [True], name  # the next step started from theta_r again


def test_checkpoint_holds_theta_g_and_every_ranks_state(runs):
    checkpoint = torch.load(runs[0]["out"] / "h4" / "epoch=0.ckpt", weights_only=True)  # at validation after step 5
    theta_g = runs[0]["h4"]["at_validation"][0][0]  # of the sync after step 4
    assert_equal(theta_g, runs[1]["h4"]["at_validation"][0][0], "theta_g on the two ranks")
    assert_equal({name: checkpoint["state_dict"][name] for name in theta_g}, theta_g, "checkpoint weights")
    entry = checkpoint["lightning_gc_outer"]
    assert entry["world_size"] == 2 and entry["preset"] == "diloco" and len(entry["ranks"]) == 2
    mine, theirs = entry["ranks"]
    for rank, state in zip(runs, (mine, theirs)):
        assert state["outer"]["inner_steps"] == 5 and sum(f["syncs"] for f in state["outer"]["fragments"]) == 1
        assert_equal(state["local"], rank["h4"]["at_validation"][0][1], "the rank's own theta_r, mid-H")
        assert len(state["optimizers"]) == 1
    assert not torch.equal(mine["local"]["net.0.weight"], theirs["local"]["net.0.weight"])
    buffers = [s["optimizers"][0]["state"][0]["momentum_buffer"] for s in (mine, theirs)]
    assert not torch.equal(*buffers)  # each rank's inner momentum, not rank 0's twice


def test_resume_between_syncs_continues_bit_for_bit(runs):
    for rank in runs:
        resumed, whole = rank["h4_resumed"], rank["h4"]
        assert resumed["global_step"] == 10 and resumed["syncs"] == 3 and resumed["inner_steps"] == 10
        assert_equal(resumed["params"], whole["params"], "resumed vs uninterrupted")
        assert resumed["totals"] == whole["totals"]


def test_gradient_accumulation_and_bf16_mixed_precision(runs):
    for rank in runs:
        run = rank["accumulated_bf16"]
        assert run["global_step"] == run["inner_steps"] == 5 and run["syncs"] == 3  # 2, 4, final at 5
        assert_equal(run["params"], run["global"], "module after fit vs theta_g")
    assert_equal(runs[0]["accumulated_bf16"]["params"], runs[1]["accumulated_bf16"]["params"], "ranks")


def test_streamed_fit_resumes_with_an_exchange_in_flight_bit_for_bit(runs, tmp_path):
    checkpoint = torch.load(runs[0]["out"] / "streamed" / "epoch=0.ckpt", weights_only=True)
    for rank, state in zip(runs, checkpoint["lightning_gc_outer"]["ranks"]):
        fragments = state["outer"]["fragments"]
        assert [f["in_flight"] is not None for f in fragments] == [True, False]  # fragment 0, launched at step 5
        assert fragments[0]["in_flight"]["launched_at"] == 5
        resumed, whole = rank["streamed_resumed"], rank["streamed"]
        # landed at 3, 6, 8; the end lands fragment 0 (launched at 10) without mix, then sends fragment 1 (mixed at 8)
        assert whole["syncs"] == resumed["syncs"] == 5 and resumed["inner_steps"] == 10
        assert_equal(resumed["params"], whole["params"], "resumed vs uninterrupted")
        assert_equal(whole["params"], whole["global"], "module after fit vs theta_g")
        assert resumed["totals"] == whole["totals"]
        assert resumed["precision"] == whole["precision"]  # this rank's GradScaler state, not rank 0's
    assert_equal(runs[0]["streamed"]["params"], runs[1]["streamed"]["params"], "rank 0 vs rank 1")
    scales = [state["precision"]["scale"] for state in checkpoint["lightning_gc_outer"]["ranks"]]
    assert scales[1] == 2 * scales[0]  # every rank's scaler in the checkpoint (initial scales 2^9, 2^10)


# ---------------------------------------------------------------------- construction, in this process
def test_presets_register_and_construct_with_their_documented_settings():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_gc.integrations.outer import OuterLoopStrategy, register_outer_strategies

    register_outer_strategies(StrategyRegistry)  # again, as a re-import does: harmless
    built = {name: StrategyRegistry.get(name) for name in ("diloco", "diloco_int8", "sparseloco")}
    assert all(type(s) is OuterLoopStrategy for s in built.values())
    settings = {
        name: (a.compressor.name, a.error_decay, a.outer_lr, a.outer_momentum, a.outer_nesterov)
        for name, a in ((name, s.outer_arguments) for name, s in built.items())
    }
    assert settings == {
        "diloco": ("none", 1.0, 0.7, 0.9, True),
        "diloco_int8": ("int8", 1.0, 0.7, 0.9, True),
        "sparseloco": ("chunk_topk", 0.95, 1.0, 0.0, False),
    }
    assert built["diloco_int8"].compressor.levels == 127 and built["diloco_int8"].compressor.code_bits == 8
    assert built["sparseloco"].compressor.compress_ratio == 0.02
    overridden = OuterLoopStrategy("sparseloco", compress_ratio=0.1, sync_every=3, timeout=60)
    assert overridden.compressor.compress_ratio == 0.1 and overridden.outer_arguments.sync_every == 3
    other_codec = OuterLoopStrategy("sparseloco", compressor="qsgd", error_decay=1.0)  # top-k's ratio does not follow
    assert other_codec.compressor.name == "qsgd" and not hasattr(other_codec.compressor, "compress_ratio")
    with pytest.raises(ValueError, match=r"`error_decay=0.95` needs error feedback.*'qsgd'") as caught:
        OuterLoopStrategy("sparseloco", compressor="qsgd")  # the preset's decay would be ignored: refused
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"sync_every": 0}, r"`sync_every` must be an integer >= 1, got 0"),
        ({"outer_lr": -1}, r"`outer_lr` must be in \(0, inf\], got -1"),
        ({"preset": "dilocco"}, r"`preset='dilocco'` is not one of \['diloco', 'diloco_int8', 'sparseloco'\]"),
        ({"compressor": "topkk"}, r"`compressor='topkk'` is not one of \[.*\] \(did you mean 'topk'\?\)"),
        ({"sync_evry": 4}, r"unknown argument\(s\) \{'sync_evry': 4\} .*did you mean `sync_every`\?"),
        ({"delay": 1}, r"\{'delay': 1\} for OuterLoopStrategy \(`delay` is a per-step"),
        ({"hierarchy": "node"}, r"\{'hierarchy': 'node'\} for OuterLoopStrategy \(`hierarchy` is a per-step"),
        ({"ddp_comm_hook": None}, r"installs its own DDP comm hook"),
        ({"outer_momentum": 0.0}, r"`outer_nesterov=True` needs `outer_momentum` > 0"),
        ({"fragments": 0}, r"`fragments` must be an integer >= 1, got 0"),
        ({"sync_every": 8, "fragments": 4, "sync_delay": 2}, r"`sync_delay` must be below .* = 8/4 = 2, got 2"),
        ({"sync_delay": 1.5}, r"`sync_delay` must be an integer >= 0, got 1.5"),
        ({"mix": 1}, r"`mix` must be in \[0, 1\), got 1"),
        ({"local_update": True}, r"\{'local_update': True\} for OuterLoopStrategy \(`local_update` is a per-step"),
    ],
)
def test_a_bad_argument_fails_at_construction_in_one_line(arguments: dict[str, Any], message: str):
    from lightning_gc.integrations.outer import OuterLoopStrategy

    with pytest.raises(ValueError, match=message) as caught:
        OuterLoopStrategy(**arguments)
    assert "\n" not in str(caught.value)


def two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


BYTES_PER_SYNC = {
    "diloco": 2410 * 4,  # every element as float32
    "diloco_int8": (2048 + 4 * 4) + (32 + 320 + 10) * 4,  # 64x32 weight: 8-bit codes + a scale per 512; rest float32
    # top 2 % of the 2048 weights (one 32x64 chunk): 2 levels (4 bytes), 41 2-bit codes (12), 41 12-bit indices (64)
    "sparseloco": (4 + 12 + 64) + (32 + 320 + 10) * 4,
}
"""Payload bytes per sync of the 2-layer model (64 -> 32 -> 10): only tensors of >= 1024 elements
(here the first weight) are compressed; biases and the 320-element weight travel dense."""


@pytest.mark.parametrize("preset", sorted(OUTER_PRESETS))
def test_bytes_sent_per_sync_of_each_preset(world_of_one, preset: str):
    model = two_layers()
    outer = outer_loop(model, preset, sync_every=1)
    for sync in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        assert outer.inner_step_done()
        assert outer.bytes_sent == sync * BYTES_PER_SYNC[preset]


def test_plain_front_end_trains_and_syncs_every_h_steps(world_of_one):
    model = two_layers()
    outer = outer_loop(model, preset="diloco", sync_every=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 64), torch.randint(10, (16,))
    for step in range(5):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        assert outer.inner_step_done() == (step % 2 == 1)
    assert outer.syncs == 2 and outer.inner_steps == 5
    assert outer.finish()  # the one step left
    assert outer.syncs == 3 and not outer.finish()  # nothing left: no second sync
    for name, p in model.named_parameters():
        assert torch.equal(p, outer.global_parameters[name])
    with pytest.raises(ValueError, match=r"`error_decay` must be in \(0, 1\], got 0"):
        outer_loop(model, "sparseloco", error_decay=0)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \{'bucket_cap_mb': 25\} for outer_loop"):
        outer_loop(model, bucket_cap_mb=25)


def test_plain_front_end_checkpoint_resumes_between_syncs(world_of_one):
    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, outer: Any, steps: range) -> None:
        for step in steps:
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
            optimizer.step()
            outer.inner_step_done()

    model = two_layers()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outer = outer_loop(model, "sparseloco", sync_every=3)
    train(model, optimizer, outer, range(4))  # one sync, one step since
    entry = gather_outer_entry(outer, optimizer_states=[optimizer.state_dict()])
    weights = {name: t.clone() for name, t in outer.global_parameters.items()}  # what a checkpoint keeps
    train(model, optimizer, outer, range(4, 9))

    again = two_layers()
    again.load_state_dict(weights, strict=False)
    resumed = outer_loop(again, "sparseloco", sync_every=3)
    own = outer_rank_state(entry, source="memory", rank=0, world_size=1)
    resume_outer(resumed, own)
    optimizer_again = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    optimizer_again.load_state_dict(own["optimizers"][0])
    train(again, optimizer_again, resumed, range(4, 9))
    assert resumed.syncs == outer.syncs == 3 and resumed.bytes_sent == outer.bytes_sent
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(again.named_parameters())[name]), name
    with pytest.raises(ValueError, match=r"outer-loop state of 1 ranks but this run has world_size=2"):
        outer_rank_state(entry, source="memory", rank=0, world_size=2)


def test_the_plain_front_end_imports_no_lightning(tmp_path: Path):
    script = (
        "import sys\nfrom lightning_gc.integrations.outer_attach import outer_loop\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'lightning_fabric') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("preset", sorted(OUTER_PRESETS))
def test_hydra_configs_list_the_streaming_settings_with_their_defaults(preset: str):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_gc.integrations.outer_attach import STREAMING_DEFAULTS

    config = OmegaConf.load(REPO / "configs" / "strategy" / f"{preset}.yaml")
    assert {name: config[name] for name in STREAMING_DEFAULTS} == STREAMING_DEFAULTS
    config.merge_with({"fragments": 2, "sync_delay": 1, "mix": 0.25})
    built = instantiate(config).outer_arguments
    assert (built.preset, built.fragments, built.sync_delay, built.mix) == (preset, 2, 1, 0.25)


def test_a_module_with_fewer_tensors_than_fragments_is_refused_when_built(world_of_one):
    with pytest.raises(ValueError, match=r"`fragments=5` must be at most the module's 4 trainable parameter tensors"):
        outer_loop(two_layers(), "diloco", sync_every=10, fragments=5)
    outer = outer_loop(two_layers(), "diloco", sync_every=10, fragments=4, sync_delay=2, mix=0.5)
    assert [f.offset for f in outer.fragments] == [0, 2, 5, 7] and outer.streaming.mix == 0.5


def test_resume_outer_refuses_other_names_and_names_the_difference(world_of_one):
    def normed(track: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32, track_running_stats=track))

    entry = gather_outer_entry(outer_loop(normed(True), "diloco", sync_every=2))
    own = outer_rank_state(entry, source="memory", rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"buffers.*missing here \['1.running_mean', '1.running_var'\]") as caught:
        resume_outer(outer_loop(normed(False), "diloco", sync_every=2), own)
    assert "\n" not in str(caught.value)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 2))
    with pytest.raises(
        ValueError, match=r"parameters .*missing here \[\], not in the checkpoint \['2.bias', '2.weight'\]"
    ):
        resume_outer(outer_loop(other, "diloco", sync_every=2), own)


def test_the_trainer_strategy_refuses_a_second_optimizer(world_of_one):
    import lightning as L

    from lightning_gc.integrations.outer import OuterLoopStrategy

    class TwoOptimizers(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False  # Lightning's way to several optimizers: each .step() a step
            self.a, self.b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.manual_backward((self.a(batch[0]) + self.b(batch[0])).square().mean())
            for optimizer in self.optimizers():
                optimizer.step()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=OuterLoopStrategy("diloco", sync_every=2), max_steps=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"OuterLoopStrategy counts every optimizer step as one inner step; .* 2"):
        trainer.fit(TwoOptimizers(), data)
