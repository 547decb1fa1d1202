"""The documentation site builds with ``mkdocs build --strict``: every page in the nav, no broken
link or anchor, every API reference entry resolved from the docstrings, every plot present."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_gc

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs or mkdocstrings is not installed (the `docs` extra: pip install -e '.[docs]')",
)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]

    api = (site / "api" / "index.html").read_text()
    undocumented = [name for name in lightning_gc.__all__ if f'.{name}"' not in api]
    assert not undocumented, f"the API reference lacks {undocumented}"

    results = (site / "benchmarks" / "index.html").read_text()
    assert "<table>" in results and "<img" in results
    for page in site.rglob("*.html"):
        for src in page.read_text().split('<img alt="')[1:]:
            target = src.split('src="', 1)[1].split('"', 1)[0]
            if "://" not in target:
                assert (page.parent / target).is_file(), f"{page.relative_to(site)}: image {target} missing"
