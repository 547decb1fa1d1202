"""The package's layers (docs/ARCHITECTURE.md): each imports only from layers below it, and only
``integrations/`` imports Lightning. Read from the source (every ``import``, also inside functions),
so a new upward import fails here before it tangles the graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "lightning_gc"
LAYERS = ("common", "kernels", "compressors", "core", "exchanges", "perfmodel", "runtime", "integrations")
"""Bottom to top."""
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


def layer_of(module: str) -> int:
    """The layer index of a ``lightning_gc`` module name (the package root sits above every layer)."""
    parts = module.split(".")
    if parts == ["lightning_gc"]:
        return len(LAYERS)
    return LAYERS.index(parts[1])


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[str]:
    """Every module ``path`` imports, as absolute names (``from lightning_gc import kernels`` is
    ``lightning_gc.kernels``)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            assert node.module is not None
            if node.module == "lightning_gc":
                names.extend(f"lightning_gc.{alias.name}" for alias in node.names)
            else:
                names.append(node.module)
    return names


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer():
    stray = [str(p.relative_to(PACKAGE)) for p in MODULES if p.parent == PACKAGE and p.name != "__init__.py"]
    assert stray == [], f"modules outside the layer packages {LAYERS}: {stray}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_from_layers_below(path: Path):
    here = module_name(path)
    upward = [name for name in imported(path) if name.startswith("lightning_gc.") and layer_of(name) > layer_of(here)]
    assert upward == [], f"{here} (layer {layer_of(here)}) imports from layers above it: {upward}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_integrations_import_lightning(path: Path):
    here = module_name(path)
    if here.startswith("lightning_gc.integrations") and not here.endswith(".attach"):
        return
    lightning = [name for name in imported(path) if name.split(".")[0] in LIGHTNING]
    assert lightning == [], f"{here} imports Lightning ({lightning}); only integrations/ may"


def test_the_layer_check_sees_an_upward_import(tmp_path: Path):
    """The check itself can fail: a core module importing the runtime, or Lightning, is caught."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import lightning.pytorch as pl\n"
        "from lightning_gc import kernels\n"
        "\n\ndef f():\n    from lightning_gc.runtime import hook\n"
    )
    names = imported(probe)
    assert names == ["lightning.pytorch", "lightning_gc.kernels", "lightning_gc.runtime"]
    assert [layer_of(n) for n in names[1:]] == [1, 6] and layer_of("lightning_gc.core.memory") == 3
