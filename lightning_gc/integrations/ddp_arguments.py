"""The keyword arguments Lightning's (and Fabric's) DDP strategies take, which the compression
strategies pass through to them."""

from __future__ import annotations

import inspect

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

OWNED_DDP_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
"""DDP arguments the compression strategies set themselves (their comm hook): refused when given."""


def ddp_argument_names(strategy_class: type = DDPStrategy) -> set[str]:
    """Keyword arguments a Lightning (or Fabric) DDP strategy class accepts, its own and those it
    forwards to DistributedDataParallel, less those the compression strategies set themselves."""
    set_by_lightning = {"self", "module", "device_ids", "output_device", "kwargs", *OWNED_DDP_ARGUMENTS}
    names = set(inspect.signature(strategy_class.__init__).parameters)
    names |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    return names - set_by_lightning
