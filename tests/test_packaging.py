"""Packaging: ``python -m build`` makes an sdist and a wheel, and the installed wheel (not the
checkout) registers the strategies and runs ``examples/torchrun_dgc.py`` on two gloo ranks."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from conftest import run_torchrun

REPO = Path(__file__).resolve().parents[1]


def _source_version() -> str:
    """``lightning_gc.__version__`` read as setuptools reads it: the literal, without importing."""
    tree = ast.parse((REPO / "lightning_gc" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no __version__ literal in lightning_gc/__init__.py")


def test_built_wheel_installs_and_runs_the_torchrun_example(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="the `build` frontend is not installed (pip install -e .[dev])")
    dist = tmp_path / "dist"
    # --no-isolation: build with the setuptools already installed here instead of downloading one
    # into a fresh environment, so the test runs offline. No --sdist/--wheel: build makes the sdist,
    # then the wheel from the unpacked sdist, which proves the sdist is enough to build from.
    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    version = _source_version()
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"lightning_gc-{version}-py3-none-any.whl"]
    assert [s.name for s in sdists] == [f"lightning_gc-{version}.tar.gz"]

    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        metadata = Parser().parsestr(wheel.read(f"lightning_gc-{version}.dist-info/METADATA").decode())
    assert {"lightning_gc/__init__.py", "lightning_gc/py.typed", "recipes/__init__.py"} <= names
    assert any(n.startswith("lightning_gc/compressors/") for n in names)
    assert metadata["Name"] == "lightning_gc" and metadata["Version"] == version
    assert metadata["License-Expression"] == "Apache-2.0"  # PEP 639; no deprecated licence classifier
    assert not any(c.startswith("License ::") for c in metadata.get_all("Classifier"))
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert any(url.startswith("Paper, https://arxiv.org/abs/1712.01887") for url in metadata.get_all("Project-URL"))
    licence = [n for n in names if n.startswith(f"lightning_gc-{version}.dist-info/") and n.endswith("/LICENSE")]
    assert licence, f"the wheel carries no LICENSE: {sorted(n for n in names if 'dist-info' in n)}"

    site, outside = tmp_path / "site", tmp_path / "outside"
    outside.mkdir()
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
         "--target", str(site), str(wheels[0])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, (installed.stdout + installed.stderr)[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = str(site)  # the installed copy only; cwd is outside the checkout

    check = (
        "import lightning_gc\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'dgc_ddp' in StrategyRegistry.available_strategies()\n"
        "print(lightning_gc.__file__, lightning_gc.__version__)\n"
    )
    imported = subprocess.run(
        [sys.executable, "-c", check], cwd=outside, env=env, capture_output=True, text=True, timeout=300
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    path, imported_version = imported.stdout.split()
    assert Path(path).resolve().is_relative_to(site.resolve()) and imported_version == version

    out = tmp_path / "run"
    example = run_torchrun(
        REPO / "examples" / "torchrun_dgc.py", "--steps", "20", "--checkpoint-every", "10", "--out", str(out),
        cwd=outside, env=env, timeout=300,
    )  # fmt: skip
    assert example.returncode == 0, example.stderr[-3000:]
    assert "wire ratio" in example.stdout and "totals:" in example.stdout, example.stdout[-3000:]
    assert (out / "step10.pt").is_file() and (out / "final.pt").is_file()

    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    missing = {"pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "PKG-INFO", "lightning_gc/py.typed"} - members
    assert not missing, f"the sdist lacks {sorted(missing)}"
