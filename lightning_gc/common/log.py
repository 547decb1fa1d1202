"""Warnings and notices from rank zero only, without Lightning (plain-DDP users have none).

A warning goes through :func:`warnings.warn` (so ``pytest.warns`` and ``-W`` filters see it), a
notice through the ``lightning_gc`` logger at INFO. Like Lightning's own loggers, that logger gets a
stream handler of its own when the application configured no logging, so notices print by default.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch.distributed as dist

logger = logging.getLogger("lightning_gc")
logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    logger.addHandler(logging.StreamHandler())
    logger.propagate = False


def is_rank_zero() -> bool:
    """Whether this process is global rank 0: the default group's rank once it exists, before that
    the launcher's ``RANK`` (torchrun) or ``SLURM_PROCID`` (srun); a lone process is rank 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    for variable in ("RANK", "SLURM_PROCID"):
        if variable in os.environ:
            return int(os.environ[variable]) == 0
    return True


def warn_on_rank_zero(message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) on rank zero; nothing elsewhere."""
    if is_rank_zero():
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def notify_on_rank_zero(message: str) -> None:
    """Log ``message`` at INFO on the ``lightning_gc`` logger, on rank zero only."""
    if is_rank_zero():
        logger.info(message)
