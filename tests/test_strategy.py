"""Strategy wiring that needs no process group: registration and checkpoint guards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gc import DGCStrategy
from lightning_gc.runtime.checkpoint import CHECKPOINT_KEY


def test_names_are_registered_once_and_reregistration_is_harmless() -> None:
    assert {"dgc_ddp", "dgc_ddp_spawn"} <= set(StrategyRegistry.available_strategies())
    DGCStrategy.register_strategies(StrategyRegistry)  # what a re-import does: must not raise
    spawn = StrategyRegistry.get("dgc_ddp_spawn")
    assert isinstance(spawn, DGCStrategy) and spawn._start_method == "spawn"
    assert StrategyRegistry.get("dgc_ddp")._start_method == "popen"


def test_resuming_at_another_world_size_reshards_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    """Outside a Trainer the world size is 1: a 2-rank entry is re-sharded (runtime.reshard, tested
    in depth in test_reshard.py) with a notice; a hierarchy='node' entry is refused in one line."""
    path = tmp_path / "two_ranks.ckpt"
    torch.save({CHECKPOINT_KEY: {"format": 1, "world_size": 2, "ranks": [{}, {}]}}, path)
    with pytest.warns(UserWarning, match="2 ranks and this run has 1: every rank resumes with the saved ranks. mean"):
        DGCStrategy().load_checkpoint(path)
    node = [{"hierarchy": (2, 1)}, {"hierarchy": (2, 1)}]
    torch.save({CHECKPOINT_KEY: {"format": 1, "world_size": 2, "ranks": node}}, path)
    with pytest.raises(ValueError, match=r"hierarchy='node'.*resume with 2 processes"):
        DGCStrategy().load_checkpoint(path)


def test_checkpoint_without_compression_state_loads(tmp_path: Path) -> None:
    path = tmp_path / "plain_ddp.ckpt"
    torch.save({"state_dict": {}}, path)
    assert DGCStrategy().load_checkpoint(path) == {"state_dict": {}}


def test_a_misspelt_argument_is_refused_with_the_close_name() -> None:
    from lightning_gc import DGCStrategy, GradientCompressionStrategy

    with pytest.raises(ValueError, match=r"`compres_ratio`: did you mean `compress_ratio`\?"):
        DGCStrategy(compres_ratio=0.01)
    with pytest.raises(ValueError, match=r"`bucket_cap_mbb`: did you mean `bucket_cap_mb`\?"):
        GradientCompressionStrategy("topk", bucket_cap_mbb=25)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \{'zzz': 1\} for DGCStrategy: compressor"):
        DGCStrategy(zzz=1)  # nothing close: no suggestion
