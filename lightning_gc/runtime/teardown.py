"""Shutting a finished run's gloo process group down while the interpreter can still run its threads.

A gloo worker thread keeps the last collective it ran until it picks the next one. If it is the last
holder of a tensor whose Python object outlived its Python references, releasing that tensor needs
the GIL. Once the interpreter is finalizing, a thread that asks for the GIL is ended with
``pthread_exit``, which aborts the process ("terminate called without an active exception",
SIGABRT) after a run that finished normally. Finalization meets those threads when it frees the last
reference to the process group (the DDP model's reducer and our hook state hold it): the group's
destructor joins its worker threads, and a worker still holding such a collective then asks for the
GIL. ``destroy_process_group()`` alone does not stop the threads while a DDP model still holds the
group; freeing every holder does, and it must happen before finalization.
"""

from __future__ import annotations

import atexit
import functools
import gc

import torch.distributed as dist


def shut_down_process_group() -> None:
    """Destroy the default process group if one is up (a no-op after the user's own), then collect
    garbage: the unreachable DDP models, hook states and futures of finished runs go now, and with
    the last of them the group's destructor joins its worker threads while they can still take the GIL.

    Invariant: only call it once nothing is in flight (training ended normally); a rank failing
    mid-step would wait in the shutdown for its pending collectives until the timeout.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@functools.cache
def shut_down_process_group_at_exit() -> None:
    """Run :func:`shut_down_process_group` at interpreter exit (registered once per process, so
    exit handlers registered later, which run earlier, still find the group). It frees what is
    unreachable; a DDP model the script still holds in a module global lives into finalization, so
    scripts keep their training loop in a function (as ``examples/torchrun_dgc.py`` does)."""
    atexit.register(shut_down_process_group)
