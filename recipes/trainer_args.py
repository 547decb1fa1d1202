"""The ``trainer`` group's values checked against ``lightning.Trainer``'s own type hints, before any
process starts: Lightning takes ``max_epochs="abc"`` or ``logger="maybe"`` at construction and fails
only once every process is training, with a traceback from each."""

from __future__ import annotations

import types
import typing
from typing import Any

import lightning as L

MINIMA = {"accumulate_grad_batches": 1, "num_nodes": 1}
"""Arguments whose integers have a floor Lightning does not check at construction."""


def trainer_argument_errors(arguments: dict[str, Any]) -> list[str]:
    """One message per argument whose value fits neither ``lightning.Trainer``'s type hint for it
    nor its floor, naming ``trainer.<name>``, what it takes and the value (empty when all fit;
    arguments without a hint, or with a hint this cannot read, are left to Lightning)."""
    hints = typing.get_type_hints(L.Trainer.__init__)
    errors = []
    for name, value in arguments.items():
        hint = hints.get(name)
        if hint is not None and _fits(hint, value) is False:
            errors.append(f"`trainer.{name}` must be {_described(hint)}, got {value!r}")
        elif name in MINIMA and isinstance(value, int) and value < MINIMA[name]:
            errors.append(f"`trainer.{name}` must be an integer >= {MINIMA[name]}, got {value!r}")
    return errors


def _fits(hint: Any, value: Any) -> bool | None:
    """Whether ``value`` is of type ``hint`` (``None``: a hint this does not read)."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        answers = [_fits(part, value) for part in typing.get_args(hint)]
        return True if True in answers else None if None in answers else False
    if origin is typing.Literal:
        return any(value == choice and type(value) is type(choice) for choice in typing.get_args(hint))
    if origin is not None:  # list[int], dict[str, int], Iterable[Logger]: the container, not its items
        return isinstance(value, origin) and not isinstance(value, str)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else None


def _described(hint: Any) -> str:
    """``hint`` in words: ``an integer or null``, ``one of ['16-mixed', ...]``."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_described(part) for part in typing.get_args(hint)))
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(hint))}"
    if origin is not None:
        return _article(origin.__name__.lower())
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(hint, _article(getattr(hint, "__name__", str(hint))))


def _article(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
