"""The outer loop's arguments, shared by every front end: a preset of
:data:`~lightning_gc.common.outer_presets.OUTER_PRESETS` merged with the user's keyword arguments
and checked (:func:`outer_arguments`), built into an
:class:`~lightning_gc.runtime.outer.OuterLoop` (:meth:`OuterArguments.build`). Imports no
Lightning: the plain-PyTorch front end (:mod:`lightning_gc.integrations.outer_attach`) uses it as
the Trainer and Fabric strategies do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any

import torch

from lightning_gc.common.outer_presets import OUTER_ARGUMENTS, OUTER_PRESETS, STREAMING_DEFAULTS
from lightning_gc.common.validation import check_int
from lightning_gc.compressors import available, create
from lightning_gc.compressors.base import Compressor
from lightning_gc.compressors.registry import argument_names, compressor_class
from lightning_gc.exchanges.comm import ProcessGroup
from lightning_gc.runtime.build import SETTING_NAMES
from lightning_gc.runtime.outer import OuterLoop, OuterSGD, Streaming
from lightning_gc.runtime.outer_fragments import check_error_decay

__all__ = ["OUTER_ARGUMENTS", "OUTER_PRESETS", "STREAMING_DEFAULTS", "OuterArguments", "outer_arguments"]

_PER_STEP_SETTINGS = SETTING_NAMES
"""Settings of per-step gradient compression (``delay``, ``local_update``, ``hierarchy``, the Adam
hand-over, ...): not arguments of the outer loop, named as such when given to it."""


@dataclass(frozen=True)
class OuterArguments:
    """The outer loop's settings, checked: what :func:`outer_arguments` returns and
    :meth:`build` turns into an :class:`~lightning_gc.runtime.outer.OuterLoop`."""

    preset: str
    sync_every: int
    compressor: Compressor
    error_decay: float
    outer: OuterSGD
    streaming: Streaming
    compressor_arguments: dict[str, Any] = field(default_factory=dict)
    """The compressor's arguments as given (preset and user), for the record; already applied."""

    @property
    def outer_lr(self) -> float:
        return self.outer.lr

    @property
    def outer_momentum(self) -> float:
        return self.outer.momentum

    @property
    def outer_nesterov(self) -> bool:
        return self.outer.nesterov

    @property
    def fragments(self) -> int:
        return self.streaming.fragments

    @property
    def sync_delay(self) -> int:
        return self.streaming.sync_delay

    @property
    def mix(self) -> float:
        return self.streaming.mix

    def build(self, module: torch.nn.Module, group: ProcessGroup = None) -> OuterLoop:
        """The outer loop of ``module`` over ``group`` (a collective: every rank of the group calls
        it, with the same starting parameters). The compressor is a template: every fragment of every
        build runs its own copy (a second fit starts with fresh codec state)."""
        return OuterLoop(
            module,
            sync_every=self.sync_every,
            compressor=self.compressor,
            error_decay=self.error_decay,
            outer=self.outer,
            streaming=self.streaming,
            group=group,
        )


def _hint(name: str, known: list[str] | set[str]) -> str:
    close = get_close_matches(name, sorted(known), 1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def outer_arguments(
    preset: str, kwargs: dict[str, Any], *, owner: str, others: dict[str, set[str]] | None = None
) -> OuterArguments:
    """Merge ``preset``'s :data:`OUTER_PRESETS` entry with the user's ``kwargs`` and check the
    result. The outer loop's arguments and the compressor's are popped from ``kwargs``; what stays
    must be a name of ``others`` (e.g. ``{"DDP": DDP's arguments}``), left for the caller.

    Raises:
        ValueError: in one line, naming the value: an unknown preset or compressor (with the
            choices), a bad value, or an unknown argument (with the close name and who takes what;
            per-step settings such as ``delay`` are named as such).
    """
    if not isinstance(preset, str) or preset not in OUTER_PRESETS:
        raise ValueError(
            f"`preset={preset!r}` is not one of {sorted(OUTER_PRESETS)}"
            + (_hint(preset, set(OUTER_PRESETS)) if isinstance(preset, str) else "")
        )
    defaults = {**STREAMING_DEFAULTS, **OUTER_PRESETS[preset]}
    compressor = kwargs.pop("compressor", defaults["compressor"])
    if isinstance(compressor, str):
        if compressor not in available():
            raise ValueError(f"`compressor={compressor!r}` is not one of {available()}{_hint(compressor, available())}")
        accepted = argument_names(compressor_class(compressor))
        if compressor != defaults["compressor"]:  # another codec: the preset's codec arguments do not apply
            defaults = {k: v for k, v in defaults.items() if k in OUTER_ARGUMENTS}
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in accepted}
        codec_arguments = {**{k: v for k, v in defaults.items() if k in accepted}, **given}
        built = create(compressor, **codec_arguments)
    elif isinstance(compressor, Compressor):
        built, codec_arguments = compressor, {}
        defaults = {k: v for k, v in defaults.items() if k in OUTER_ARGUMENTS}
    else:
        raise ValueError(f"`compressor` must be one of {available()} or a lightning_gc Compressor, got {compressor!r}")
    settings = {name: kwargs.pop(name, defaults[name]) for name in OUTER_ARGUMENTS if name != "compressor"}
    allowed = set().union(*(others or {}).values())
    unknown = {name: kwargs[name] for name in sorted(set(kwargs) - allowed)}
    if unknown:
        known = set(OUTER_ARGUMENTS) | argument_names(type(built)) | allowed
        notes = []
        for name in unknown:
            if name in _PER_STEP_SETTINGS:
                notes.append(f"`{name}` is a per-step gradient-compression setting, not an outer-loop one")
            elif close := get_close_matches(name, sorted(known), 1):
                notes.append(f"`{name}`: did you mean `{close[0]}`?")
        takes = "".join(f", {who} takes {sorted(names)}" for who, names in (others or {}).items())
        raise ValueError(
            f"unknown argument(s) {unknown} for {owner}"
            + (f" ({'; '.join(notes)})" if notes else "")
            + f": the outer loop takes {list(OUTER_ARGUMENTS)}, compressor {built.name!r} takes "
            f"{sorted(argument_names(type(built)))}{takes}"
        )
    sync_every = check_int("sync_every", settings["sync_every"], 1)
    return OuterArguments(
        preset=preset,
        sync_every=sync_every,
        compressor=built,
        error_decay=check_error_decay(settings["error_decay"], built),
        outer=OuterSGD(settings["outer_lr"], settings["outer_momentum"], settings["outer_nesterov"]),
        streaming=Streaming(settings["fragments"], settings["sync_delay"], settings["mix"]).check(sync_every),
        compressor_arguments=codec_arguments,
    )
