"""Plain PyTorch DDP loops through lightning_gc.attach (the session under the Trainer strategy),
on real gloo process groups: equality with DDP in the dense limit, the torchrun example with an
exact resume, and errors at attach time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import lightning_gc

REPO = Path(__file__).resolve().parents[1]


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize(
    ("optimizer", "kwargs"),
    [
        ("sgd", {"compress_ratio": 1.0}),  # momentum correction: the memory applies SGD's momentum
        ("adamw", {"compress_ratio": 0.01, "adam_warmup_steps": 1000}),  # Adam's warm-up: exact averaging
    ],
)
def test_dgc_at_ratio_one_tracks_plain_ddp(run_ranks, optimizer: str, kwargs: dict) -> None:
    """SGD at ratio 1: equal to DDP + the same SGD (1e-5). AdamW before its variance freezes: bit
    for bit DDP + AdamW (the frozen phase is tested against a reference in test_adam.py)."""
    plain = run_ranks({"compressor": None, "optimizer": optimizer, "steps": 30}, worker="attach_worker.py", name="ddp")
    ours = run_ranks(
        {"compressor": "dgc", "optimizer": optimizer, "steps": 30, "kwargs": kwargs},
        worker="attach_worker.py",
        name="dgc",
    )
    assert torch.equal(ours[0]["params"], ours[1]["params"])
    difference = _relative_difference(ours[0]["params"], plain[0]["params"])
    if optimizer == "sgd":
        assert difference < 1e-5
    else:
        assert torch.equal(ours[0]["params"], plain[0]["params"])
    assert ours[0]["totals"]["steps"] == 30


def test_dgc_compresses_a_plain_loop(run_ranks) -> None:
    ranks = run_ranks(
        {"compressor": "dgc", "optimizer": "sgd", "steps": 20, "kwargs": {"compress_ratio": 0.01}},
        worker="attach_worker.py",
    )
    totals = ranks[0]["totals"]
    assert totals["dense_bytes"] / totals["bytes_sent"] > 20
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for _ in range(3):  # a free port can be taken by another process before torchrun listens on it
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", str(REPO / "examples" / "torchrun_dgc.py"), *args,
        ]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if "EADDRINUSE" not in done.stderr and "address already in use" not in done.stderr:
            break
    return done


def test_the_torchrun_example_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    straight = _torchrun("--steps", "40", "--checkpoint-every", "20", "--out", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "wire ratio" in straight.stdout, straight.stdout[-3000:]
    resumed = _torchrun(
        "--steps", "40", "--out", str(tmp_path / "b"), "--resume", str(tmp_path / "a" / "step20.pt")
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first, second = torch.load(tmp_path / "a" / "final.pt"), torch.load(tmp_path / "b" / "final.pt")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    checkpoint = torch.load(tmp_path / "a" / "step20.pt", weights_only=False)
    entry = checkpoint["lightning_gc"]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    assert not torch.equal(  # residuals are per rank, and both are in rank 0's file
        entry["ranks"][0]["memory"]["0.weight"]["velocity"], entry["ranks"][1]["memory"]["0.weight"]["velocity"]
    )


def test_attach_refuses_unknown_arguments_and_unwrapped_models(world_of_one) -> None:
    net = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="attach needs a DistributedDataParallel model, got Linear"):
        lightning_gc.attach(net, optimizer)
    model = DistributedDataParallel(net)
    with pytest.raises(ValueError, match="`compres_ratio`: did you mean `compress_ratio`"):
        lightning_gc.attach(model, optimizer, "dgc", compres_ratio=0.01)
    with pytest.raises(ValueError, match="`nonfinite` must be one of"):
        lightning_gc.attach(model, optimizer, "dgc", nonfinite="ignore")
    gc = lightning_gc.attach(model, optimizer, "topk", compress_ratio=0.5)
    assert gc.compress_ratio == 0.5 and not gc.session.memory.momentum_correction  # presets: dgc only
    gc.compress_ratio = 0.25
    assert gc.compressor.compress_ratio == 0.25
