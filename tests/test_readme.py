"""The README's newcomer commands are the ones CI runs, and the guides' complete front-end scripts
(docs/guides: Trainer, plain DDP under torchrun, Fabric) run on 2 CPU processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from conftest import run_torchrun

REPO = Path(__file__).resolve().parents[1]


def guide_script(page: str, tmp_path: Path) -> Path:
    """The first ``python`` block of the guide ``docs/guides/<page>``, as a script file."""
    text = (REPO / "docs" / "guides" / page).read_text()
    script = tmp_path / "snippet.py"
    script.write_text(text.split("```python\n", 1)[1].split("```", 1)[0])
    return script


def run_script(script: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, str(script)], cwd=script.parent, env=env, capture_output=True, text=True, timeout=600
    )


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    test_line = readme.split("# run the tests\n", 1)[1].splitlines()[0]
    assert test_line == 'pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile'
    assert test_line in ci.splitlines()
    assert "pip install -e . && python train.py" in readme


def test_the_readme_is_short_and_its_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README stays a few screens; details go to docs/"
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_trainer_snippet_runs(tmp_path: Path) -> None:
    done = run_script(guide_script("trainer.md", tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(done.stdout.split("val/acc ")[1].split()[0])
    assert accuracy > 0.8, done.stdout[-2000:]


def test_the_plain_ddp_snippet_runs_under_torchrun(tmp_path: Path) -> None:
    done = run_torchrun(guide_script("plain-ddp.md", tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'steps': 30" in done.stdout
    # the warm-up ended at 1 %: the last step sends about 1/50 of the dense bytes (indices + values)
    assert float(done.stdout.split("wire ratio ")[1].split("x")[0]) > 20
    entry = torch.load(tmp_path / "attach_dgc.pt", weights_only=True)["lightning_gc"]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2


def test_the_fabric_snippet_runs(tmp_path: Path) -> None:
    done = run_script(guide_script("fabric.md", tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'steps': 30" in done.stdout
    entry = torch.load(tmp_path / "fabric_dgc.ckpt", weights_only=True)["lightning_gc"]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
