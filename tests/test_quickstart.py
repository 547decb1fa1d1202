"""`python train.py` — the README's main job — trains DGC on real data and reports honest figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_train_py_quickstart_reaches_accuracy_with_high_compression() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    done = subprocess.run([sys.executable, "train.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dense = re.search(r"dense DDP\s+val acc ([\d.]+)\s+sent\s+([\d.]+) MB", done.stdout)
    dgc = re.search(r"DGC\s+val acc ([\d.]+)\s+sent\s+([\d.]+) MB.*?(\d+)x over the run.*?(\d+)x per step", done.stdout)
    assert dense and dgc, done.stdout[-3000:]
    assert float(dgc.group(1)) >= 0.93  # digits: dense DDP reaches ~0.98
    assert float(dgc.group(1)) >= float(dense.group(1)) - 0.03
    assert float(dgc.group(2)) < float(dense.group(2)) / 10
    assert int(dgc.group(4)) >= 200  # 0.1 % density after warm-up (dense biases included)
