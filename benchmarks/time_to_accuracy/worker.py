"""One node of a time-to-accuracy run: trains one mode in a plain DDP loop and records it.

Launched like netbench's worker (``benchmarks.netbench.launch.node_env``: ``MASTER_ADDR``,
``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE``, ``GLOO_SOCKET_IFNAME``, one thread, malloc
thresholds high), one process per emulated node::

    python -m benchmarks.time_to_accuracy.worker --task-config '{...}' --data FILE --mode dgc \
        --out trajectory.jsonl [--steps N] [--eval-every K] [--timing KIND_STEPS]

What netbench's worker does not have, and this one adds: evaluation on the held-out split every
``--eval-every`` steps (on both ranks, each its half, summed; its time and traffic are kept out
of the record), a byte counter that works for every mode (:mod:`.traffic`), and a step *kind*
per step (:mod:`.modes`). Rank 0 writes JSON lines: ``meta``, one ``eval`` per evaluation
(``step``, ``samples``, ``tcp_bytes``, ``payload_bytes``, ``metric``, ``train_s``: training
wall-clock so far, evaluations excluded), and ``end`` (``kinds`` run-length encoded, and with
``--timing`` every step's time, kind and bytes). ``--timing`` squeezes the schedule
(``modes.Plan.timing``) and evaluates nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.time_to_accuracy import modes, tasks
from benchmarks.time_to_accuracy.traffic import TcpCounter


def run_length(kinds: list[str]) -> list[list[Any]]:
    """``["a", "a", "b"]`` -> ``[["a", 2], ["b", 1]]``."""
    return [[kind, len(list(group))] for kind, group in itertools.groupby(kinds)]


class Recorder:
    """Training time and traffic of a run, evaluations left out."""

    def __init__(self, cfg: tasks.TaskConfig, data: tasks.TaskData, mode: modes.Mode, rank: int) -> None:
        self.cfg, self.data, self.mode, self.rank = cfg, data, mode, rank
        self.counter = TcpCounter()
        self.train_s = 0.0
        self.eval_bytes = 0
        self.held_out = data.held_out(rank)

    def tcp_bytes(self) -> int:
        return self.counter.read() - self.eval_bytes

    def evaluate(self, model: torch.nn.Module, step: int) -> dict[str, Any]:
        before, started = self.counter.read(), time.perf_counter()
        training = model.training
        with self.mode.evaluated(model):
            model.eval()
            sums = torch.tensor(tasks.evaluation_sums(self.cfg, model, self.held_out), dtype=torch.float64)
            model.train(training)
        dist.all_reduce(sums)
        eval_s = time.perf_counter() - started
        self.eval_bytes += self.counter.read() - before
        return {
            "type": "eval",
            "step": step,
            "samples": step * tasks.WORLD * self.cfg.batch_size,
            "tcp_bytes": self.tcp_bytes(),
            "payload_bytes": self.mode.payload_bytes(),
            "metric": tasks.metric_of(self.cfg, float(sums[0]), float(sums[1])),
            "train_s": self.train_s,
            "eval_s": eval_s,
        }


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the mode; rank 0's records (every rank returns its own)."""
    rank = int(os.environ.get("NODE_RANK", 0))
    cfg = tasks.from_dict(json.loads(args.task_config))
    data = tasks.TaskData(cfg, args.data, args.seed)
    total = args.steps or data.total_steps()
    if args.timing:
        plan = modes.Plan.timing(args.timing, modes.TIMING_OFFSET)
    else:
        plan = modes.Plan.training(data.steps_per_epoch, cfg.stage_epochs)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every mode
    model = tasks.build_model(cfg, data.vocab)
    optimizer, schedule = tasks.optimizer_and_schedule(cfg, model, data.steps_per_epoch)
    mode = modes.make(args.mode, plan, cfg)
    module = mode.setup(model, optimizer)
    torch.manual_seed(args.seed * 7919 + rank)  # dropout and the codecs' sampling: per rank, the same in every mode
    dist.barrier()  # the set-up's broadcasts have arrived: the byte count starts after them
    recorder = Recorder(cfg, data, mode, rank)
    records: list[dict[str, Any]] = [
        {"type": "meta", "mode": args.mode, "task": cfg.to_dict(), "seed": args.seed, "steps": total,
         "eval_every": args.eval_every, "steps_per_epoch": data.steps_per_epoch, "timing": args.timing,
         "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "plan": plan.__dict__,
         "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    ]  # fmt: skip
    evaluate = not args.timing and args.eval_every > 0
    if evaluate:
        records.append(recorder.evaluate(model, 0))
    kinds, step_s, sent = [], [], []
    for step in range(total):
        started = time.perf_counter()
        mode.before_step(step)
        x, y = data.batch(step, rank)
        optimizer.zero_grad(set_to_none=True)
        tasks.loss(cfg, module(x), y).backward()
        if mode.clips_after_backward and cfg.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        mode.step(optimizer, step)
        schedule.step()
        if step == total - 1:
            mode.finish()  # owed averages or a last sync: part of the last step
        elapsed = time.perf_counter() - started
        recorder.train_s += elapsed
        kinds.append(mode.kind(step))
        step_s.append(elapsed)
        if args.timing:
            sent.append(recorder.tcp_bytes())
        if evaluate and ((step + 1) % args.eval_every == 0 or step == total - 1):
            records.append(recorder.evaluate(model, step + 1))
    end: dict[str, Any] = {"type": "end", "kinds": run_length(kinds), "tcp_bytes": recorder.tcp_bytes()}
    end.update(payload_bytes=mode.payload_bytes(), train_s=recorder.train_s)
    if args.timing:
        end.update(step_s=step_s, step_kinds=kinds, step_tcp_bytes=sent, offset=modes.TIMING_OFFSET)
    records.append(end)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task-config", required=True, help="tasks.TaskConfig as JSON")
    parser.add_argument("--data", type=Path, required=True, help="the prepared data (tasks.prepare)")
    parser.add_argument("--mode", required=True)
    parser.add_argument("--out", type=Path, required=True, help="rank 0's JSON lines")
    parser.add_argument("--steps", type=int, default=0, help="0: the task's epochs")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing", type=int, default=0, help="steps per kind of a timing run (0: a training run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("NODE_RANK", 0)), int(os.environ.get("WORLD_SIZE", tasks.WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        records = train(args)
        if rank == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            partial = args.out.with_suffix(".partial")
            partial.write_text("".join(json.dumps(r) + "\n" for r in records))
            partial.replace(args.out)  # a trajectory file exists only when complete
        # every rank past its last collective before any tears down: a peer that leaves while
        # gloo's threads still serve this rank aborts it ("terminate called without an active
        # exception"); the collected DDP reducer lets go of the group first
        gc.collect()
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
