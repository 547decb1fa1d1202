"""MkDocs hook: repository files outside ``docs/`` in the site, without copies in ``docs/``.

* Every ``benchmarks/*.png`` is added to the site as ``benchmarks/<name>.png``.
* A page line ``<!-- include: PATH -->`` (``PATH`` relative to the repository root) is replaced
  by that file's text: ``docs/benchmarks.md`` shows ``benchmarks/RESULTS.md``, and
  ``docs/changelog.md`` ``CHANGELOG.md``, each kept in one place.
* Relative links are written as they work on GitHub, from the file they are in
  (``../benchmarks/netbench-….png`` in ``docs/results-log.md``, ``../docs/results-log.md`` and
  ``netbench-….png`` in ``benchmarks/RESULTS.md``); each one that resolves to a plot or a page of
  the site is rewritten relative to the page being built. Any other link is left as written, so
  ``mkdocs build --strict`` reports a broken one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
PLOTS = REPO / "benchmarks"
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def on_files(files: Files, config: Any) -> Files:
    for plot in sorted(PLOTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    page_dir = (docs / page.file.src_uri).parent

    def included(match: re.Match[str]) -> str:
        source = REPO / match.group(1)
        if not source.is_file():
            raise FileNotFoundError(f"{page.file.src_uri}: include {match.group(1)!r}: no such file")
        return relink(source.read_text(encoding="utf-8"), source.parent, page_dir, docs)

    return relink(INCLUDE.sub(included, markdown), page_dir, page_dir, docs)


def relink(markdown: str, written_in: Path, page_dir: Path, docs: Path) -> str:
    """``markdown``'s relative links, written from ``written_in``, made relative to ``page_dir``."""

    def rewrite(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        resolved = (written_in / target).resolve()
        if resolved.parent == PLOTS and resolved.suffix == ".png" and resolved.is_file():
            resolved = docs / "benchmarks" / resolved.name  # where on_files put it
        elif not (resolved.is_relative_to(docs) and resolved.exists()):
            return match.group(0)
        return f"{match.group(1)}{Path(os.path.relpath(resolved, page_dir)).as_posix()}{match.group(3)}"

    return LINK.sub(rewrite, markdown)
