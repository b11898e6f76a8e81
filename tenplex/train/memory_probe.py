"""Peak memory of one training step of a rank (``--measure-memory DIR``): the measurement the
memory model (``tenplex.planning.memory``) is checked against. Writes ``DIR/rank-N.json``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import torch

from .trainer import Trainer

__all__ = ["measure_step_memory"]


def measure_step_memory(trainer: Trainer, out_dir: str, *,
                        fault: Callable[[], str | None] | None = None,
                        written: Callable[[], bool] | None = None) -> tuple[float, np.ndarray]:
    """Run one step and record this rank's peak memory in ``out_dir/rank-N.json``.

    CUDA: the caching allocator's peak (``max_memory_allocated``). CPU: PyTorch's memory
    profiler, which reports every allocation and free of the CPU allocator: peak = bytes of the
    tensors alive when the step starts (parameters, gradients, optimizer state)
    plus the highest running total of allocations minus frees during the step.
    """
    dev = trainer.g.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        loss, samples = trainer.train_step(fault=fault, written=written)
        torch.cuda.synchronize(dev)
        peak, method = torch.cuda.max_memory_allocated(dev), "cuda max_memory_allocated"
    else:
        # imported here: only a CPU measurement needs the profiler (not every worker's start-up)
        from torch._C._profiler import _EventType  # the profiler's event kinds have no public name
        from torch.profiler import ProfilerActivity, profile

        state = sum(p.numel() * p.element_size() for p in trainer.params.values())
        state += sum(p.grad.numel() * p.grad.element_size() for p in trainer.params.values() if p.grad is not None)
        state += sum(t.numel() * t.element_size() for t in trainer.opt.values())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss, samples = trainer.train_step(fault=fault, written=written)
        events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:  # every allocation (+) and free (-) the CPU allocator reported, in time order
            node = stack.pop()
            stack.extend(node.children)
            if node.typed[0] == _EventType.Allocation:
                events.append((node.start_time_ns, node.typed[1].alloc_size))
        live = top = 0
        for _, size in sorted(events):
            live += size
            top = max(top, live)
        base, peak, method = state, state + top, "cpu torch.profiler allocation events"
    c = trainer.coords
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank-{trainer.g.rank:05d}.json"), "w") as f:
        json.dump({"rank": trainer.g.rank, "pp": c.pp, "dp": c.dp, "tp": c.tp, "layout": str(trainer.cfg),
                   "state_bytes": base, "peak_bytes": peak, "method": method,
                   "num_microbatches": trainer.num_mb}, f)
    return loss, samples
