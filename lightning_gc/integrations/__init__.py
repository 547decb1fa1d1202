"""Front ends, and the only place that imports Lightning.

* :mod:`~lightning_gc.integrations.strategy`: the Trainer strategy (``"<compressor>_ddp"``);
  :mod:`~lightning_gc.integrations.dgc`: its DGC preset (``"dgc_ddp"``).
* :mod:`~lightning_gc.integrations.ddp_arguments`: what Lightning's DDP strategies take.
* :mod:`~lightning_gc.integrations.fabric`: the same for Lightning Fabric.
* :mod:`~lightning_gc.integrations.attach`: a plain ``DistributedDataParallel`` loop (imports no Lightning).
* :mod:`~lightning_gc.integrations.callbacks`: DGC's sparsity warm-up as a Trainer callback.
* :mod:`~lightning_gc.integrations.registry`: the strategy names registered with Lightning.
"""
