"""Time to accuracy on two emulated nodes (issue #52): ``python -m benchmarks.time_to_accuracy --help``.

Modules, one job each (netbench's namespaces, socket test, launch environment and predictions
are reused by import, not copied):

* :mod:`.tasks` -- the CIFAR-10 ResNet-20 and PTB LSTM tasks (and smoke twins): data, model, metric;
* :mod:`.modes` -- every mode as one plain-DDP loop sees it: torch's hooks and averager, ours
  through ``lightning_gc.attach``, the outer-loop presets; each step's *kind*;
* :mod:`.traffic` -- bytes a process sent over TCP, for any mode;
* :mod:`.worker` -- one node: the training loop, evaluations at fixed intervals, the records;
* :mod:`.phases` -- trajectories on loopback, step times per shaped link, end-to-end checks;
* :mod:`.compose` -- time-to-target from trajectory x step times, ratios, the table;
* :mod:`.report` -- per-task report, chart and the performance model's predictions.
"""
