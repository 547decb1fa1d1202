"""A training run's compression, without Lightning: the DDP comm hook, its lifecycle and its state.

* :mod:`~lightning_gc.runtime.session`: one ``CompressionSession`` under every front end (attach to
  DDP, hand momentum over, settle each step, checkpoint, finish).
* :mod:`~lightning_gc.runtime.hook`: the DDP comm hook and its per-run state.
* :mod:`~lightning_gc.runtime.settings`: the validated settings of a run.
* :mod:`~lightning_gc.runtime.adam_plan`: the Adam hand-over's warm-up from the run's length, and
  the density floor of a short compressed phase.
* :mod:`~lightning_gc.runtime.checkpoint`, :mod:`~lightning_gc.runtime.consistency`: every rank's
  state in one checkpoint entry; the same setup and parameters on every rank.
* :mod:`~lightning_gc.runtime.outer`: the DiLoCo-family outer loop (``OuterLoop``): ``sync_every``
  inner steps, then a compressed, error-fed pseudo-gradient and an outer SGD step.
* :mod:`~lightning_gc.runtime.policy`, :mod:`~lightning_gc.runtime.selective`: which buckets to compress.
* :mod:`~lightning_gc.runtime.stats`, :mod:`~lightning_gc.runtime.usage`,
  :mod:`~lightning_gc.runtime.teardown`: statistics, parameters used per step, process-group shutdown.
"""
