"""The update maths, on one rank, with no collectives: what a gradient becomes before it is sent
and what stays behind.

* :mod:`~lightning_gc.core.memory`: DGC's compensation memory (local clipping, momentum correction,
  residuals, momentum factor masking); error feedback for every biased codec.
* :mod:`~lightning_gc.core.momentum`: SGD's momentum and weight decay read out of the optimizer,
  and its momentum-free step.
* :mod:`~lightning_gc.core.handover`: optimizer state that memory takes over (the interface; SGD's
  momentum and weight decay); :mod:`~lightning_gc.core.adam`: Adam/AdamW's frozen-variance
  hand-over; :mod:`~lightning_gc.core.handover_choice`: which of them a run's optimizers get.
* :mod:`~lightning_gc.core.staleness`: the stability limit of a delayed momentum update.
* :mod:`~lightning_gc.core.guard`: the step as a transaction: screen a non-finite gradient, back
  memory and codec state up, roll them back (the agreement across ranks is passed in).
"""
