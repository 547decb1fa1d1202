"""What importing the package costs, and that the strategy names still reach Lightning.

``import lightning_gc`` imports no Lightning (it costs seconds: torchmetrics, torchvision,
``torch._dynamo``, scipy) yet ``Trainer(strategy="dgc_ddp")`` and ``Fabric(strategy="dgc_ddp")``
work whichever is imported first (:mod:`lightning_gc.integrations.registry`). Each case runs in a
fresh interpreter, since ``sys.modules`` here already holds everything."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "torchvision")


def run_fresh(script: str, cwd: Path) -> str:
    """Run ``script`` in a new interpreter that imports this checkout; return its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_the_package_the_perf_model_and_attach_import_no_lightning(tmp_path: Path) -> None:
    out = run_fresh(
        f"""
        import runpy, sys
        HEAVY = {HEAVY!r}

        def heavy():
            return [name for name in HEAVY if name in sys.modules]

        import lightning_gc
        assert heavy() == [], ("import lightning_gc", heavy())
        assert "torch" not in sys.modules
        import lightning_gc.perfmodel, lightning_gc.perfmodel.step, lightning_gc.perfmodel.outer_options
        assert heavy() == [], ("import lightning_gc.perfmodel", heavy())
        assert "torch" not in sys.modules, "import lightning_gc.perfmodel imported torch"
        sys.argv = ["lightning_gc.perfmodel", "--help"]
        try:
            runpy.run_module("lightning_gc.perfmodel", run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            assert stop.code in (0, None), stop.code
        assert heavy() == [], ("python -m lightning_gc.perfmodel --help", heavy())
        assert "torch" not in sys.modules, "python -m lightning_gc.perfmodel --help imported torch"

        from lightning_gc import attach, AttachedCompression, Compressor, available
        import lightning_gc.integrations.attach as front_end
        assert attach is lightning_gc.attach is front_end.attach and callable(attach)
        assert AttachedCompression is front_end.AttachedCompression
        assert "dgc" in available() and "topk" in lightning_gc.compressors.available()
        assert heavy() == [], ("from lightning_gc import attach", heavy())
        assert set(lightning_gc.__all__) <= set(dir(lightning_gc))
        try:
            lightning_gc.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("lightning_gc.no_such_name did not raise AttributeError")
        print("light")
        """,
        tmp_path,
    )
    assert out.splitlines()[-1] == "light"


BUILD = """
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc import DGCStrategy, FabricCompressionStrategy, GradientCompressionStrategy

trainer = Trainer(strategy="dgc_ddp", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy) is DGCStrategy, type(trainer.strategy)
trainer = Trainer(strategy="topk_ddp", accelerator="cpu", devices=1, logger=False)
assert type(trainer.strategy) is GradientCompressionStrategy, type(trainer.strategy)
assert trainer.strategy.compressor.name == "topk", trainer.strategy.compressor
fabric = Fabric(strategy="dgc_ddp", accelerator="cpu", devices=1)
assert type(fabric.strategy) is FabricCompressionStrategy, type(fabric.strategy)
assert {"dgc_ddp", "dgc_ddp_spawn", "topk_ddp"} <= set(StrategyRegistry.available_strategies())
assert "topk_ddp" in STRATEGY_REGISTRY.available_strategies()

import importlib, lightning_gc
importlib.reload(lightning_gc)  # what a second import does (the popen launcher's child): harmless
import lightning_gc.integrations.registry as registry
registry.register_strategies()
hooks = [f for f in sys.meta_path if getattr(f, "_lightning_gc_registration", False)]
assert hooks == [], f"the import hook stayed on sys.meta_path: {hooks}"
print("built")
"""

ORDERS = {
    "lightning_gc_first": """
        import lightning_gc
        assert "lightning" not in sys.modules
        import lightning
        """,
    "lightning_first": """
        import lightning.pytorch
        import lightning.fabric
        import lightning_gc
        """,
    # dgc.py imports Lightning itself: the names must wait until it has finished executing
    "a_public_strategy_name_first": """
        from lightning_gc import DGCStrategy
        """,
    # pytorch_lightning (the stand-alone package) is no reason to import lightning; a submodule first
    "pytorch_lightning_then_a_submodule": """
        import pytorch_lightning
        had_lightning = "lightning" in sys.modules
        import lightning_gc
        assert ("lightning" in sys.modules) == had_lightning
        from lightning_gc.integrations.strategy import GradientCompressionStrategy
        """,
}


@pytest.mark.parametrize("order", ORDERS)
def test_trainer_and_fabric_find_the_strategy_names_in_any_import_order(order: str, tmp_path: Path) -> None:
    script = "import sys\n" + textwrap.dedent(ORDERS[order]) + BUILD
    assert run_fresh(script, tmp_path).splitlines()[-1] == "built"


def test_the_perf_model_help_imports_no_torch(tmp_path: Path) -> None:
    """``python -m lightning_gc.perfmodel --help`` itself, as a user types it: it exits 0 with the
    usage and imports neither torch nor Lightning (torch alone is about 1 s warm and 10 s cold on
    2 cores; without it the help answers in well under the 2 s asked for). ``-X importtime``
    names every module the interpreter imports, on stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lightning_gc.perfmodel", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage: python -m lightning_gc.perfmodel"), done.stdout[:200]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "lightning_gc.perfmodel.__main__" in imported or "lightning_gc.perfmodel" in imported
    top = {name.split(".")[0] for name in imported}
    assert top.isdisjoint({"torch", *HEAVY}), sorted(top & {"torch", *HEAVY})
