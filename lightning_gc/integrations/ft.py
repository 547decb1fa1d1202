"""Fault-tolerant replica groups on torchft, in a plain PyTorch loop: a lost replica does not stop the others.

Each replica group (here: one process) trains the whole model; across replica groups the flat
gradient is compressed with error feedback and averaged over torchft's quorum
(:class:`~lightning_gc.exchanges.ft_transport.ManagerTransport` under a
:class:`~lightning_gc.exchanges.averager.CompressedAverager`)::

    gc = lightning_gc.fault_tolerant(model, optimizer, "dgc", lighthouse="http://host:29510",
                                     replica_id="0", compress_ratio=0.01)
    while gc.steps < total_steps:
        gc.zero_grad()                                # the step's quorum; a (re)joining replica heals here
        loss_fn(model(x), y).backward()
        gc.step()                                     # exchange; commit or roll back

One step, on replica ``r`` of the ``N`` taking part (``N`` may change from step to step)::

    e_r <- e_r + g_r;  s_r = C(e_r);  e_r <- e_r - s_r      error feedback (DGC/top-k codecs, biased)
    y    = (1/N) sum_r s_r                                   over the quorum
    should_commit():  p <- OptimizerStep(p, y); steps += 1   on every replica whose collectives succeeded
    otherwise:        e_r, codec state, sampling salt <- as before the step; no optimizer step

What happens to the compression state when the quorum changes:

* a replica that leaves (killed, pre-empted): the survivors' collectives fail, their step is rolled
  back (their residuals are restored: their unsent gradient mass is kept), the next quorum goes on
  without it. **The dead replica's residual ``e_r`` is lost**: it was gradient mass that replica
  owed the global update and nobody else holds it.
* a replica that (re)joins heals from a live peer (torchft's checkpoint transport): model,
  optimizer, the step count, the codec's shared state (e.g. PowerSGD's ``Q``) and the sampling salt.
  **Its own residuals start at zero** (those of the peer are the peer's); what it held before, if it
  was alive and lagging, is dropped and counted in :attr:`FaultTolerantCompression.dropped_residual`
  (the L1 norm; a restarted process held nothing).
* survivors keep their residuals: they are per replica and remain owed whatever ``N`` is.

Momentum correction (DGC's ``u``) is not used here: the optimizer keeps its own momentum and the
memory holds residuals only, as in :class:`~lightning_gc.exchanges.averager.CompressedAverager`.

A replica whose compression settings differ from those of the peer it heals from is refused with
one line (``ValueError``); every (re)joining replica heals (with torchft's default ``init_sync``
also at step 0), so every replica is compared with the quorum's. One process per replica group:
a group of several processes (data parallel inside the group) is not supported yet.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from datetime import timedelta
from typing import Any

import torch

from lightning_gc.common.validation import check_int, check_range
from lightning_gc.compressors.registry import create
from lightning_gc.exchanges.averager import CompressedAverager
from lightning_gc.exchanges.ft_transport import ManagerTransport

STATE_KEY = "lightning_gc"
"""The key of this front end's state among the manager's registered state dicts."""


class QuorumMember:
    """What a front end over a torchft quorum shares: the manager, the counters of rolled-back
    steps and heals, and the healing of the codec's shared state. A subclass sets ``settings``
    (compared with the peer's on healing), calls :meth:`join_quorum` at the end of its constructor,
    and implements ``_healing_state`` / ``_heal`` with :meth:`codec_healing_state` /
    :meth:`adopt_codec_state`.

    Attributes:
        rolled_back: steps (syncs) whose exchange failed or was not committed; ``healed``: times
        this replica healed from a peer; ``dropped_residual``: L1 norm of the residuals dropped on
        healing (this replica's own, which the peer's state does not carry).
    """

    manager: Any
    settings: dict[str, Any]

    def join_quorum(self, manager: Any) -> None:
        """Start counting and register this front end's healing state with ``manager``."""
        self.manager = manager
        self.rolled_back = 0
        self.healed = 0
        self.dropped_residual = 0.0
        manager.register_state_dict_fn(STATE_KEY, self._heal, self._healing_state)

    @property
    def participants(self) -> int:
        """Replica groups taking part in the current quorum."""
        return int(self.manager.num_participants())

    def close(self) -> None:
        """Shut the manager down (its server and checkpoint transport)."""
        self.manager.shutdown(wait=False)

    @staticmethod
    def codec_healing_state(averager_state: dict[str, Any]) -> dict[str, Any]:
        """What a recovering replica takes of an averager's state: the codec's shared state and
        its call count (the sampling salt), never the residuals (they are this replica's)."""
        return {"calls": averager_state["calls"], "compressor_state": averager_state["compressor_state"]}

    def adopt_codec_state(self, averager: CompressedAverager, state: dict[str, Any]) -> dict[str, Any]:
        """``averager``'s state with the peer's shared codec state (``state``, from
        :meth:`codec_healing_state`) and empty residuals; the residuals dropped are counted."""
        check_settings(self.settings, state["settings"])
        self.dropped_residual += float(averager.residual().abs().sum())
        own = averager.state_dict()
        own.update(calls=state["calls"], compressor_state=state["compressor_state"], memory={})
        self.healed += 1
        return own

    def _healing_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _heal(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


def refuse_point_to_point(codec: Any) -> None:
    """Refuse, before any step, a codec whose exchange needs point-to-point rounds (global
    top-k's merges): torchft's quorum runs collectives only, so every step would fail."""
    if codec.config().get("exchange") == "global_topk":
        raise ValueError(
            f"compressor {codec.name!r} with exchange='global_topk' needs point-to-point rounds, which torchft's "
            "quorum does not run: use exchange='gather' (the default) or 'two_phase'"
        )


class FaultTolerantCompression(QuorumMember):
    """One replica group's model and optimizer with a compressed, error-fed exchange over a torchft
    quorum (module docstring). Build it with :func:`fault_tolerant`, or here around a manager of
    your own (built with ``use_async_quorum=False``, ``load_state_dict=None, state_dict=None``: this
    registers its own healing state).

    Args:
        model: the replica's model; every trainable parameter is exchanged, in ``named_parameters`` order.
        optimizer: its optimizer, stepped only on committed steps.
        manager: the replica's ``torchft.Manager``.
        group: the torchft process group given to ``manager``.
        compressor: a registered compressor name (arguments in ``compressor_arguments``), e.g.
            ``"dgc"``, ``"topk"``, ``"powersgd"``; not with ``exchange="global_topk"`` (no
            point-to-point rounds over torchft's quorum).
        error_feedback, error_decay: as for :class:`~lightning_gc.exchanges.averager.CompressedAverager`.

    Attributes:
        steps: committed steps (equal to ``manager.current_step()``); ``rolled_back``: steps whose
        exchange failed or was not committed; ``healed``: times this replica healed from a peer;
        ``dropped_residual``: L1 norm of the residuals dropped on healing.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        manager: Any,
        group: Any,
        compressor: str = "dgc",
        *,
        error_feedback: bool | None = None,
        error_decay: float = 1.0,
        **compressor_arguments: Any,
    ) -> None:
        self.model, self.optimizer, self.manager = model, optimizer, manager
        self.parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters to exchange")
        codec = create(compressor, **compressor_arguments)
        refuse_point_to_point(codec)
        self.averager = CompressedAverager(
            codec,
            [(name, tuple(p.shape)) for name, p in self.parameters],
            error_feedback=error_feedback,
            error_decay=error_decay,
            via=ManagerTransport(manager, group),
        )
        memory = self.averager.memory.config()
        self.settings = {"compressor": self.averager.compressor.config(), "memory": memory}
        self.steps = 0
        self.join_quorum(manager)

    # ------------------------------------------------------------------ each step

    def zero_grad(self) -> None:
        """Start the step: the quorum (a replica that joins or lags heals from a live peer here,
        before its forward pass) and the optimizer's ``zero_grad``. Call before the forward pass."""
        self.manager.start_quorum()
        self.optimizer.zero_grad()

    def step(self) -> bool:
        """After ``backward()``: exchange the flat gradient over the quorum, then step the optimizer
        with the average if the manager commits the step (``manager.should_commit()``: no error in
        this replica group, enough replicas); otherwise restore the residuals and codec state to
        before the step and skip the optimizer. A replica that committed while another did not is
        a step ahead; torchft heals the one behind at the next quorum. Returns whether the step was
        committed."""
        flat = torch.cat([_grad(p).reshape(-1) for _, p in self.parameters])
        before = self._snapshot()
        average = None
        try:
            average = self.averager.average(flat).wait()
        except Exception as error:  # a dead peer or a timeout: the step is lost, not the run
            self.manager.report_error(error)
        if self.manager.should_commit():
            assert average is not None  # an error reported above makes should_commit false
            offset = 0
            for _, p in self.parameters:
                piece = average[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
            self.optimizer.step()
            self.steps += 1
            return True
        self.averager.load_state_dict(before)
        self.rolled_back += 1
        return False

    def _snapshot(self) -> dict[str, Any]:
        state = self.averager.state_dict()  # memory: copies already
        state["compressor_state"] = copy.deepcopy(state["compressor_state"])
        return state

    # ------------------------------------------------------------------ healing
    def _healing_state(self) -> dict[str, Any]:
        """What a recovering replica takes from this one (never the residuals: they are this one's)."""
        return {
            "settings": self.settings,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            **self.codec_healing_state(self.averager.state_dict()),
        }

    def _heal(self, state: dict[str, Any]) -> None:
        own = self.adopt_codec_state(self.averager, state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.averager.load_state_dict(own)


def fault_tolerant(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    compressor: str = "dgc",
    *,
    lighthouse: str,
    replica_id: str,
    min_replicas: int = 1,
    timeout: float = 30.0,
    **kwargs: Any,
) -> FaultTolerantCompression:
    """Join the torchft quorum run by the lighthouse at ``lighthouse`` as replica group
    ``replica_id`` (one process) and return the handle that steps ``optimizer``.

    Args:
        lighthouse: the lighthouse's address, e.g. ``"http://127.0.0.1:29510"``.
        replica_id: this replica group's name, unique among the groups (a restarted group keeps it).
        min_replicas: the fewest replica groups a step may commit with.
        timeout: seconds for a collective, a commit vote, a heal or a connection (a quorum gets
            twice as long); a dead peer costs at most this much.
        **kwargs: the compressor's arguments and ``error_feedback`` / ``error_decay``.

    The replica group's TCP store is torchrun's (``MASTER_ADDR``/``MASTER_PORT``) when those are
    set, else one this process hosts on loopback.

    Raises:
        ConnectionError: the lighthouse cannot be reached (one line naming its address).
        ValueError: a bad argument, or a replica group of several processes.
    """
    manager, group, store = join(lighthouse, replica_id, min_replicas, timeout)
    handle = FaultTolerantCompression(model, optimizer, manager, group, compressor, **kwargs)
    handle._store = store  # the replica group's store lives as long as the handle
    return handle


def join(lighthouse: str, replica_id: str, min_replicas: int, timeout: float) -> tuple[Any, Any, Any]:
    """A ``torchft.Manager`` with a synchronous quorum for this one-process replica group, its
    gloo process group and the group's TCP store when this process hosts it (else ``None``);
    the arguments as for :func:`fault_tolerant`."""
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo

    min_replicas = check_int("min_replicas", min_replicas, 1)
    seconds = check_range("timeout", timeout, 0.0, low_inclusive=False)
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError(
            f"fault_tolerant runs one process per replica group, got WORLD_SIZE={os.environ['WORLD_SIZE']}: "
            "start each group with torchrun --nproc_per_node=1"
        )
    store = None
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        address, port = "127.0.0.1", store.port
    limit = timedelta(seconds=seconds)
    group = ProcessGroupGloo(timeout=limit)
    try:
        manager = Manager(
            pg=group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replicas,
            use_async_quorum=False,
            timeout=limit,
            quorum_timeout=2 * limit,
            connect_timeout=limit,
            rank=0,
            world_size=1,
            store_addr=address,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
        )
    except RuntimeError as error:
        if "failed to connect" not in str(error):
            raise
        raise ConnectionError(
            f"cannot reach the torchft lighthouse at {lighthouse} within {seconds:g} s: start it "
            f"(torchft_lighthouse --min_replicas {min_replicas} --bind [::]:PORT) or fix `lighthouse`"
        ) from None
    return manager, group, store


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def check_settings(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Refuse, in one line naming both, compression settings other than the peer's."""
    if fingerprint(mine) != fingerprint(theirs):
        raise ValueError(
            f"this replica's compression settings {_describe(mine)} differ from the quorum's "
            f"{_describe(theirs)}: start it with the same compressor arguments"
        )


def _describe(settings: dict[str, Any]) -> str:
    """``name(argument=value, ...)``, the memory's settings after the codec's."""
    arguments = dict(settings["compressor"])
    name = arguments.pop("name")
    arguments.update(settings["memory"])
    return f"{name}({', '.join(f'{k}={v}' for k, v in sorted(arguments.items()))})"
