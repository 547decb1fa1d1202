"""Per-parameter state kept *by parameter name* but *stored flat per bucket*.

For each bucket layout, every kind of state (``"velocity"``, ``"momentum"``, ...) is one contiguous
buffer of the bound layout's size (a bucket, or a packed chunk of one), so an update over the
bucket is a few vectorised passes; each parameter's entry is a view into it. When DDP rebuilds
its buckets (after its first iteration, and again after a resume), the new buffers are filled
from the old views by name, so no state is lost or misattributed. Checkpoints hold standalone
per-name tensors and are independent of bucketing.

Invariant: for every parameter name and kind, at most one live view exists, and it is the one in
the buffer of the parameter's current bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_gc.common.layout import BucketLayout

ByName = dict[str, dict[str, torch.Tensor]]
"""State by parameter name, then by kind."""


class FlatState:
    """The store behind the invariant above, for the kinds named in ``kinds``."""

    def __init__(self, kinds: Iterable[str]) -> None:
        self.kinds = tuple(kinds)
        self._views: dict[str, dict[str, torch.Tensor]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # loaded, not yet bound to a bucket

    def bind(self, layout: BucketLayout, like: torch.Tensor, kinds: Iterable[str]) -> dict[str, torch.Tensor]:
        """Zeroed flat buffers of ``kinds`` for ``layout`` (``like``'s dtype and device), filled with
        each parameter's earlier state where there is one."""
        flat = {kind: torch.zeros(layout.numel, dtype=like.dtype, device=like.device) for kind in kinds}
        for segment in layout.segments:
            previous = self._views.get(segment.name) or self._pending.pop(segment.name, {})
            views = {}
            for kind, buffer in flat.items():
                view = segment.of(buffer)
                if kind in previous:
                    source = previous[kind]
                    if source.numel() != view.numel():
                        raise RuntimeError(
                            f"compression state {kind!r} for {segment.name!r} has {source.numel()} elements, "
                            f"this run keeps {view.numel()} for it (a checkpoint of another model or version?)"
                        )
                    view.copy_(source.reshape(-1))
                views[kind] = view
            self._views[segment.name] = views
        return flat

    def add(self, layout: BucketLayout, kind: str, like: torch.Tensor) -> torch.Tensor:
        """A zeroed flat buffer of ``kind`` added to the bucket of ``layout`` (bound before)."""
        buffer = torch.zeros_like(like)
        for segment in layout.segments:
            self._views[segment.name][kind] = segment.of(buffer)
        return buffer

    def of_kind(self, kind: str) -> dict[str, torch.Tensor]:
        """Every parameter's flat state of ``kind`` by name: the live view where the parameter is
        bound to a bucket, else what was loaded for it (no copies)."""
        entries = {name: entry[kind] for name, entry in self._pending.items() if kind in entry}
        entries.update({name: views[kind] for name, views in self._views.items() if kind in views})
        return entries

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every parameter's state as standalone CPU tensors (never views of a bucket buffer)."""
        state = {name: {k: t.detach().cpu().clone() for k, t in views.items()} for name, views in self._views.items()}
        for name, pending in self._pending.items():
            state.setdefault(name, {k: t.clone() for k, t in pending.items()})
        return state

    def snapshot(self, previous: ByName | None = None) -> ByName:
        """Every parameter's state as copies on its own device (``previous``'s buffers reused where
        shape, dtype and device match), for :meth:`restore`; state loaded and not yet bound is
        taken as it is (nothing writes it until it is bound, and binding copies it)."""
        previous = previous or {}
        taken = {}
        for name, views in self._views.items():
            kept = previous.get(name, {})
            taken[name] = {kind: copy_into(kept.get(kind), view) for kind, view in views.items()}
        for name, pending in self._pending.items():
            taken.setdefault(name, dict(pending))
        return taken

    def restore(self, snapshot: ByName) -> None:
        """Return to :meth:`snapshot`'s state in place: bound buffers keep their storage (views that
        plans hold stay valid); a parameter bound since then from zeros is zeroed again, one bound
        from loaded state gets it back."""
        for name, views in self._views.items():
            saved = snapshot.get(name, {})
            for kind, view in views.items():
                if kind in saved:
                    view.copy_(saved[kind].reshape(-1))
                else:
                    view.zero_()
        self._pending = {name: dict(entry) for name, entry in snapshot.items() if name not in self._views}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace all state; it is copied into bucket buffers as buckets are next bound."""
        unknown = {key for entry in state.values() for key in entry} - set(self.kinds)
        if unknown:
            raise ValueError(f"unknown compression state entries {sorted(unknown)}; expected {list(self.kinds)}")
        self._views.clear()
        self._pending = {name: dict(entry) for name, entry in state.items()}


def copy_into(buffer: torch.Tensor | None, source: torch.Tensor) -> torch.Tensor:
    """``source`` copied into ``buffer`` where it fits, else into a new tensor like ``source``."""
    if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype or buffer.device != source.device:
        buffer = torch.empty_like(source)
    return buffer.copy_(source)
