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
