"""Lightning Fabric front end: registration, argument errors, the README's script, and the example's
exact resume through fabric.save / fabric.load, on 2 CPU processes that Fabric launches itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_gc
from lightning_gc.compressors import available

REPO = Path(__file__).resolve().parents[1]


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_every_preset_is_registered_with_fabric_and_bad_arguments_fail_at_construction() -> None:
    for name in available():
        assert f"{name}_ddp" in STRATEGY_REGISTRY
    dgc = STRATEGY_REGISTRY.get("dgc_ddp")
    assert isinstance(dgc, lightning_gc.FabricCompressionStrategy)
    assert dgc.session.compressor.name == "dgc" and dgc.session.settings.momentum_correction
    qsgd = lightning_gc.FabricCompressionStrategy("qsgd", levels=3, exchange="two_phase", delay=1, bucket_cap_mb=5)
    assert qsgd.session.compressor.levels == 3 and qsgd.session.settings.delay == 1
    with pytest.raises(ValueError, match="did you mean `compress_ratio`"):
        lightning_gc.FabricCompressionStrategy("dgc", compres_ratio=0.01)
    with pytest.raises(ValueError, match="compress_ratio"):
        lightning_gc.FabricCompressionStrategy("dgc", compress_ratio=0)


def test_the_fabric_example_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    example = REPO / "examples" / "fabric_dgc.py"
    straight = _run(example, "--steps", "40", "--out", str(tmp_path / "a"), cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "wire ratio" in straight.stdout
    resumed = _run(
        example, "--steps", "40", "--out", str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "step20.ckpt"),
        cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = torch.load(tmp_path / "a" / "final.pt"), torch.load(tmp_path / "b" / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    entry = torch.load(tmp_path / "a" / "step20.ckpt", weights_only=True)["lightning_gc"]
    assert not torch.equal(  # residuals are per rank, and both are in rank 0's file
        entry["ranks"][0]["memory"]["0.weight"]["velocity"], entry["ranks"][1]["memory"]["0.weight"]["velocity"]
    )


def test_a_checkpoint_without_compression_state_loads_only_before_the_first_step(
    world_of_one: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy="dgc_ddp")
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    dense = tmp_path / "dense.ckpt"  # what a dense run (or a user's own torch.save) leaves
    saved = {k: v + 1.0 for k, v in net.state_dict().items()}
    torch.save({"model": saved, "optimizer": optimizer.state_dict(), "step": 7}, dense)
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}

    with caplog.at_level("INFO"):
        fabric.load(dense, state)
    assert "holds no compression state; memory starts empty" in caplog.text and state["step"] == 7
    assert all(torch.equal(p, saved[k]) for k, p in net.state_dict().items())

    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="compression memory holds the state of step 1"):
        fabric.load(dense, state)
    assert all(torch.equal(p, trained[k]) for k, p in net.state_dict().items())  # nothing was loaded

    fabric.save(tmp_path / "compressed.ckpt", state)  # with this run's state: loads mid-run
    fabric.load(tmp_path / "compressed.ckpt", state)
    assert all(torch.equal(p, trained[k]) for k, p in net.state_dict().items())

    # before set-up, a later checkpoint without compression state replaces a pending entry
    again = Fabric(accelerator="cpu", devices=1, strategy="dgc_ddp")
    again.launch()
    other = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    pending = {"model": other, "step": 0}
    again.load(tmp_path / "compressed.ckpt", pending)
    again.load(dense, pending)
    again.setup(other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    assert again.strategy.session.hook_state.step == 0 and pending["step"] == 7
    assert all(torch.equal(p, saved[k]) for k, p in other.state_dict().items())
