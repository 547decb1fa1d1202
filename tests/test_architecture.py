"""docs/ARCHITECTURE.md's worked example (a compressor and an exchange defined outside the
package, registered and used through the public entry points) runs as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def extending_blocks() -> str:
    """The ``python`` blocks of the "Extending" section, in order, as one script."""
    section = (REPO / "docs" / "ARCHITECTURE.md").read_text().split("## Extending", 1)[1]
    return "\n".join(part.split("```", 1)[0] for part in section.split("```python\n")[1:])


def test_the_extension_example_runs(tmp_path: Path) -> None:
    script = tmp_path / "extending.py"
    script.write_text(extending_blocks() + '\nprint("extended")\n')
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("extended")


def test_the_example_registers_a_compressor_every_front_end_finds(tmp_path: Path) -> None:
    """A compressor registered from outside is built by name, as the front ends build theirs."""
    script = tmp_path / "by_name.py"
    script.write_text(
        extending_blocks()
        + "\nfrom lightning_gc.runtime.build import build_session\n"
        + "session = build_session('toy_bf16', {'clip_norm': 1.0}, owner='test')\n"
        + "print(type(session.compressor).__name__, session.settings.clip_norm)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["ToyBF16", "1.0"]
