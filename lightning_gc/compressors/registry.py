"""Compressors by name: ``available()`` lists them, ``create(name, **arguments)`` builds one.

Each compressor module registers its class with :func:`register`; the strategy presets
(``"<name>_ddp"``) and ``GradientCompressionStrategy(compressor="<name>", ...)`` resolve names here.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from lightning_gc.common.validation import check_choice
from lightning_gc.compressors.base import Compressor

C = TypeVar("C", bound=type[Compressor])

_REGISTRY: dict[str, type[Compressor]] = {}


def register(cls: C) -> C:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is already taken by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of the registered compressors, sorted."""
    return sorted(_REGISTRY)


def compressor_class(name: str) -> type[Compressor]:
    """The class registered as ``name``; ``ValueError`` naming the valid choices otherwise."""
    check_choice("compressor", name, available())
    return _REGISTRY[name]


def argument_names(cls: type[Compressor]) -> set[str]:
    """Keyword arguments ``cls`` accepts (used to split strategy arguments from compressor ones):
    those its ``__init__`` names and, where that forwards ``**kwargs`` to ``super().__init__``
    (as :class:`~lightning_gc.compressors.dgc.DGCCompressor` does), those of the next
    ``__init__`` up the method resolution order."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        parameters = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


def create(name: str, **arguments: Any) -> Compressor:
    """Build the compressor registered as ``name`` from ``arguments``."""
    cls = compressor_class(name)
    unknown = sorted(set(arguments) - argument_names(cls))
    if unknown:
        raise ValueError(f"compressor {name!r} takes no argument(s) {unknown}; it takes {sorted(argument_names(cls))}")
    return cls(**arguments)
