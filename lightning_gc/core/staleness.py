"""What a delayed update costs momentum SGD: the largest stable step on a quadratic.

Delayed synchronisation (:mod:`lightning_gc.exchanges.delay`) applies the update of step ``t`` at step
``t + d``: DGC's momentum-corrected velocity, or, without momentum correction, a stale average
that the optimizer's own momentum then accumulates (the same recurrence). On one direction of
curvature ``lambda`` of a quadratic, with ``h = lr * lambda`` and momentum ``m`` (heavy ball, as
``torch.optim.SGD`` and DGC's momentum correction)::

    u_t     = m u_{t-1} + h w_t          (the velocity, from the current weights)
    w_{t+1} = w_t - u_{t-d}              (applied d steps late)

is a linear recurrence of order ``d + 2``; it converges iff every root of its companion matrix lies
inside the unit circle. Without delay that holds for ``h < 2 (1 + m)``. One step of delay shrinks
it to ``h < 1 - m``: with ``m = 0.9`` from 3.8 to 0.1, a learning rate 38 times smaller before
the sharpest direction diverges. (Plain SGD, ``m = 0``, loses less: ``h < 2 sin(pi / (4d + 2))``,
1 at ``d = 1``.) Training then either lowers its learning rate or stays in flatter, slower
regions; the ResNet-20 run of ``benchmarks/accuracy.py`` lost 10.7 top-1 points at ``d = 1``.

OD-SGD's local update (``local_update=True``) applies each rank's own update at once and swaps it
for the average later; where the ranks' updates agree, the applied update is the fresh one and the
synchronous bound holds again, so only the ranks' disagreement is stale.
"""

from __future__ import annotations

import torch

from lightning_gc.common.validation import check_int, check_range


def spectral_radius(step: float, momentum: float, delay: int) -> float:
    """The largest root magnitude of the delayed heavy-ball recurrence (module docstring) at
    ``h = step``: below 1, the iterates converge.

    The state ``[w_t, u_{t-1}, ..., u_{t-1-d}]`` advances by the companion matrix whose rows say
    ``u_t = h w_t + m u_{t-1}``, ``u_{t-k}`` moves down one place, and ``w_{t+1} = w_t - u_{t-d}``.
    """
    order = delay + 2
    companion = torch.zeros(order, order, dtype=torch.float64)
    companion[1, 0], companion[1, 1] = step, momentum
    companion[2:, 1:-1] = torch.eye(delay, dtype=torch.float64)
    companion[0] = -companion[1 + delay]  # minus the row that yields u_{t-d} (u_t's own row at d = 0)
    companion[0, 0] += 1.0
    return float(torch.linalg.eigvals(companion).abs().max())


def stable_step_limit(momentum: float, delay: int) -> float:
    """The largest ``h = lr * curvature`` for which momentum SGD with updates applied ``delay``
    steps late converges on a quadratic (module docstring): ``2 (1 + m)`` at ``delay = 0``,
    ``1 - m`` at ``delay = 1``. Found by scanning up to the first unstable ``h``, then bisecting."""
    check_range("momentum", momentum, 0.0, 1.0, high_inclusive=False)
    check_int("delay", delay, 0)
    synchronous = 2.0 * (1.0 + momentum)
    if delay == 0:
        return synchronous
    grid = 256
    low = 0.0
    for i in range(1, grid + 1):
        high = synchronous * i / grid
        if spectral_radius(high, momentum, delay) >= 1.0:
            break
        low = high
    for _ in range(50):
        middle = 0.5 * (low + high)
        if spectral_radius(middle, momentum, delay) >= 1.0:
            high = middle
        else:
            low = middle
    return low


def staleness_warning(momentum: float, delay: int, local_update: bool) -> str | None:
    """What to tell a user who delays momentum SGD's update without the local update; ``None``
    when nothing is lost (no delay, no momentum, or ``local_update``)."""
    if delay == 0 or not 0.0 < momentum < 1.0 or local_update:
        return None  # (momentum >= 1 does not converge even without a delay)
    synchronous, delayed = stable_step_limit(momentum, 0), stable_step_limit(momentum, delay)
    return (
        f"delay={delay} applies each step's update {delay} step(s) late: with momentum "
        f"{momentum:g} the largest stable learning rate shrinks {synchronous / delayed:.0f}x (lr x curvature "
        f"< {delayed:.3g} instead of {synchronous:.3g}), which costs accuracy at a learning rate tuned without "
        "delay; local_update=True applies this rank's own update at once (OD-SGD), or lower the learning rate"
    )
