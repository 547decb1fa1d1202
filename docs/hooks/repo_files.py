"""MkDocs hook: repository files outside ``docs/`` in the site, without copies in ``docs/``.

* Every ``benchmarks/*.png`` is added to the site as ``benchmarks/<name>.png``.
* A page line ``<!-- include: PATH -->`` (``PATH`` relative to the repository root) is replaced
  by that file's text: ``docs/benchmarks.md`` shows ``benchmarks/RESULTS.md``, and
  ``docs/changelog.md`` ``CHANGELOG.md``, each kept in one place.
* A page line ``<!-- api: the rest of lightning_gc.__all__ -->`` becomes a ``::: module.Name``
  entry (under its own heading) for every public name the page does not document yet, so a name
  added to ``lightning_gc.__all__`` is in the API reference from its first commit.
* Sphinx roles left in docstrings (``:class:`~a.b.C` ``) render as their code span alone
  (``C``; the full path without ``~``), not as ``:class:`` followed by the path.
* Relative links are written as they work on GitHub, from the file they are in
  (``../benchmarks/netbench-….png`` in ``docs/results-log.md``, ``../docs/results-log.md`` and
  ``netbench-….png`` in ``benchmarks/RESULTS.md``); each one that resolves to a plot or a page of
  the site is rewritten relative to the page being built. Any other link is left as written, so
  ``mkdocs build --strict`` reports a broken one.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
PLOTS = REPO / "benchmarks"
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)
API_REST = "<!-- api: the rest of lightning_gc.__all__ -->"
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")
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

    markdown = INCLUDE.sub(included, markdown)
    if API_REST in markdown:
        markdown = markdown.replace(API_REST, api_entries(markdown))
    return relink(markdown, page_dir, page_dir, docs)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    def code(match: re.Match[str]) -> str:
        path = match.group(2)
        return f"<code>{path.rsplit('.', 1)[-1] if match.group(1) else path}</code>"

    return SPHINX_ROLE.sub(code, html)


def public_names() -> dict[str, str]:
    """``lightning_gc.__all__``, each name with the module that defines it (``_SOURCES``), read
    from the package's ``__init__.py`` without importing it."""
    values: dict[str, object] = {}
    for node in ast.parse((REPO / "lightning_gc" / "__init__.py").read_text(encoding="utf-8")).body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id in ("__all__", "_SOURCES"):
            values[target.id] = ast.literal_eval(node.value)
    sources = values["_SOURCES"]
    assert isinstance(sources, dict)
    return {name: sources[name] for name in values["__all__"]}  # type: ignore[union-attr]


def api_entries(markdown: str) -> str:
    """``::: module.Name`` entries for the public names ``markdown`` has no entry for."""
    documented = set(re.findall(r"^::: \S+\.(\w+)$", markdown, re.MULTILINE))
    rest = [f"::: {module}.{name}" for name, module in public_names().items() if name not in documented]
    return "## Other public names\n\n" + "\n\n".join(rest) if rest else ""


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
