"""Front ends, and the only place that imports Lightning.

* :mod:`~lightning_gc.integrations.strategy`: the Trainer strategies (``"dgc_ddp"``, ``"<compressor>_ddp"``).
* :mod:`~lightning_gc.integrations.fabric`: the same for Lightning Fabric.
* :mod:`~lightning_gc.integrations.attach`: a plain ``DistributedDataParallel`` loop (imports no Lightning).
* :mod:`~lightning_gc.integrations.callbacks`: DGC's sparsity warm-up as a Trainer callback.
* :mod:`~lightning_gc.integrations.registry`: the strategy names registered with Lightning.
"""
