"""Accuracy evidence: dense DDP and compressed training side by side, trained to a result.

    python -m benchmarks.accuracy cifar10                 # run what is missing, then the table and curves
    python -m benchmarks.accuracy cifar10 --report-only   # table and curves of the runs finished so far
    python -m benchmarks.accuracy ptb_adamw --steps 600 --freeze 120
    python -m benchmarks.accuracy gpt2_ptb_adamw --steps 600   # pip install transformers

Each run is ``python train.py +recipe=<recipe> ...`` on 2 CPU processes with its own output
directory ``<out>/<task>/<label>``; the runs of a task share the seed-dependent data order, the
epochs, the batch and the learning-rate schedule, and differ only in the strategy (and the seed,
where a task repeats the dense run to show the seed-to-seed spread). A run whose ``result.json``
exists is not run again, so an interrupted benchmark continues where it stopped. The report is
``<out>/<task>/table.md`` (final and best metric, wire compression, seconds per step, wall time)
and ``<out>/<task>/curves.png`` (the validation metric after every validation, one line per run).

Tasks:

* ``ptb_adamw``: a 2-layer causal transformer on PTB with AdamW (the Adam hand-over's evidence):
  dense AdamW, DGC 0.1 % with plain error feedback under AdamW's own state, DGC 0.1 % and onebit
  with the frozen-variance hand-over (``--freeze`` dense steps first, by default 20 % of
  ``--steps``, inside the 15-25 % that 1-bit Adam uses, as ``adam_warmup_steps="auto"``), DGC
  with and without the density floor after the freeze (``adam_min_sends``); curves by step;
  ``--lr-decay`` for a step decay at 60 % and 85 % of the steps.
* ``gpt2_ptb_adamw``: the same data, optimizer and schedule on a model the recipes were not tuned
  on, Hugging Face's GPT-2 (2 layers, d = 128) built from a config (``pip install transformers``;
  recipes gpt2_ptb_dense and gpt2_ptb_dgc): dense AdamW, DGC 0.1 % with plain error feedback, DGC
  0.1 % and onebit with the frozen-variance hand-over, all at the library's defaults (the freeze
  at ``adam_warmup_steps="auto"`` unless ``--freeze``); ``--steps``, ``--lr-decay`` as ptb_adamw's.
* ``compressors``: the shorter task, every registered compressor at its recommended settings
  on the quickstart (scikit-learn's digits), and onebit and qsgd through the two-phase exchange
  (onebit also without its server error feedback); needs no shared data.
* ``lstm_ptb``: a small 2-layer LSTM language model on the full PTB text, dense DDP and DGC at
  0.1 % after the paper's one-epoch language-model warm-up (also after the image models' four
  epochs, and after one dense epoch); validation perplexity, and test perplexity of the final
  model (``ptb.test.txt``).
* ``yesno``: the speech recipes' small CTC model on OpenSLR's yesno corpus (``<data>/yesno``),
  dense DDP and DGC (the recipe's 1 % after 50 plain AdamW steps), seeds 0 and 1; validation WER.
* ``cifar10``: ResNet-20 on CIFAR-10's training JPEGs (``<data>/cifar10``), a seeded subset of
  ``--train-size`` images, 5,000 held out for validation; SGD lr 0.1 (global batch 128), a step
  decay at 60 % and 85 % of the epochs; dense DDP and DGC at 0.1 % (after the paper's 4-epoch
  sparsity warm-up), each with seeds 0 and 1 so the seed-to-seed spread is known, and DGC with
  ``delay=1`` (seed 0), without and with the local update, for delayed synchronisation's
  staleness cost; onebit gathered and through the two-phase exchange, with and without its
  server error feedback (seed 0).
* ``cifar10_4_ranks``: the cifar10 task's training at 4 processes x batch 32, onebit gathered and
  through the two-phase exchange with and without its server error feedback.

Needs the shared data folder (``--data``, default ``../shared/data`` beside the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
MASKED = ("strategy.momentum_masking=true",)  # explicit where a recipe has since turned masking off


@dataclass(frozen=True)
class Run:
    """One training run of a task: a label, the recipe and the overrides it adds to the task's."""

    label: str
    recipe: str | None  # None: the quickstart configuration
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    """Runs that share everything but the strategy (and seed): the comparison of one table.

    ``metric``: the validation metric's label; ``percent``: shown x 100; ``higher_is_better``;
    ``by_step``: learning curves against the optimizer step instead of the epoch.
    """

    name: str
    description: str
    runs: tuple[Run, ...]
    overrides: tuple[str, ...] = field(default=())
    metric: str = "top-1 %"
    percent: bool = True
    higher_is_better: bool = True
    by_step: bool = False


DELAYED_FROM_START = ("strategy.sync_warmup_steps=0",)
"""The delayed runs recorded before ``sync_warmup_steps`` defaulted to the sparsity warm-up's length."""


ONEBIT, TWO_PHASE = ("strategy=onebit",), ("strategy.exchange=two_phase",)
FED, NOT_FED = TWO_PHASE + ("strategy.server_feedback=true",), TWO_PHASE + ("strategy.server_feedback=false",)
"""Two-phase with and without the server error feedback, both explicit: it was the default until
these runs measured its cost, so the runs labelled plain "two-phase" have it and those without it
say so."""
CORRECTED = ("strategy.momentum_correction=true",)


CIFAR10_GLOBAL_BATCH = 128


def cifar10_overrides(data: Path, epochs: int, train_size: int, processes: int = 2) -> tuple[str, ...]:
    """What every cifar10 run shares: the data subset, ``processes`` CPU ranks sharing a global
    batch of 128, SGD lr 0.1 with a step decay at 60 % and 85 % of the epochs."""
    milestones = f"[{round(0.6 * epochs)},{round(0.85 * epochs)}]"
    return (
        f"data.root={data / 'cifar10'}",
        "data.download=false",
        f"data.train_size={train_size}",
        f"data.batch_size={CIFAR10_GLOBAL_BATCH // processes}",
        "data.num_workers=0",
        f"trainer.devices={processes}",
        "trainer.accelerator=cpu",
        f"trainer.max_epochs={epochs}",
        "trainer.enable_checkpointing=false",
        "model.lr=0.1",
        "model.lr_warmup_epochs=0",
        f"model.lr_milestones={milestones}",
    )


def cifar10_task(data: Path, epochs: int, train_size: int) -> Task:
    warmup_steps = 4 * (train_size // CIFAR10_GLOBAL_BATCH)  # the 4 warm-up epochs, drop_last
    shared = cifar10_overrides(data, epochs, train_size)
    return Task(
        name="cifar10",
        description=(
            f"ResNet-20, CIFAR-10 ({train_size:,} training JPEGs, 5,000 held out), {epochs} epochs, "
            "2 CPU processes x batch 64"
        ),
        runs=(
            Run("dense, seed 0", "resnet20_cifar10_dense", ("seed=0",)),
            Run("DGC 0.1 %, seed 0", "resnet20_cifar10_dgc", ("seed=0",)),
            # delayed synchronisation's staleness cost: the exchange of step t is applied at t + 1
            Run(
                "DGC 0.1 %, delay 1, seed 0",
                "resnet20_cifar10_dgc",
                ("seed=0", "strategy.delay=1", *DELAYED_FROM_START),
            ),
            # OD-SGD's local update: this rank's own update applied at once, only the ranks' disagreement stale
            Run(
                "DGC 0.1 %, delay 1, local update, seed 0",
                "resnet20_cifar10_dgc",
                ("seed=0", "strategy.delay=1", "strategy.local_update=true", *DELAYED_FROM_START),
            ),
            Run("dense, seed 1", "resnet20_cifar10_dense", ("seed=1",)),
            Run("DGC 0.1 %, seed 1", "resnet20_cifar10_dgc", ("seed=1",)),
            # momentum factor masking cost the LSTM 7 perplexity points: does it help or cost here?
            Run("DGC 0.1 %, no masking, seed 0", "resnet20_cifar10_dgc", ("seed=0", "strategy.momentum_masking=false")),
            Run("DGC 0.1 %, no masking, seed 1", "resnet20_cifar10_dgc", ("seed=1", "strategy.momentum_masking=false")),
            Run(  # the local update's cost against DGC's own seed-to-seed spread
                "DGC 0.1 %, delay 1, local update, seed 1",
                "resnet20_cifar10_dgc",
                ("seed=1", "strategy.delay=1", "strategy.local_update=true", *DELAYED_FROM_START),
            ),
            Run(  # delayed only at 0.1 %: the 4 sparsity warm-up epochs synchronous
                "DGC 0.1 %, delay 1, local update, synchronous warm-up, seed 0",
                "resnet20_cifar10_dgc",
                ("seed=0", "strategy.delay=1", "strategy.local_update=true")
                + (f"strategy.sync_warmup_steps={warmup_steps}",),
            ),
            # the compressed all-reduce's server error feedback, on a task where 1 bit per element
            # costs accuracy (the digits task cannot tell the three apart)
            Run("onebit, seed 0", "resnet20_cifar10_dense", ("seed=0", *ONEBIT)),
            Run("onebit two-phase, seed 0", "resnet20_cifar10_dense", ("seed=0", *ONEBIT, *FED)),
            Run(
                "onebit two-phase, no server feedback, seed 0",
                "resnet20_cifar10_dense",
                ("seed=0", *ONEBIT, *NOT_FED),
            ),
            # is it the momentum outside the compressor? With momentum correction the memory
            # accumulates momentum SGD's velocity and both error buffers hold velocity (1-bit Adam)
            Run("onebit, momentum correction, seed 0", "resnet20_cifar10_dense", ("seed=0", *ONEBIT, *CORRECTED)),
            Run(
                "onebit two-phase, momentum correction, seed 0",
                "resnet20_cifar10_dense",
                ("seed=0", *ONEBIT, *FED, *CORRECTED),
            ),
            Run(
                "onebit two-phase, momentum correction, no server feedback, seed 0",
                "resnet20_cifar10_dense",
                ("seed=0", *ONEBIT, *NOT_FED, *CORRECTED),
            ),
            Run("onebit two-phase, seed 1", "resnet20_cifar10_dense", ("seed=1", *ONEBIT, *FED)),
            Run(
                "onebit two-phase, no server feedback, seed 1",
                "resnet20_cifar10_dense",
                ("seed=1", *ONEBIT, *NOT_FED),
            ),
            # momentum correction's gain on a second seed (README recommends it for onebit; the presets keep it off)
            Run("onebit, seed 1", "resnet20_cifar10_dense", ("seed=1", *ONEBIT)),
            Run("onebit, momentum correction, seed 1", "resnet20_cifar10_dense", ("seed=1", *ONEBIT, *CORRECTED)),
            Run(
                "onebit two-phase, momentum correction, no server feedback, seed 1",
                "resnet20_cifar10_dense",
                ("seed=1", *ONEBIT, *NOT_FED, *CORRECTED),
            ),
            # the quantisers send 1-D and small tensors dense by default: which of the two pays
            Run(
                "onebit, only 1-D tensors dense, seed 0",
                "resnet20_cifar10_dense",
                ("seed=0", *ONEBIT, "strategy.min_compress_numel=1"),
            ),
        ),
        overrides=shared,
    )


def cifar10_4_ranks_task(data: Path, epochs: int, train_size: int) -> Task:
    """Does the two-phase exchange's server error feedback pay at four ranks? At two it cost onebit
    5 points (the cifar10 task): there a chunk's mean has only three levels per element before it
    is re-encoded. The cifar10 task's training at 4 processes x batch 32 (the same global batch)."""
    return Task(
        name="cifar10_4_ranks",
        description=(
            f"ResNet-20, CIFAR-10 ({train_size:,} training JPEGs, 5,000 held out), {epochs} epochs, "
            f"4 CPU processes x batch {CIFAR10_GLOBAL_BATCH // 4}"
        ),
        runs=(
            Run("onebit two-phase, seed 0", "resnet20_cifar10_dense", ("seed=0", *ONEBIT, *FED)),
            Run(
                "onebit two-phase, no server feedback, seed 0",
                "resnet20_cifar10_dense",
                ("seed=0", *ONEBIT, *NOT_FED),
            ),
            Run("onebit, seed 0", "resnet20_cifar10_dense", ("seed=0", *ONEBIT, "strategy.exchange=gather")),
        ),
        overrides=cifar10_overrides(data, epochs, train_size, processes=4),
    )


PTB_ADAMW_PROCESSES, PTB_ADAMW_BATCH, PTB_ADAMW_BPTT = 2, 16, 64
LR_DECAY_AT = (0.6, 0.85)
"""``--lr-decay``: the learning rate falls 10x at these fractions of the run (as the cifar10 task's)."""


def ptb_steps_per_epoch(data: Path) -> int:
    """Optimizer steps per epoch of the ptb_adamw task: each process takes half the training
    windows (DDP's sampler) in batches of 16, the last partial batch dropped."""
    from recipes.language import read_tokens

    windows = (len(read_tokens(data / "ptb" / "ptb.train.txt")) - 1) // PTB_ADAMW_BPTT
    return -(-windows // PTB_ADAMW_PROCESSES) // PTB_ADAMW_BATCH


def ptb_adamw_overrides(data: Path, steps: int, lr_decay: bool) -> tuple[tuple[str, ...], str]:
    """What every run of a PTB AdamW task shares (the data, 2 CPU processes x 16 x 64 tokens,
    ``steps`` optimizer steps, ten validations), and the description's words for ``--lr-decay``."""
    epoch_steps = ptb_steps_per_epoch(data)
    shared = (
        f"data.root={data / 'ptb'}",
        "data.download=false",
        f"trainer.devices={PTB_ADAMW_PROCESSES}",
        f"data.batch_size={PTB_ADAMW_BATCH}",  # the recipe's, pinned: ptb_steps_per_epoch counts with them
        f"data.bptt={PTB_ADAMW_BPTT}",
        "trainer.accelerator=cpu",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",  # the recipe's 2 epochs (about 900 steps) would cut a longer run short
        # ten validations per run, but at least one per epoch: Lightning counts the interval within an epoch
        f"trainer.val_check_interval={min(max(1, steps // 10), epoch_steps)}",
        "trainer.enable_checkpointing=false",
    )
    decay = ""
    if lr_decay:  # the recipe's milestones are in (fractional) epochs
        epochs = [round(at * steps / epoch_steps, 4) for at in LR_DECAY_AT]
        shared += (f"model.lr_milestones=[{','.join(map(str, epochs))}]",)
        decay = ", lr x0.1 at " + " and ".join(f"{at:.0%}" for at in LR_DECAY_AT) + " of the steps"
    return shared, decay


def adamw_comparison(recipes: str, frozen: tuple[str, ...]) -> tuple[Run, Run, Run, Run]:
    """The four runs every PTB AdamW task compares, from the recipes ``<recipes>_dense`` and
    ``<recipes>_dgc``: dense AdamW, DGC 0.1 % with plain error feedback under AdamW's own state,
    DGC 0.1 % and onebit with the frozen-variance hand-over (``frozen``: the overrides that set
    the freeze; none: the strategy's ``adam_warmup_steps``)."""
    dense, dgc = f"{recipes}_dense", f"{recipes}_dgc"
    return (
        Run("dense AdamW", dense),
        Run("DGC 0.1 %, plain error feedback", dgc, ("strategy.momentum_correction=false",)),
        Run("DGC 0.1 %, frozen variance", dgc, frozen),
        Run(
            "onebit, frozen variance",
            dense,  # the DGC recipe's compress_ratio is not onebit's
            ("strategy=onebit", "strategy.momentum_correction=true", *frozen),
        ),
    )


@dataclass(frozen=True)
class PTBAdamW:
    """A PTB AdamW task's own part: its name, the model's words in the description, the freeze's."""

    name: str
    model: str
    freeze: str


def ptb_adamw(task: PTBAdamW, runs: tuple[Run, ...], data: Path, steps: int, lr_decay: bool) -> Task:
    """``runs`` of a PTB AdamW task with the overrides they share (:func:`ptb_adamw_overrides`)."""
    shared, decay = ptb_adamw_overrides(data, steps, lr_decay)
    return Task(
        name=task.name,
        description=(
            f"{task.model}, PTB, AdamW lr 1e-3 wd 0.01{decay}, {steps} steps, "
            f"{PTB_ADAMW_PROCESSES} CPU processes x {PTB_ADAMW_BATCH} x {PTB_ADAMW_BPTT} tokens; {task.freeze}"
        ),
        runs=runs,
        overrides=shared,
        metric="perplexity",
        percent=False,
        higher_is_better=False,
        by_step=True,
    )


def ptb_adamw_task(data: Path, steps: int, freeze: int, lr_decay: bool = False) -> Task:
    frozen = (f"strategy.adam_warmup_steps={freeze}",)
    dense, plain, frozen_dgc, onebit = adamw_comparison("transformer_ptb", frozen)
    runs = (
        dense,
        plain,
        frozen_dgc,
        # the density floor off (adam_min_sends=0): 0.1 % from the freeze on, as every run before the floor
        Run("DGC 0.1 %, frozen variance, no floor", "transformer_ptb_dgc", (*frozen, "strategy.adam_min_sends=0")),
        Run(  # the paper's exponential sparsity warm-up, one stage per `freeze` steps after the freeze
            "DGC 0.1 %, frozen variance, sparsity warm-up",
            "transformer_ptb_dgc",
            (
                *frozen,
                "warmup={_target_:lightning_gc.SparsityWarmup,densities:[1.0,0.0625,0.015625,0.00390625],"
                f"interval:step,steps_per_stage:{freeze}}}",
            ),
        ),
        onebit,
        # ten times the density: each element leaves about every 100 steps instead of 1,000,
        # at 0.64 bits per element and step, onebit's 1 bit in the same range
        Run("DGC 1 %, frozen variance", "transformer_ptb_dgc", (*frozen, "strategy.compress_ratio=0.01")),
        # momentum factor masking zeroes u where v was sent: an element sent every step then moves
        # by (1 - b1) g / d, a tenth of Adam's m / d
        Run(
            "DGC 0.1 %, frozen variance, no masking",
            "transformer_ptb_dgc",
            (*frozen, "strategy.momentum_masking=false"),
        ),
        Run(
            "DGC 1 %, frozen variance, no masking",
            "transformer_ptb_dgc",
            (*frozen, "strategy.compress_ratio=0.01", "strategy.momentum_masking=false"),
        ),
        # the recipe ranks top-k by each element's loss decrease (adam_weighting=decrease); this is
        # the ranking by pending Adam step alone, the library's default (and onebit's better choice)
        Run(
            "DGC 0.1 %, frozen variance, step weighting",
            "transformer_ptb_dgc",
            (*frozen, "strategy.adam_weighting=step"),
        ),
    )
    task = PTBAdamW("ptb_adamw", "2-layer causal transformer (d = 128)", f"variance frozen after {freeze} steps")
    return ptb_adamw(task, runs, data, steps, lr_decay)


def gpt2_ptb_adamw_task(data: Path, steps: int, freeze: int | None = None, lr_decay: bool = False) -> Task:
    """The same comparison on a model the recipes were not tuned on: Hugging Face's GPT-2 built
    from a config (recipes gpt2_ptb_dense and gpt2_ptb_dgc, ``pip install transformers``), the
    strategies at the library's defaults; ``freeze`` None leaves the freeze to
    ``adam_warmup_steps="auto"`` (20 % of the steps)."""
    frozen = () if freeze is None else (f"strategy.adam_warmup_steps={freeze}",)
    when = "after 20 % of the steps (adam_warmup_steps=auto)" if freeze is None else f"after {freeze} steps"
    task = PTBAdamW(
        "gpt2_ptb_adamw", "Hugging Face GPT-2 (2 layers, d = 128, from a config)", f"variance frozen {when}"
    )
    return ptb_adamw(task, adamw_comparison("gpt2_ptb", frozen), data, steps, lr_decay)


def lstm_ptb_task(data: Path, epochs: int) -> Task:
    """The paper's PTB experiment scaled to CPU: a 2-layer LSTM of 200 units (Zaremba et al.'s
    small model) on the full PTB text, the recipes' SGD (lr 2.0, momentum 0.9) and clipping, a
    step decay at 60 % and 85 % of the epochs; DGC after the paper's one-epoch warm-up."""
    milestones = f"[{round(0.6 * epochs)},{round(0.85 * epochs)}]"
    shared = (
        f"data.root={data / 'ptb'}",
        "data.download=false",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        f"trainer.max_epochs={epochs}",
        "trainer.enable_checkpointing=false",
        "model.embedding_size=200",
        "model.hidden_size=200",
        "model.dropout=0.2",
        f"model.lr_milestones={milestones}",
        "seed=0",
    )
    return Task(
        name="lstm_ptb",
        description=(
            f"2-layer LSTM (200 units, tied embeddings), full PTB, {epochs} epochs, "
            "2 CPU processes x 20 x 35 tokens, SGD lr 2.0 momentum 0.9, clipping 0.25"
        ),
        runs=(
            Run("dense", "lstm_ptb_dense"),
            # these four ran with momentum factor masking, the recipe's setting until the runs below
            Run("DGC 0.1 %", "lstm_ptb_dgc", MASKED),  # the paper's language-model warm-up: one epoch
            # the image models' 4-epoch warm-up, which this recipe used before (half of 8 epochs)
            Run("DGC 0.1 %, 4-epoch warm-up", "lstm_ptb_dgc", (*MASKED, "warmup.epochs_per_stage=1")),
            # momentum factor masking restarts an element's momentum at every send: at the warm-up's
            # densities (25 %, 6.25 %, ...) that is every few steps, a fraction of momentum SGD's step;
            # a first quarter epoch sent whole keeps momentum SGD's, then 0.1 % at once
            Run("DGC 0.1 %, a dense quarter epoch first", "lstm_ptb_dgc", (*MASKED, "warmup.densities=[1.0]")),
            # ten times the density on the same short schedule: is the gap the 0.1 % phase's length?
            Run("DGC 1 %", "lstm_ptb_dgc", (*MASKED, "strategy.compress_ratio=0.01")),
            # momentum factor masking restarts the momentum of every element sent
            Run("DGC 0.1 %, no masking", "lstm_ptb_dgc", ("strategy.momentum_masking=false",)),
            Run(
                "DGC 1 %, no masking",
                "lstm_ptb_dgc",
                ("strategy.compress_ratio=0.01", "strategy.momentum_masking=false"),
            ),
        ),
        overrides=shared,
        metric="perplexity",
        percent=False,
        higher_is_better=False,
    )


def yesno_task(data: Path) -> Task:
    """The speech experiment at CPU size: the ``speech_yesno`` recipes as they are (40 epochs,
    200 steps, AdamW), dense DDP and DGC with seeds 0 and 1; WER of the 15 held-out utterances."""
    shared = (f"data.root={data / 'yesno'}", "trainer.enable_checkpointing=false")
    return Task(
        name="yesno",
        description=(
            "small DeepSpeech-style CTC model (0.53 M parameters, AdamW), OpenSLR yesno "
            "(45 training / 15 validation utterances), 40 epochs, 2 CPU processes x batch 4"
        ),
        runs=(
            Run("dense, seed 0", "speech_yesno_dense", ("seed=0",)),
            Run("DGC 1 %, seed 0", "speech_yesno_dgc", ("seed=0",)),
            Run("dense, seed 1", "speech_yesno_dense", ("seed=1",)),
            Run("DGC 1 %, seed 1", "speech_yesno_dgc", ("seed=1",)),
        ),
        overrides=shared,
        metric="WER %",
        higher_is_better=False,
    )


COMPRESSOR_SETTINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ()),
    ("fp16", ()),
    ("bf16", ()),
    ("topk", ("strategy.compress_ratio=0.01",)),
    ("dgc", ("strategy.compress_ratio=0.001",)),
    ("randomk", ("strategy.compress_ratio=0.01",)),
    ("powersgd", ("strategy.rank=2",)),
    ("signsgd", ()),
    ("onebit", ()),
    ("terngrad", ()),
    ("qsgd", ("strategy.levels=7",)),
    ("fft", ("strategy.compress_ratio=0.01", "strategy.bits=8")),
)
"""Every registered compressor at the README's recommended settings (sparsifiers after the
quickstart's sparsity warm-up)."""


def compressors_task(epochs: int) -> Task:
    """The shorter task: the quickstart (scikit-learn's digits, real data shipped with it) trained
    with every compressor, and the two-phase exchange of onebit (with and without its server error
    feedback) and qsgd against their gathered form."""
    runs = [Run("dense DDP", None, ("strategy=dense",))]
    runs += [Run(name, None, (f"strategy={name}", *settings)) for name, settings in COMPRESSOR_SETTINGS]
    runs += [
        Run("onebit two-phase", None, (*ONEBIT, *FED)),
        Run("onebit two-phase, no server feedback", None, (*ONEBIT, *NOT_FED)),
        Run("qsgd two-phase", None, ("strategy=qsgd", "strategy.levels=7", *TWO_PHASE)),
    ]
    return Task(
        name="compressors",
        description=f"digits MLP (1.1 M parameters), scikit-learn's digits, {epochs} epochs, 2 CPU processes",
        runs=tuple(runs),
        overrides=("compare_dense=false", f"trainer.max_epochs={epochs}", "seed=0"),
        metric="val acc %",
    )


def run_directory(out: Path, task: Task, run: Run) -> Path:
    return out / task.name / run.label.replace(" ", "_").replace(",", "").replace("%", "pct").replace(".", "_")


def train(task: Task, run: Run, directory: Path) -> dict[str, Any]:
    """``train.py`` for one run (skipped when its result exists); the run's ``result.json``."""
    result_file = directory / "result.json"
    if not result_file.is_file():
        recipe = [] if run.recipe is None else [f"+recipe={run.recipe}"]
        command = [
            sys.executable, "train.py", *recipe, *task.overrides, *run.overrides, f"hydra.run.dir={directory}",
        ]  # fmt: skip
        print(f"[{task.name}] {run.label}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0 or not result_file.is_file():
            raise SystemExit(f"[{task.name}] {run.label} failed (exit {done.returncode}); see {directory}")
        print(f"[{task.name}] {run.label}: {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads(result_file.read_text())


def _shown(task: Task, value: float | None) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.2f}" if task.percent else f"{value:.1f}"


def curve(result: dict[str, Any], by_step: bool) -> list[tuple[int, float]]:
    """(epoch or step, metric) after each validation; entries are [epoch, step, metric] (or the
    older [epoch, metric])."""
    points = []
    for entry in result.get("curve", []):
        if entry[-1] is not None:
            points.append((entry[1] if by_step and len(entry) == 3 else entry[0] + 1, entry[-1]))
    return points


def table(task: Task, results: dict[str, dict[str, Any]]) -> str:
    """The task's Markdown table: one row per finished run (a test column when runs were tested)."""
    tested = any(r.get("test_metric") is not None for r in results.values())
    test_header, test_rule = (f" test {task.metric} |", "---|") if tested else ("", "")
    lines = [
        f"{task.description}.",
        "",
        f"| run | final {task.metric} | best {task.metric} |{test_header} wire compression (run / last step) "
        "| s/step | wall |",
        f"|---|---|---|{test_rule}---|---|---|",
    ]
    for run in task.runs:
        result = results.get(run.label)
        if result is None:
            lines.append(f"| {run.label} | not run | |{' |' if tested else ''} | | |")
            continue
        values = [v for _, v in curve(result, task.by_step)]
        best = (max if task.higher_is_better else min)(values) if values else None
        last = result.get("last_step_wire_compression")
        wire = f"{result['wire_compression']:.1f}x" + ("" if last is None else f" / {last:.0f}x")
        test_cell = f" {_shown(task, result.get('test_metric'))} |" if tested else ""
        lines.append(
            f"| {run.label} | {_shown(task, result['metric'])} | {_shown(task, best)} |{test_cell} {wire} "
            f"| {result['step_time_s']:.3f} | {result['wall_s'] / 60:.1f} min |"
        )
    return "\n".join(lines) + "\n"


def plot(task: Task, results: dict[str, dict[str, Any]], out: Path) -> Path:
    """Validation metric after every epoch, one line per finished run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run in task.runs:
        result = results.get(run.label)
        points = [] if result is None else curve(result, task.by_step)
        if not points:
            continue
        xs, values = zip(*points)
        axes.plot(xs, [100 * v if task.percent else v for v in values], marker=".", label=run.label)
    axes.set_xlabel("optimizer step" if task.by_step else "epoch")
    axes.set_ylabel(f"validation {task.metric}")
    if not task.higher_is_better:
        axes.set_yscale("log")
    axes.set_title("\n".join(textwrap.wrap(task.description, 90)), fontsize=9)
    axes.grid(alpha=0.3)
    if axes.lines:  # no finished run yet: an empty chart, without a legend
        axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "task",
        choices=["cifar10", "cifar10_4_ranks", "lstm_ptb", "ptb_adamw", "gpt2_ptb_adamw", "compressors", "yesno"],
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared data folder")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "accuracy")
    parser.add_argument(
        "--epochs", type=int, default=None, help="cifar10: 20, lstm_ptb: 8, compressors: 12 (the quickstart's)"
    )
    parser.add_argument("--train-size", type=int, default=20_000, help="cifar10: training images")
    parser.add_argument("--steps", type=int, default=600, help="ptb_adamw, gpt2_ptb_adamw: optimizer steps")
    parser.add_argument(
        "--freeze",
        type=int,
        default=None,
        help="ptb_adamw, gpt2_ptb_adamw: steps before Adam's variance freezes (ptb_adamw: 20 %% of --steps; "
        "gpt2_ptb_adamw: the strategy's adam_warmup_steps=auto, also 20 %%)",
    )
    parser.add_argument(
        "--lr-decay",
        action="store_true",
        help="ptb_adamw, gpt2_ptb_adamw: lr x0.1 at 60 %% and 85 %% of the steps (default: constant)",
    )
    parser.add_argument("--report-only", action="store_true", help="only tabulate the runs already finished")
    parser.add_argument(
        "--runs", nargs="+", metavar="LABEL", default=None, help="train only these runs (labels as in the table)"
    )
    args = parser.parse_args(argv)
    if args.task != "compressors" and not args.data.is_dir():
        parser.error(f"--data {args.data} is not a directory: the accuracy runs need the shared data folder")
    data = args.data.resolve()
    if args.task == "cifar10":
        task = cifar10_task(data, args.epochs or 20, args.train_size)
    elif args.task == "cifar10_4_ranks":
        task = cifar10_4_ranks_task(data, args.epochs or 20, args.train_size)
    elif args.task == "compressors":
        task = compressors_task(args.epochs or 12)
    elif args.task == "lstm_ptb":
        task = lstm_ptb_task(data, args.epochs or 8)
    elif args.task == "yesno":
        task = yesno_task(data)
    elif args.task == "gpt2_ptb_adamw":
        task = gpt2_ptb_adamw_task(data, args.steps, args.freeze, args.lr_decay)
    else:
        freeze = args.steps // 5 if args.freeze is None else args.freeze
        task = ptb_adamw_task(data, args.steps, freeze, args.lr_decay)
    labels = [run.label for run in task.runs]
    unknown = sorted(set(args.runs or ()) - set(labels))
    if unknown:
        parser.error(f"--runs {unknown} are not runs of {task.name}; its runs are {labels}")
    results: dict[str, dict[str, Any]] = {}
    for run in task.runs:
        directory = run_directory(args.out, task, run)
        if args.report_only or (args.runs is not None and run.label not in args.runs):
            if (directory / "result.json").is_file():
                results[run.label] = json.loads((directory / "result.json").read_text())
        else:
            results[run.label] = train(task, run, directory)
    text = table(task, results)
    (args.out / task.name).mkdir(parents=True, exist_ok=True)
    (args.out / task.name / "table.md").write_text(text)
    print(text)
    print(f"curves: {plot(task, results, args.out / task.name / 'curves.png')}")


if __name__ == "__main__":
    main()
