"""Hydra entry point.

    python train.py                                  # quickstart: DGC vs dense DDP on digits, 2 CPU processes
    python train.py +recipe=resnet50_dgc             # a paper recipe (configs/recipe/)
    python train.py -m +recipe=resnet20_cifar10_dgc strategy.compress_ratio=0.001,0.01,0.1
    python -m recipes.report multirun/<date>/<time>

Each run writes result.json / result.csv into its Hydra output directory (see recipes/app.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import lightning_gc  # noqa: F401  (registers the strategy names)
from lightning_gc.runtime.teardown import shut_down_process_group_at_exit
from recipes.app import UsageError, quiet_foreign_noise, run
from recipes.results import discard_unused_run_dir

quiet_foreign_noise()  # module level: Lightning's launcher re-runs this file in the other ranks


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    try:
        run(
            cfg,
            Path(hydra_cfg.runtime.output_dir),
            multirun=hydra_cfg.mode == RunMode.MULTIRUN,
            overrides=list(hydra_cfg.overrides.task),
        )
        shut_down_process_group_at_exit()  # dense runs too: Lightning leaves gloo's group to finalization
    except UsageError as error:  # the user's mistake: one line, no traceback
        discard_unused_run_dir(Path(hydra_cfg.runtime.output_dir))  # every rank: see there
        print(f"train.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
