"""The outer loop's streaming schedule rule, in the one layer both of its users import: the runtime
(:class:`~lightning_gc.runtime.outer_fragments.Streaming`) and the performance model
(:class:`~lightning_gc.perfmodel.outer.OuterSchedule`).

With ``P = fragments`` at offsets ``p H // P`` (consecutive launches ``floor(H/P)`` or
``ceil(H/P)`` inner steps apart) and ``tau = sync_delay``, the rule is ``tau P < H``, i.e.
``tau < H / P``. Then ``tau <= floor(H/P)``: a fragment's exchange is waited for at the latest at
the step the next fragment launches (that launch comes first within the step), so at most two
exchanges are in flight at once and each fragment's lands long before its own next launch.
"""

from __future__ import annotations


def check_sync_delay(sync_every: int, fragments: int, sync_delay: int) -> int:
    """``sync_delay`` if ``sync_delay * fragments < sync_every`` (the arguments already checked as
    integers: ``sync_every``, ``fragments`` >= 1, ``sync_delay`` >= 0).

    Raises:
        ValueError: in one line, naming the value and the bound.
    """
    if sync_delay * fragments >= sync_every:
        raise ValueError(
            f"`sync_delay` must be below sync_every / fragments = {sync_every}/{fragments} = "
            f"{sync_every / fragments:g}, got {sync_delay}: a fragment's exchange must land by the step the next "
            "fragment launches"
        )
    return sync_delay
