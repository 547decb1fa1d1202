"""How a flat tensor's encoded rounds move between ranks, and the pipeline that runs them.

* :mod:`~lightning_gc.exchanges.pipeline`: one flat tensor through screen -> compensate -> encode
  -> exchange -> decode -> commit (``run_bucket``), the same for a DDP bucket and any other.
* :mod:`~lightning_gc.exchanges.transport`: moving one round (``Transport``): torch.distributed
  collectives over any process group, or a local stand-in for calibration and benchmarks.
* :mod:`~lightning_gc.exchanges.comm`: the collectives as futures of their output.
* :mod:`~lightning_gc.exchanges.traffic`: bytes on the wire per kind of exchange.
* :mod:`~lightning_gc.exchanges.base`: the ``Exchange`` interface and the flat exchange;
  :mod:`~lightning_gc.exchanges.two_phase`, :mod:`~lightning_gc.exchanges.global_topk`: the
  exchanges that build a codec's rounds from a capability; :mod:`~lightning_gc.exchanges.select`:
  which one a codec's ``exchange`` argument chooses.
* :mod:`~lightning_gc.exchanges.delay`: a delayed exchange (the average applied steps later).
* :mod:`~lightning_gc.exchanges.hierarchy`, :mod:`~lightning_gc.exchanges.hierarchy_sparse`: the
  two-level node exchanges.
"""
