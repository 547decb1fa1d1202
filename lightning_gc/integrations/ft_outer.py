"""The outer loop (DiLoCo, SparseLoCo) over fault-tolerant torchft replica groups: one quorum per sync.

Each replica group (one process) trains alone for ``sync_every`` inner steps, then the groups of
the quorum exchange compressed, error-fed pseudo-gradients and take one outer step, as
:class:`~lightning_gc.runtime.outer.OuterLoop` does over a process group; here the exchange runs
over torchft's quorum (:class:`~lightning_gc.exchanges.ft_transport.ManagerTransport`) and the unit
torchft commits or rolls back is one sync::

    gc = lightning_gc.fault_tolerant_outer(model, optimizer, "topk", sync_every=30, compress_ratio=0.02,
                                           lighthouse="http://host:29510", replica_id="0")
    while gc.syncs < total_syncs:
        gc.begin()                                     # the period's quorum; a (re)joining group heals here
        for _ in range(gc.sync_every):
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
        gc.sync()                                      # exchange; outer step, or roll back

One sync, on group ``r`` of the ``N`` in the quorum (one fragment of
:class:`~lightning_gc.runtime.outer_fragments.Fragment`, no streaming)::

    delta_r = theta_g - theta_r;  e_r <- beta e_r + delta_r;  s_r = C(e_r);  e_r <- e_r - s_r
    y = (1/N) sum_r s_r                               over the quorum
    should_commit():  theta_g <- OuterSGD(theta_g, y);  theta_r <- theta_g;  syncs += 1
    otherwise:        theta_g, outer momentum, e_r, codec state <- as before the sync; theta_r is kept,
                      so the next sync's pseudo-gradient covers both periods (no inner step is lost)

Healing (at :meth:`FaultTolerantOuterLoop.begin`): a (re)joining group takes from a live peer
``theta_g``, the outer optimizer's momentum, the module (``theta_r``), the inner optimizer, the
sync count and the codec's shared state; its own residuals start at zero (the peer's are the
peer's; a dead group's residuals are lost with it, as in :mod:`lightning_gc.integrations.ft`).
A group whose compression or outer settings differ from the peer's is refused with one line.
Floating-point buffers (BatchNorm statistics) are not averaged over the quorum here: use models
without them, or accept that each group keeps its own.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from lightning_gc.common.validation import check_int
from lightning_gc.exchanges.averager import CompressedAverager
from lightning_gc.exchanges.ft_transport import ManagerTransport
from lightning_gc.integrations.ft import QuorumMember, join, refuse_point_to_point
from lightning_gc.runtime.outer_fragments import Fragment, OuterSGD


class FaultTolerantOuterLoop(QuorumMember):
    """One replica group's outer loop over a torchft quorum (module docstring). Build it with
    :func:`fault_tolerant_outer`, or here around a manager of your own (``use_async_quorum=False``,
    no state dict functions of its own).

    Args:
        model: the replica's model (``theta_r``); its trainable parameters are synchronised.
        optimizer: the inner optimizer; the caller steps it, its state is kept across syncs.
        manager, group: the replica's ``torchft.Manager`` and the torchft process group given to it.
        sync_every: inner steps per sync (``H``), >= 1.
        compressor: a registered compressor name (arguments in ``compressor_arguments``);
            ``"none"``: the exact average (DiLoCo).
        outer: the outer SGD (default DiLoCo's: lr 0.7, momentum 0.9, Nesterov).
        error_decay: ``beta``, in (0, 1].

    Attributes:
        syncs: committed syncs (torchft's step count); ``rolled_back``, ``healed``,
        ``dropped_residual``: as in :class:`~lightning_gc.integrations.ft.FaultTolerantCompression`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        manager: Any,
        group: Any,
        *,
        sync_every: int,
        compressor: str = "none",
        outer: OuterSGD | None = None,
        error_decay: float = 1.0,
        **compressor_arguments: Any,
    ) -> None:
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.model, self.optimizer, self.manager = model, optimizer, manager
        self.outer = OuterSGD() if outer is None else outer
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"`model` ({type(model).__name__}) has no trainable parameters: nothing to sync")
        averager = CompressedAverager(
            compressor,
            [(name, tuple(p.shape)) for name, p in named],
            error_decay=error_decay,
            via=ManagerTransport(manager, group),
            **compressor_arguments,
        )
        refuse_point_to_point(averager.compressor)
        self.fragment = Fragment(0, 0, [p for _, p in named], averager, self.outer)
        self.settings = {
            "compressor": averager.compressor.config(),
            "memory": {**averager.memory.config(), "sync_every": self.sync_every, **asdict(self.outer)},
        }
        self.join_quorum(manager)

    @property
    def syncs(self) -> int:
        """Committed syncs."""
        return self.fragment.syncs

    @property
    def global_parameters(self) -> list[torch.Tensor]:
        """``theta_g``, in parameter order (the live tensors: read, do not modify)."""
        return self.fragment.globals

    def begin(self) -> None:
        """Start a period of ``sync_every`` inner steps: its quorum (a group that joins or lags
        heals here, before its first inner step)."""
        self.manager.start_quorum()

    def sync(self) -> bool:
        """After the period's inner steps: exchange the pseudo-gradients over the quorum and take
        the outer step if the manager commits the sync; otherwise put ``theta_g``, the outer
        momentum, the residuals and the codec state back (``theta_r`` is kept). Returns whether
        the sync was committed."""
        before = self.fragment.state_dict()
        globals_before = [g.clone() for g in self.fragment.globals]
        error = None
        try:
            self.fragment.launch(self.syncs)
            self.fragment.in_flight.average.wait()  # type: ignore[union-attr]
        except Exception as failure:  # a dead peer or a timeout: the sync is lost, not the run
            error = failure
            self.manager.report_error(failure)
        if self.manager.should_commit():
            assert error is None  # an error reported above makes should_commit false
            self.fragment.land(0.0)
            return True
        self.fragment.load_state_dict(before, self.outer)
        with torch.no_grad():
            for theta_g, saved in zip(self.fragment.globals, globals_before):
                theta_g.copy_(saved)
        self.rolled_back += 1
        return False

    # ------------------------------------------------------------------ healing
    def _healing_state(self) -> dict[str, Any]:
        state = self.fragment.state_dict()
        averager = state.pop("averager")  # the residuals stay here; the codec's shared state goes
        return {
            "settings": self.settings,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "globals": [g.detach().clone() for g in self.fragment.globals],
            "fragment": state,
            **self.codec_healing_state(averager),
        }

    def _heal(self, state: dict[str, Any]) -> None:
        own = self.adopt_codec_state(self.fragment.averager, state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.fragment.load_state_dict({**state["fragment"], "averager": own}, self.outer)
        with torch.no_grad():
            for theta_g, theirs in zip(self.fragment.globals, state["globals"]):
                theta_g.copy_(theirs)


def fault_tolerant_outer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    compressor: str = "none",
    *,
    lighthouse: str,
    replica_id: str,
    min_replicas: int = 1,
    timeout: float = 30.0,
    **kwargs: Any,
) -> FaultTolerantOuterLoop:
    """Join the torchft quorum at ``lighthouse`` as replica group ``replica_id`` (one process) and
    return the outer loop that syncs ``model``; ``kwargs``: ``sync_every`` (required), ``outer``,
    ``error_decay`` and the compressor's arguments. The rest as for
    :func:`~lightning_gc.integrations.ft.fault_tolerant` (same errors)."""
    manager, group, store = join(lighthouse, replica_id, min_replicas, timeout)
    loop = FaultTolerantOuterLoop(model, optimizer, manager, group, compressor=compressor, **kwargs)
    loop._store = store  # the replica group's store lives as long as the loop
    return loop
