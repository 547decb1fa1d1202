"""The README's newcomer commands are the ones CI runs."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    test_line = readme.split("# run the tests\n", 1)[1].splitlines()[0]
    assert test_line == 'pip install -e ".[dev]" && python -m pytest -q'
    assert test_line in ci.splitlines()
    assert "pip install -e . && python train.py" in readme
