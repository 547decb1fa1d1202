"""The strategy names, registered with Lightning's Trainer and Fabric registries, without
importing Lightning until the user does.

Why a hook. Lightning has no plugin discovery (no entry points) for third-party strategies: a name
such as ``"dgc_ddp"`` exists only once something in the process has called the registry's
``register``, and ``Trainer(strategy="dgc_ddp")`` / ``Fabric(strategy="dgc_ddp")`` resolve the name
when they are constructed (their accelerator connectors read ``available_strategies()`` in
``__init__``). So ``import lightning_gc`` has to arrange the registration. Doing it by importing
Lightning there costs seconds (``lightning`` pulls in torchmetrics, torchvision, ``torch._dynamo``,
scipy) that the perf-model CLI (``python -m lightning_gc.perfmodel``) and plain-DDP users
(:func:`lightning_gc.attach`) would pay for nothing. Hence :func:`register_when_lightning_loads`,
which ``lightning_gc/__init__.py`` calls:

* Lightning already imported: register at once.
* Otherwise a finder goes first on ``sys.meta_path``. It imports nothing; when ``lightning`` is
  imported it wraps that module's loader, so registration runs the moment ``lightning/__init__.py``
  has finished executing, inside the user's ``import`` statement, before any Trainer or Fabric can
  be built. Either import order works: ``import lightning_gc`` then Lightning, or the reverse.

Why the top-level ``lightning`` package, not ``lightning.pytorch.strategies``: every ``lightning.*``
import runs ``lightning/__init__.py`` first, and it imports ``lightning.fabric`` and
``lightning.pytorch`` (both registries included) whole, so when it finishes all of Lightning is
initialised. Right after ``lightning.pytorch.strategies`` it is not (``lightning.pytorch`` and its
``callbacks``, ``core`` and ``trainer`` packages are half-imported then), and our strategy modules
import from there: it works today only by the order of Lightning's own imports.

Why the finder also watches ``lightning_gc.integrations.*``: those modules import Lightning
themselves, so the first ``import lightning`` can happen in the middle of one of them (``from
lightning_gc import DGCStrategy`` before any Lightning import). Registering then would import the
half-executed module again (a circular import), so registration waits until no watched module is
executing: it runs at the end of the outermost one.

Idempotent: the ``register_strategies`` classmethods skip names already present (Lightning's popen
launcher re-runs the user's script, which imports lightning_gc again; a reload does too), and once
registered the finder takes itself off ``sys.meta_path``. The stand-alone ``pytorch_lightning`` and
``lightning_fabric`` packages keep registries of their own and refuse strategies that subclass
``lightning.pytorch``'s; nothing is registered with them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importlib.abc costs ~10 ms (it imports importlib.resources): duck-typed below
    from importlib.abc import Loader

_LIGHTNING = "lightning"
"""The package whose end of import triggers registration."""
_OURS = "lightning_gc.integrations."
"""Our modules that import Lightning: registration waits until none of them is executing."""

_lock = threading.Lock()  # guards the flags below; never held while importing
_registered = False
_registering = False
_executing = 0  # watched lightning_gc.integrations modules executing now (nesting depth, all threads)
_lightning_loaded = False  # lightning/__init__.py has finished executing (set by the hook)


def register_strategies() -> None:
    """Register ``"dgc_ddp"``, ``"dgc_ddp_spawn"``, ``"<compressor>_ddp"`` and the outer-loop presets
    (``"diloco"``, ``"diloco_int8"``, ``"sparseloco"``) with the Trainer's registry, and the
    ``"<compressor>_ddp"`` and outer-loop presets with Fabric's. Imports Lightning. Idempotent: Lightning's popen
    launcher re-imports the user's script."""
    global _registered
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_gc.integrations.dgc import DGCStrategy
    from lightning_gc.integrations.fabric import register_fabric_strategies
    from lightning_gc.integrations.outer import register_outer_strategies
    from lightning_gc.integrations.outer_fabric import register_outer_fabric_strategies
    from lightning_gc.integrations.strategy import GradientCompressionStrategy

    GradientCompressionStrategy.register_strategies(StrategyRegistry)
    DGCStrategy.register_strategies(StrategyRegistry)
    register_outer_strategies(StrategyRegistry)
    register_fabric_strategies(FABRIC_STRATEGY_REGISTRY)
    register_outer_fabric_strategies(FABRIC_STRATEGY_REGISTRY)
    with _lock:
        _registered = True
    _remove_finder()


def register_when_lightning_loads() -> None:
    """Register now if Lightning is imported, else as soon as it is (module docstring). Imports no
    Lightning; calling it again is harmless."""
    if _registered:
        return
    if _lightning_ready():
        _try_register()
        return
    if not any(getattr(finder, "_lightning_gc_registration", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegistrationFinder())


def _lightning_ready() -> bool:
    """``lightning`` is fully imported (not merely in ``sys.modules`` while its ``__init__`` runs)."""
    module = sys.modules.get(_LIGHTNING)
    if module is None:
        return False
    return _lightning_loaded or not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _try_register() -> None:
    """Register unless done, under way, Lightning not yet imported, or one of our modules mid-import."""
    global _registering
    with _lock:
        if _registered or _registering or _executing or not _lightning_ready():
            return
        _registering = True
    try:
        register_strategies()
    finally:
        with _lock:
            _registering = False


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_lightning_gc_registration", False)]


class _RegistrationFinder:
    """Finds nothing itself: for ``lightning`` and ``lightning_gc.integrations.*`` it asks the other
    finders and wraps the loader of the spec they return in a :class:`_NotifyingLoader`."""

    _lightning_gc_registration = True  # marks it across reloads of this module

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _LIGHTNING and not fullname.startswith(_OURS):
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if getattr(finder, "_lightning_gc_registration", False) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _NotifyingLoader(spec.loader, lightning=fullname == _LIGHTNING)
        return spec


class _NotifyingLoader:
    """Runs the real loader, then tries to register (for one of our modules: when the outermost
    one has finished). Puts the real loader back on the module before executing it."""

    def __init__(self, loader: Loader, lightning: bool) -> None:
        self._loader, self._lightning = loader, lightning

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        global _executing, _lightning_loaded
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        if self._lightning:
            self._loader.exec_module(module)
            with _lock:
                _lightning_loaded = True
        else:
            with _lock:
                _executing += 1
            try:
                self._loader.exec_module(module)
            finally:
                with _lock:
                    _executing -= 1
        _try_register()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        if name == "_loader":
            raise AttributeError(name)
        return getattr(self._loader, name)
