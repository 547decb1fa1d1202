"""Start test ranks by forking a warm interpreter instead of starting a fresh one.

Importing torch and Lightning costs a rank process about 5 s of CPU (Lightning pulls in
torchmetrics, torchvision and torch._dynamo), more than most of the multi-process tests' own
training. ``tests/conftest.py`` therefore keeps one multiprocessing *forkserver* for the session
that has imported them once (:data:`PRELOAD`), and each rank is a fork of it that runs its worker
script as ``__main__`` with the rank's environment, its output in the rank's log file.

A forked rank differs from a fresh interpreter in what the preloaded modules did at import
(they start no thread: the server is single-threaded when it forks; Lightning's rank-zero rank,
read from the environment at import, is set again here), in sharing the server's hash seed and
global random states (every worker seeds its own), and in its exit: the worker's ``atexit``
functions run, but not the interpreter's finalization (no join of its threads). Tests of what
happens at interpreter exit, and ranks that need environment variables read at import, start
fresh processes (``fresh=True`` or ``env`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import runpy
import sys

PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_gc", "recipes.quickstart"]
"""What the forkserver imports once, before it forks any rank."""


def run_rank(script: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked rank: take ``env`` as the whole environment, send stdout and stderr to
    ``log_path``, run ``script`` as ``__main__`` with ``argv``; exit with its status."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable()  # as PYTHONFAULTHANDLER=1 does for a fresh rank
    _take_rank_zero_rank(int(env.get("RANK", "0")))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    code: int | str | None = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # as the interpreter prints a SystemExit message
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _take_rank_zero_rank(rank: int) -> None:
    """Lightning reads the rank for its ``rank_zero_*`` helpers from the environment when it is
    imported, which in the forkserver was before any rank existed: set what a fresh rank would
    have read."""
    for name in ("lightning_utilities.core.rank_zero", "lightning.fabric.utilities.rank_zero"):
        module = sys.modules.get(name)
        if module is not None:
            module.rank_zero_only.rank = rank  # type: ignore[attr-defined]
