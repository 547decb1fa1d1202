"""Which parameters got a gradient in the backward passes of a step, as DDP sees it.

DDP calls a parameter unused when its gradient accumulator did not run in the backward pass, not
when its ``grad`` is ``None``: a gradient zeroed with ``zero_grad(set_to_none=False)`` stays a
(zero) tensor, so ``param.grad is not None`` would call every such parameter used, and an average
handed to a parameter no rank used would be lost (DDP leaves that parameter's ``grad`` alone).
:class:`GradientUsage` follows autograd instead, with a post-accumulate-grad hook on every
parameter. That hook runs inside the accumulator, before DDP's own hook on the same accumulator
marks the parameter ready, so by the time a bucket's comm hook runs, every parameter of the
bucket that got a gradient is marked. Microbatches under ``no_sync`` mark into the same record,
as DDP's own used map accumulates over them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.utils.hooks import RemovableHandle


class GradientUsage:
    """The parameters whose gradient accumulator ran since each was last :meth:`take`-n."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        self._used: set[int] = set()
        self._handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._mark) for param in parameters if param.requires_grad
        ]

    def _mark(self, param: torch.Tensor) -> None:
        self._used.add(id(param))

    def take(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """Whether each of ``params`` got a gradient since it was last taken; forgets them, so the
        next synchronised step starts from nothing."""
        used = [id(param) in self._used for param in params]
        self._used.difference_update(id(param) for param in params)
        return used

    def remove(self) -> None:
        """Take the hooks off the parameters (the model outlives the training that watched it)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._used.clear()
