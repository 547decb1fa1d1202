"""The vocabulary every layer shares, importing nothing else of the package.

* :mod:`~lightning_gc.common.layout`: a flat tensor (a DDP bucket, a fragment of parameters) as
  per-parameter segments; codecs encode per segment and memory keeps state per segment, so the
  layout sits below both (docs/ARCHITECTURE.md says why it is not in ``core/``).
* :mod:`~lightning_gc.common.flatstate`: per-parameter state stored flat, carried across re-bucketing.
* :mod:`~lightning_gc.common.validation`: one-line errors for bad arguments.
* :mod:`~lightning_gc.common.errors`: the exceptions front ends report to users.
* :mod:`~lightning_gc.common.log`: warnings and notices from rank zero, without Lightning.
* :mod:`~lightning_gc.common.outer_presets`: the outer loop's presets as plain data, for the front
  ends and the performance model (which sits below them); :mod:`~lightning_gc.common.outer_schedule`:
  the one rule on a streamed schedule that both check.
* :mod:`~lightning_gc.common.markdown`: the Markdown tables the CLIs print.
"""
