"""The reference trainer's rank: a Llama-style decoder stage under real DP x TP x PP.

``Trainer`` holds one rank's stage model, its AdamW state (sharded across DP with the
distributed optimizer) and its slice of every batch; ``train_step`` runs one 1F1B step and
``shard`` hands the state to a checkpoint. A DP replica's slice is its share of whole
micro-batches (``replica_samples``: uneven by at most one micro-batch when DP does not divide
them); every micro-batch's loss is weighted by 1 / (micro-batches in the global batch), so the
DP all-reduce (a sum) gives the full-batch gradient whatever the split. ``Spare`` is a rank the
layout leaves out: it trains nothing and takes part in each step's loss all-reduce, so that it
is alive and in the group at the next rescale. It starts from a ``RescaleResult`` (a resumed shard
or a fresh start) and reads no files but its batches. The run driver (options, start-up
checks, the training loop, checkpoint writes) is ``tenplex.train.run``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..data.batches import IndexBatches
from ..data.corpus import TokenCorpus
from ..data.partition import DataState, global_batch_ids, replica_samples
from ..elastic import RescaleResult
from ..elastic.bubbles import Span
from ..errors import CheckpointWriteError, ConfigError, LayoutError
from ..layout.models import ModelSpec, model_ptc, optimizer_names
from ..layout.ptc import PTC
from ..planning.memory import RECOMPUTE
from .batches import MountBatches
from .model import StageModel, init_global_tensor
from .parallel import Groups, all_reduce
from .schedule import Op, one_f_one_b

__all__ = ["TrainConfig", "Trainer", "Spare", "trainer_ptc", "failure_message", "DATA_OBJECT"]

DATA_OBJECT = "data"


@dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny"
    steps: int = 20
    global_batch: int = 8
    micro_batch: int = 2
    seq_len: int | None = None
    lr: float = 3e-3
    warmup: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 1234
    data: str | None = None
    ckpt: str | None = None
    ckpt_every: int = 0
    keep_last: int = 3
    parallel: str | None = None
    distributed_optimizer: bool = False
    log: str | None = None
    gpus_per_host: int = 8
    fail_at_step: int | None = None
    measure_memory: str | None = None
    store: str | None = None
    data_mount: str | None = None
    snapshot_every: int = 0
    replicas: int = 1
    resume_step: int | None = None
    allow_data_change: bool = False
    allow_model_change: bool = False
    recompute: str = "none"
    in_process: bool = False
    live_keep: int = 3
    dead_after: float = 10.0
    die_at: str | None = None
    pg_timeout: float = 60.0
    join: bool = False
    join_timeout: float = 120.0

    def __post_init__(self) -> None:
        """Refuse options that would make checkpoints, snapshots or the resume silently not happen."""
        at_least = {"steps": 0, "global_batch": 1, "micro_batch": 1, "ckpt_every": 0, "keep_last": 1,
                    "snapshot_every": 0, "replicas": 1, "gpus_per_host": 1, "live_keep": 2}
        for name, lo in at_least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {value!r}")
        if not (isinstance(self.dead_after, (int, float)) and self.dead_after > 0.2):
            raise ConfigError(f"--dead-after must be a number of seconds > 0.2 (the heartbeat interval is 0.1 s), "
                              f"got {self.dead_after!r}")
        if not (isinstance(self.pg_timeout, (int, float)) and not isinstance(self.pg_timeout, bool)
                and self.pg_timeout >= 1):
            raise ConfigError(f"--pg-timeout must be a number of seconds >= 1, got {self.pg_timeout!r}")
        if self.resume_step is not None and (isinstance(self.resume_step, bool) or
                                             not isinstance(self.resume_step, int) or self.resume_step < 0):
            raise ConfigError(f"--resume-step must be an integer >= 0, got {self.resume_step!r}")
        for name in ("ckpt", "store", "data"):
            if getattr(self, name) == "":
                raise ConfigError(f"--{name} is empty: pass a path or URL, or leave the option out")
        if self.resume_step is not None and not (self.ckpt or self.store):
            raise ConfigError("--resume-step needs checkpoints to resume from: pass --ckpt (or --store)")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.join and not self.in_process:
            raise ConfigError("--join takes the state live from the running workers: it needs --in-process")
        if not (isinstance(self.join_timeout, (int, float)) and self.join_timeout > 0):
            raise ConfigError(f"--join-timeout must be a positive number of seconds, got {self.join_timeout!r}")
        if self.snapshot_every and not self.store:
            raise ConfigError(f"--snapshot-every {self.snapshot_every} needs a host store to snapshot to: pass --store")


def trainer_ptc(model: str, *, distributed_optimizer: bool, seq_len: int | None = None, **overrides: Any) -> PTC:
    """The PTC the trainer checkpoints: model parameters, Adam state (fp32), step and data state.

    ``overrides``: model dimensions that replace the preset's (``model_ptc``'s keywords)."""
    base = model_ptc(model, seq_len=seq_len, distributed_optimizer=distributed_optimizer, **overrides)
    return PTC(base.tensors.values(), num_layers=base.num_layers, objects=base.objects + (DATA_OBJECT,),
               meta=base.meta)


class Trainer:
    """One rank of the job: its stage model, its optimizer state and its slice of every batch."""

    def __init__(self, tc: TrainConfig, ptc: PTC, groups: Groups, state: RescaleResult, corpus: TokenCorpus):
        self.tc, self.ptc, self.g = tc, ptc, groups
        self.cfg = groups.cfg
        self.spec = ModelSpec.from_json(ptc.meta["model"])
        dev = groups.device
        names = ptc.rank_tensors(self.cfg, groups.rank)
        self.param_names = [n for n in names if not n.startswith("optimizer.")]
        shard = state.shard
        if shard is None:  # fresh start: initialise through the PTC, the same for every layout
            shard = {}
            for n in names:
                spec = ptc.tensors[n]
                if n.startswith("optimizer."):
                    shard[n] = torch.zeros(ptc.local_shape(n, self.cfg), dtype=spec.dtype)
                else:
                    flat = spec.to_canonical(init_global_tensor(ptc, n, tc.seed))
                    shard[n] = ptc.shard_tensor(n, self.cfg, groups.rank, flat)
            shard["optimizer.step"] = 0
            shard[DATA_OBJECT] = DataState(corpus.num_samples, tc.global_batch, seed=tc.seed,
                                           source=corpus.fingerprint()).to_json()
        self.params = {n: shard[n].to(dev).requires_grad_(True) for n in self.param_names}
        self.opt = {n: shard[n].to(dev) for n in names if n.startswith("optimizer.")}
        self.step = int(shard["optimizer.step"])
        self.data = DataState.from_json(dict(shard[DATA_OBJECT]))
        if self.data.global_batch != tc.global_batch:  # run() refuses this earlier, on every rank
            raise ConfigError(f"the checkpoint was trained with global batch {self.data.global_batch}, "
                              f"not {tc.global_batch}; keep the global batch when resuming")
        if self.data.consumed != self.step * self.data.global_batch:
            raise ConfigError(f"data state says {self.data.consumed} samples consumed, step {self.step} implies "
                              f"{self.step} x {self.data.global_batch} = {self.step * self.data.global_batch}")
        self.model = StageModel(self.spec, self.cfg, groups.rank, self.params, groups.tp, tc.recompute).to(dev)
        c = self.cfg.coords(groups.rank)
        self.coords = c
        try:  # this replica's whole micro-batches: equal, or differing by one between replicas
            self.split = replica_samples(tc.global_batch, self.cfg.dp, tc.micro_batch)
        except ValueError as e:
            raise LayoutError(f"global batch {tc.global_batch} cannot be split into whole micro-batches of "
                              f"{tc.micro_batch} over dp={self.cfg.dp} replicas: {e}") from None
        self.num_mb = self.split[c.dp] // tc.micro_batch
        self.total_mb = tc.global_batch // tc.micro_batch
        self.schedule = one_f_one_b(self.cfg.pp, self.num_mb, c.pp)
        self.batches: Any
        if tc.data_mount:
            if os.environ.get("LOCAL_RANK", "0") == "0":  # one process per host re-shards its mount
                MountBatches.prepare(tc.data_mount, self.data, self.cfg.dp, tc.micro_batch)
            if dist.is_initialized():
                dist.barrier()
            self.batches = MountBatches(tc.data_mount, corpus)
        else:
            self.batches = IndexBatches(corpus)
        self.bubble_hook: Any = None  # called as hook(op, work) while a stage waits for a peer
        self.snapshot_task: Any = None  # tenplex.elastic.bubbles.SnapshotTask: begin at step start, finish before the update
        self.updating = False  # inside the optimizer step: the state is neither the old step's nor the new one's
        self.spans: list[Any] | None = None  # compute spans per op, when timelines are recorded
        self.die: Callable[[str, int], None] | None = None  # testing (--die-at): (point, step) at "forward", "backward", "optimizer"
        self.all_written = True  # the last step's all-reduce: every rank's writes of the oldest held step are done

    # -- one training step -------------------------------------------------------------------
    def train_step(self, *, fault: Callable[[], str | None] | None = None,
                   written: Callable[[], bool] | None = None) -> tuple[float, np.ndarray]:
        """One step on every rank; returns the global loss and the step's sample ids.

        ``fault``, called just before the step's loss all-reduce: this rank's failed save or
        snapshot, if any. Its flag travels in that all-reduce, so every rank learns of any
        rank's failure in the same step and raises CheckpointWriteError there (the failing
        rank with the cause). ``written``, called there too: whether this rank's writes of the
        oldest step ``StateRing`` holds are done; ``all_written`` then says whether every rank's are."""
        tc, c = self.tc, self.coords
        batch = self.batches.batch(self.data, self.cfg.dp, c.dp, tc.micro_batch).to(self.g.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        b = tc.micro_batch
        # each micro-batch (the same samples and tokens in each) weighs 1 / the global batch's count, so the
        # DP all-reduce (a sum) is the full-batch mean gradient for any split; num_mb * dp when even
        scale = 1.0 / self.total_mb
        for p in self.params.values():
            p.grad = None
        stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        pending: list[Any] = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.g.device)
        prev, nxt = c.pp - 1, c.pp + 1
        act_shape = (b, inputs.shape[1], self.spec.hidden)
        dtype = self.spec.dtype
        if self.bubble_hook is not None and hasattr(self.bubble_hook, "begin_iteration"):
            self.bubble_hook.begin_iteration(self.step)
        if self.snapshot_task is not None:  # the state after the previous step, copied in this step's bubbles
            self.snapshot_task.begin(self.step, self.consistent_state())
        for k, op in enumerate(self.schedule):
            j = op.mb
            if self.die is not None and (k == 0 or op.kind != self.schedule[k - 1].kind):
                self.die("forward" if op.kind == "F" else "backward", self.step + 1)
            t_op = time.perf_counter()
            if op.kind == "F":
                if self.model.is_first:
                    x_in = None
                    out = self.model.forward(inputs[j * b : (j + 1) * b])
                else:
                    x_in = self._recv(op, act_shape, dtype, self.g.stage_rank(prev))
                    t_op = time.perf_counter()  # compute starts once the activation is here
                    x_in.requires_grad_(True)
                    out = self.model.forward(x_in)
                if self.model.is_last:
                    loss = self.model.loss(out, targets[j * b : (j + 1) * b])
                    loss_sum += loss.detach().double()
                    out = loss * scale
                else:
                    pending.append(dist.isend(out.detach().contiguous(), self.g.stage_rank(nxt)))
                stash[j] = (x_in, out)
            else:
                x_in, out = stash.pop(j)
                if self.model.is_last:
                    out.backward()
                else:
                    grad = self._recv(op, act_shape, dtype, self.g.stage_rank(nxt))
                    t_op = time.perf_counter()
                    torch.autograd.backward(out, grad)
                if x_in is not None:
                    pending.append(dist.isend(x_in.grad.contiguous(), self.g.stage_rank(prev)))
            if self.spans is not None:
                self.spans.append(Span(self.step, op.kind, t_op, time.perf_counter(), f"{op.kind}{op.mb}"))
        for w in pending:
            w.wait()
        self._sync_grads()
        if self.snapshot_task is not None:
            t_fin = time.perf_counter()
            self.snapshot_task.finish()  # buckets not copied in bubbles: the only blocking part
            if self.spans is not None:
                self.spans.append(Span(self.step, "snapshot-blocking", t_fin, time.perf_counter()))
        self.updating = True
        self._adamw()
        # the global loss: last-stage, TP rank 0 ranks hold their DP slice's weighted share; and the ranks whose
        # save failed (spares take part with zeros)
        failure = fault() if fault is not None else None
        total = torch.tensor([float(loss_sum) * scale if (self.model.is_last and c.tp == 0) else 0.0,
                              0.0 if failure is None else 1.0, 1.0 if written is None or written() else 0.0],
                             dtype=torch.float64, device=self.g.device)  # nccl reduces device tensors only
        if dist.is_initialized():
            dist.all_reduce(total)
        self.all_written = int(total[2].item()) == (dist.get_world_size() if dist.is_initialized() else 1)
        if failed := int(total[1].item()):
            everyone = " on every rank" if dist.is_initialized() else ""
            raise CheckpointWriteError(f"{failure_message(failure, failed, self.g.rank)}; training stopped at step "
                                       f"{self.step + 1}{everyone}")
        samples = global_batch_ids(self.data)
        self.data = self.data.advance()
        self.step += 1
        self.updating = False
        return float(total[0].item()), samples

    def _recv(self, op: Op, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.g.device)
        work = dist.irecv(buf, src)
        if self.bubble_hook is not None:
            self.bubble_hook(op, work)  # returns once the receive has completed
        else:
            work.wait()
        return buf

    def _sync_grads(self) -> None:
        """DP all-reduce (sum) of every gradient in one flat buffer."""
        if self.g.dp is None:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params.values()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, self.g.dp)
        off = 0
        for p, g in zip(self.params.values(), grads):
            n = g.numel()
            p.grad = flat[off : off + n].view_as(p)
            off += n

    def _lr(self) -> float:
        if self.tc.warmup and self.step < self.tc.warmup:
            return self.tc.lr * (self.step + 1) / self.tc.warmup
        return self.tc.lr

    @torch.no_grad()
    def _adamw(self) -> None:
        """AdamW on the local shards; with the distributed optimizer each DP rank updates its
        fragment of the flat canonical shard, then the fragments are all-gathered."""
        tc = self.tc
        t = self.step + 1
        lr = self._lr()
        bc1, bc2 = 1 - tc.beta1**t, 1 - tc.beta2**t
        dist_opt = bool(self.ptc.meta.get("distributed_optimizer"))
        for i, (name, p) in enumerate(self.params.items()):
            if self.die is not None and i == len(self.params) // 2:
                self.die("optimizer", self.step + 1)  # half the parameters updated
            names = optimizer_names(name)
            m, v = self.opt[names["exp_avg"]], self.opt[names["exp_avg_sq"]]
            wd = tc.weight_decay if p.dim() >= 2 else 0.0
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if dist_opt:
                flat_p = self.ptc.to_local_flat(name, p.detach())
                flat_g = self.ptc.to_local_flat(name, grad)
                c = m.numel()
                lo = self.coords.dp * c
                n_real = max(0, min(c, flat_p.numel() - lo))
                frag_p = torch.zeros(c, dtype=p.dtype, device=p.device)
                frag_g = torch.zeros(c, dtype=p.dtype, device=p.device)
                frag_p[:n_real] = flat_p[lo : lo + n_real]
                frag_g[:n_real] = flat_g[lo : lo + n_real]
                _adamw_update(frag_p, frag_g, m, v, lr, wd, tc, bc1, bc2)
                frag_p[n_real:] = 0
                parts = [torch.empty_like(frag_p) for _ in range(self.cfg.dp)]
                if self.g.dp is not None:
                    dist.all_gather(parts, frag_p, group=self.g.dp)
                else:
                    parts = [frag_p]
                full = torch.cat(parts)[: flat_p.numel()]
                p.copy_(self.ptc.from_local_flat(name, self.cfg, full))
            else:
                _adamw_update(p, grad, m, v, lr, wd, tc, bc1, bc2)

    # -- checkpoint ---------------------------------------------------------------------------
    def consistent_state(self) -> dict[str, Any]:
        """The state after step ``self.step`` as the in-process ring and snapshots keep it: this
        rank's tensors (not copies) plus the step and the data position. Valid outside the
        optimizer step (``updating``)."""
        return {**self.state_tensors(), "optimizer.step": self.step, DATA_OBJECT: self.data.to_json()}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and optimizer state under their PTC names (not copied)."""
        out = {n: p.detach() for n, p in self.params.items()}
        out.update(self.opt)
        return out

    def shard(self) -> dict[str, Any]:
        """A copy of this rank's state (copied: background writers must not see later updates)."""
        out: dict[str, Any] = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        out.update({n: t.to("cpu", copy=True) for n, t in self.opt.items()})
        out["optimizer.step"] = self.step
        out[DATA_OBJECT] = self.data.to_json()
        return out


class Spare:
    """A rank the layout leaves out (``RescaleResult.idle``): no model, state or data. Each
    ``train_step`` takes part in the trainers' loss all-reduce over the default group, so a spare
    follows the job step by step, learns of any rank's failed save with them, and is alive and
    in the group when the next rescale gives it a place."""

    def __init__(self, tc: TrainConfig, groups: Groups, state: RescaleResult) -> None:
        self.tc, self.g = tc, groups
        self.cfg = groups.cfg
        self.step = state.step
        self.data: DataState | None = None
        self.die: Callable[[str, int], None] | None = None
        self.all_written = True
        if tc.data_mount and dist.is_initialized():
            dist.barrier()  # the trainers' barrier after their host re-shards its mount

    def train_step(self, *, fault: Callable[[], str | None] | None = None,
                   written: Callable[[], bool] | None = None) -> tuple[float, np.ndarray]:
        """The step's loss all-reduce with the trainers; returns the global loss and no samples.
        A spare writes nothing: its ``written`` flag is set."""
        if self.die is not None:
            self.die("forward", self.step + 1)  # testing (--die-at): a spare dies in a step too
        failure = fault() if fault is not None else None
        total = torch.tensor([0.0, 0.0 if failure is None else 1.0, 1.0], dtype=torch.float64, device=self.g.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        self.all_written = int(total[2].item()) == (dist.get_world_size() if dist.is_initialized() else 1)
        if failed := int(total[1].item()):
            raise CheckpointWriteError(f"{failure_message(failure, failed, self.g.rank)}; training stopped at step "
                                       f"{self.step + 1} on every rank")
        self.step += 1
        return float(total[0].item()), np.zeros(0, dtype=np.int64)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}


def _adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, wd: float,
                  tc: TrainConfig, bc1: float, bc2: float) -> None:
    if wd:
        p.mul_(1 - lr * wd)
    m.mul_(tc.beta1).add_(g, alpha=1 - tc.beta1)
    v.mul_(tc.beta2).addcmul_(g, g, value=1 - tc.beta2)
    denom = (v / bc2).sqrt_().add_(tc.eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


def failure_message(fault: str | None, failed: int, rank: int) -> str:
    """This rank's failure, or (on a healthy rank) how many others failed."""
    where = f"rank {rank}: " if dist.is_initialized() else ""
    return fault or (f"{where}{failed} other rank(s) could not write a checkpoint or snapshot (their output says "
                     "which and why)")
