"""Running ``train.py`` / ``python -m`` as a user would: a subprocess in the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("LIGHTNING_GC_SHARED_DATA", REPO.parent / "shared" / "data"))
"""Small real datasets (PTB, LibriSpeech utterances, yesno); tests that need them skip without them."""


def train(*overrides: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python train.py <overrides>`` from the repository root, outside any distributed environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def output(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}"


def results(root: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("result.json"))]
