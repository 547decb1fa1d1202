"""One way from user arguments to a :class:`~lightning_gc.runtime.session.CompressionSession`,
shared by every front end (the Trainer strategies, Fabric, plain-DDP ``attach``).

A front end hands over the compressor (a registered name or an object) and its keyword arguments;
:func:`build_session` takes out the compressor's own arguments and the
:class:`~lightning_gc.runtime.settings.CompressionSettings` fields, applies a preset's defaults
(:data:`PRESETS`), and leaves in ``kwargs`` only names the front end said it takes itself (DDP's,
say). Anything else is refused in one line naming the value, the closest known name and who takes
what.
"""

from __future__ import annotations

import dataclasses
from difflib import get_close_matches
from typing import Any

from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.chunks import two_phase_compressors
from lightning_gc.compressors.registry import argument_names, available, compressor_class, create
from lightning_gc.runtime.session import CompressionSession
from lightning_gc.runtime.settings import CompressionSettings

PRESETS: dict[str, dict[str, Any]] = {"dgc": {"momentum_correction": True}}
"""Settings a compressor's preset turns on by default: ``"dgc"`` is Deep Gradient Compression,
whose sparsifier goes with momentum correction (``DGCStrategy``, ``"dgc_ddp"``, ``attach(...,
"dgc")``). Arguments the user passes win."""

SETTING_NAMES = frozenset(field.name for field in dataclasses.fields(CompressionSettings))
"""The keyword arguments every front end takes besides the compressor's (the settings' fields)."""


def resolve_compressor(
    compressor: str | Compressor, kwargs: dict[str, Any], *, owner: str, others: dict[str, set[str]]
) -> Compressor:
    """The compressor named (built from the arguments it takes, popped from ``kwargs``) or given;
    whatever remains in ``kwargs`` must be a name of ``others`` (what else the caller takes, by
    who takes it).

    Raises:
        ValueError: unknown compressor name, bad compressor arguments, or an argument neither the
            compressor nor the others take (named with its value, and the close name if any).
    """
    if isinstance(compressor, str):
        accepted = argument_names(compressor_class(compressor))
        compressor = create(compressor, **{k: kwargs.pop(k) for k in list(kwargs) if k in accepted})
    elif not isinstance(compressor, Compressor):
        raise ValueError(f"`compressor` must be one of {available()} or a lightning_gc Compressor, got {compressor!r}")
    allowed = set().union(*others.values())
    if "exchange" in kwargs and "exchange" not in allowed:
        raise ValueError(
            f"`exchange={kwargs['exchange']!r}` is not for compressor {compressor.name!r}: the two-phase exchange "
            f"re-encodes averaged chunks, which only {two_phase_compressors()} can, and the global top-k exchange "
            "merges the selections of topk and dgc; randomk and powersgd are all-reduced already"
        )
    unknown = {name: kwargs[name] for name in sorted(set(kwargs) - allowed)}
    if unknown:
        known = argument_names(type(compressor)) | allowed | SETTING_NAMES
        hints = [
            f"`{name}`: did you mean `{close[0]}`?" for name in unknown if (close := get_close_matches(name, known, 1))
        ]
        takes = "".join(f", {who} takes {sorted(names)}" for who, names in others.items())
        raise ValueError(
            f"unknown argument(s) {unknown} for {owner}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f": compressor {compressor.name!r} takes {sorted(argument_names(type(compressor)))}{takes}"
        )
    return compressor


def build_session(
    compressor: str | Compressor,
    kwargs: dict[str, Any],
    *,
    owner: str,
    preset: str | None = None,
    others: dict[str, set[str]] | None = None,
) -> CompressionSession:
    """The session of a front end: the compressor's arguments and the settings' fields are taken
    out of ``kwargs`` (``preset``'s :data:`PRESETS` entry as defaults); whatever remains must be a
    name of ``others`` (e.g. ``{"DDP": DDP's arguments}``) and stays in ``kwargs`` for the caller.

    Raises:
        ValueError: an unknown preset or argument (with the close name) or a bad value, naming ``owner``.
    """
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"`preset={preset!r}` is not one of {sorted(PRESETS)}")
        for setting, value in PRESETS[preset].items():
            kwargs.setdefault(setting, value)
    built = resolve_compressor(compressor, kwargs, owner=owner, others={owner: set(SETTING_NAMES), **(others or {})})
    settings = CompressionSettings(**{k: kwargs.pop(k) for k in list(kwargs) if k in SETTING_NAMES})
    return CompressionSession(built, settings, owner=owner)


def preset_for(compressor: str | Compressor) -> str | None:
    """The preset a compressor name (or object) brings where a front end takes compressors by
    name (``attach``, Fabric's ``"<name>_ddp"``): its :data:`PRESETS` entry, if it has one."""
    name = compressor if isinstance(compressor, str) else getattr(compressor, "name", None)
    return name if name in PRESETS else None
