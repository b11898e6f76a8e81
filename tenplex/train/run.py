"""The reference trainer: a Llama-style decoder under real DP x TP x PP, resumable under any layout.

Run alone (``python -m tenplex.train --model tiny --steps 20``) or under torchrun. At start-up
it calls ``tenplex.rescale``: the newest checkpoint that verifies (or ``--resume-step``) is
loaded under the layout chosen for the current world size, and training continues from the
saved step and data position, on the same data and model settings unless told otherwise.

Failures are loud: bad options, a checkpoint or store directory that cannot be written and a
checkpoint that cannot be resumed stop every rank at start-up (exit code 2, one line); a
checkpoint or snapshot that fails to save stops every rank at the next step or at exit (exit
code 1, naming the step and the cause).

With ``--in-process`` a peer failure does not stop the survivors: they agree on a new group,
``rescale(live=...)`` moves their state to the layout chosen for their number and training goes
on (``tenplex.elastic.inprocess``, docs/inprocess.md); a failure during that recovery exits with code
75 so that torchrun's agent restarts the job.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import default_save_id, save
from ..data.corpus import TokenCorpus, stdlib_corpus
from ..data.partition import DataState
from ..elastic import RescaleResult, agree_on_step, env_world, live_order, rescale
from ..elastic.inprocess import DIE_POINTS, JOIN_FAILED, RECOVERY_FAILED, DieAt, LiveRecovery, RecoveryConfig, layout_fits, \
    recover_in_process, warm_up
from ..elastic.membership_runtime import JOB_ENV, MEMBERSHIP_STORE_ENV, Membership, job_key, join_membership, \
    membership_store, start_membership
from ..elastic.latency import RecoveryTimes
from ..elastic.ring import HeldAs, StateRing, exit_on_sigterm, flush_ring
from ..errors import CheckpointMismatchError, CheckpointWriteError, ConfigError, PeerFailure, TenplexError
from ..layout.config import ParallelConfig
from ..layout.models import ModelSpec
from ..layout.ptc import PTC
from ..planning.choose import Chooser, default_chooser, layout_options_for
from ..planning.memory import RECOMPUTE
from ..store import HostStore, recovery_tiers
from ..urls import url_fs
from .live import ring_in_bubbles, settle_ring
from .memory_probe import measure_step_memory
from .parallel import init_distributed, join_process_group, local_device
from .trainer import DATA_OBJECT, Spare, TrainConfig, Trainer, failure_message, trainer_ptc

__all__ = ["main", "parse_args", "run", "check_writable"]

log = logging.getLogger(__name__)
PROG = "python -m tenplex.train"
PROCESS_START = time.time()  # close to when this worker process started (after the torch import)


# -- command line -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> TrainConfig:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="model preset (Llama family), e.g. tiny")
    ap.add_argument("--steps", type=int, default=20, help="train until this global step, resuming if possible")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", default=None, help="uint16 token file (default: the stdlib byte corpus)")
    ap.add_argument("--ckpt", default=None,
                    help="checkpoint URL (any fsspec URL; a directory that can be created and written)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (and at the end); 0: at the end")
    ap.add_argument("--keep-last", type=int, default=3, help="keep the K newest complete checkpoints (K >= 1)")
    ap.add_argument("--resume-step", type=int, default=None, metavar="N",
                    help="resume from step N (exit code 2 if it is missing or does not verify); default: the "
                         "newest step that verifies on every rank")
    ap.add_argument("--allow-data-change", action="store_true",
                    help="resume although the data's fingerprint (SHA-256 of the token file) differs from the "
                         "checkpoint's, continuing at the same sample position in this data's order")
    ap.add_argument("--allow-model-change", action="store_true",
                    help="resume although the checkpoint was saved with other model settings (heads, norm eps, "
                         "...) whose tensors have the same shapes")
    ap.add_argument("--parallel", default=None,
                    help="pin the layout, e.g. dp=2,tp=2,pp=1; several separated by '/' pin one per world size "
                         "(world sizes not listed are chosen by rescale); WORLD:LAYOUT pins a layout of at most "
                         "WORLD ranks for that world size, e.g. 5:dp=3,tp=1,pp=1 (ranks 3 and 4 wait as spares)")
    ap.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer state across DP")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--log", default=None, help="rank 0 appends one JSON object per step here")
    ap.add_argument("--store", default=None, metavar="auto|DIR",
                    help="host tensor store for snapshots: 'auto' takes TENPLEX_STORE_ROOT/URL and TENPLEX_STORES "
                         "from the launcher; a directory works without a store server (single host)")
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="snapshot to the host store (--store) every K steps")
    ap.add_argument("--data-mount", default=None, metavar="DIR",
                    help="read batches from a `tenplex mount` of the corpus index (re-sharded after a rescale); "
                         "without it the same bytes come from the index reader")
    ap.add_argument("--replicas", type=int, default=1,
                    help="replicas the host stores keep of each snapshot (set on `tenplex store serve`)")
    ap.add_argument("--measure-memory", default=None, metavar="DIR",
                    help="measure this rank's peak memory during the second step into DIR/rank-N.json")
    ap.add_argument("--recompute", choices=RECOMPUTE, default="none",
                    help="activation recomputation (torch.utils.checkpoint): none, selective (norms, SwiGLU) or "
                         "full (each layer); the layout chooser counts its memory (default none)")
    ap.add_argument("--fail-at-step", type=int, default=None,
                    help="testing: every rank exits with an error after finishing this step (first run only)")
    ap.add_argument("--in-process", action="store_true",
                    help="recover from a peer failure in-process: survivors agree on a new group through the store "
                         f"{MEMBERSHIP_STORE_ENV} names (host:port), choose the layout for their number and move "
                         f"their state live; a failure during that recovery exits with code {RECOVERY_FAILED} "
                         "(the launcher restarts the job)")
    ap.add_argument("--live-keep", type=int, default=3,
                    help="--in-process: consistent states kept in memory (CPU copies of this rank's state after "
                         "each of the last K steps, K >= 2)")
    ap.add_argument("--dead-after", type=float, default=10.0,
                    help="--in-process: seconds without a heartbeat (every 0.1 s) after which a peer no open link "
                         "vouches for is dead (a killed process or a vanished host ends its links: known within "
                         "milliseconds or 3 s; a starved or stopped one keeps them and is not dead)")
    ap.add_argument("--pg-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="timeout of the job's collectives: how long a rank blocked on a peer that stopped "
                         "answering (a cut network link, a hung host) waits before it fails and the launcher "
                         "restarts it (default 60)")
    ap.add_argument("--join", action="store_true",
                    help="--in-process: join a running job (scale up) instead of starting one: register in the "
                         f"store {MEMBERSHIP_STORE_ENV} names under the job's key ({JOB_ENV}, else torchrun's run id, "
                         "else MASTER_ADDR:MASTER_PORT), wait until the workers admit this process at a step "
                         "boundary and receive the state live from them")
    ap.add_argument("--join-timeout", type=float, default=120.0,
                    help=f"--join: seconds to wait for the job and for admission (then exit code {JOIN_FAILED})")
    ap.add_argument("--die-at", default=None, metavar="RANK:STEP:POINT[,...]",
                    help="testing: SIGKILL the worker of first-group rank RANK at POINT of step STEP "
                         f"({', '.join(DIE_POINTS)}; first launch only)")
    a = ap.parse_args(argv)
    try:
        return TrainConfig(model=a.model, steps=a.steps, global_batch=a.global_batch, micro_batch=a.micro_batch,
                           seq_len=a.seq_len, lr=a.lr, warmup=a.warmup, seed=a.seed, data=a.data, ckpt=a.ckpt,
                           ckpt_every=a.ckpt_every, keep_last=a.keep_last, parallel=a.parallel,
                           distributed_optimizer=a.distributed_optimizer, log=a.log, gpus_per_host=a.gpus_per_host,
                           fail_at_step=a.fail_at_step, measure_memory=a.measure_memory, store=a.store,
                           snapshot_every=a.snapshot_every, replicas=a.replicas, data_mount=a.data_mount,
                           resume_step=a.resume_step, allow_data_change=a.allow_data_change,
                           allow_model_change=a.allow_model_change, recompute=a.recompute,
                           in_process=a.in_process, live_keep=a.live_keep, die_at=a.die_at,
                           dead_after=a.dead_after, pg_timeout=a.pg_timeout, join=a.join,
                           join_timeout=a.join_timeout)
        DieAt.parse(a.die_at)
    except ConfigError as e:
        ap.error(str(e))  # exits 2


@dataclass(frozen=True)
class _Start:
    """What a rank prepared before joining the process group."""

    ptc: PTC
    corpus: TokenCorpus
    store: Any
    tiers: list[Any] | None
    state: RescaleResult | None  # None: a joiner (its state comes live from the running workers)


# Start-up errors a user can fix (options, paths, checkpoints, data): one line, exit code 2.
_USER_ERRORS = (TenplexError, ValueError, OSError)


def _prepare(tc: TrainConfig, rank: int, world: int) -> _Start:
    """Check the checkpoint and store directories, hash the data, and load this rank's state
    (a joiner loads nothing)."""
    ptc = trainer_ptc(tc.model, distributed_optimizer=tc.distributed_optimizer, seq_len=tc.seq_len)
    spec = ModelSpec.from_json(ptc.meta["model"])
    if tc.ckpt:
        check_writable(tc.ckpt, "--ckpt")
    store = _host_store(tc.store)
    if store is not None:
        check_writable(store.root, "--store")
    corpus = TokenCorpus(tc.data, spec.seq_len) if tc.data else stdlib_corpus(spec.seq_len)
    corpus.fingerprint()  # hashed (or read from its cache) now, not while the other ranks wait
    tiers = None
    if store is not None:
        urls = [u for u in os.environ.get("TENPLEX_STORES", "").split(",") if u]
        tiers = recovery_tiers(store, urls, tc.ckpt, token=store.token)
    if tc.join:
        return _Start(ptc, corpus, store, tiers, None)
    try:
        state = rescale(tc.ckpt, ptc, rank=rank, world_size=world, parallel=_pinned_layout(tc.parallel, world),
                        layout_options=dict(global_batch=tc.global_batch, micro_batch=tc.micro_batch,
                                            recompute=tc.recompute),
                        gpus_per_host=tc.gpus_per_host, tiers=tiers, step=tc.resume_step,
                        allow_meta_change=tc.allow_model_change)
    except CheckpointMismatchError as e:  # say how to override it here
        raise CheckpointMismatchError(str(e).replace("allow_meta_change=True", "--allow-model-change")) from None
    return _Start(ptc, corpus, store, tiers, state)


def check_writable(url: str, option: str) -> None:
    """ConfigError unless a file can be created in the directory ``url`` (created when missing).

    Writes and removes an empty probe file, so a directory under /proc, a file where the
    directory should be, a read-only mount or a missing permission stop the job at start-up
    rather than at its first save."""
    try:
        fs, root = url_fs(url, what=option)
        root = root or "/"
        fs.makedirs(root, exist_ok=True)
        probe = f"{root.rstrip('/')}/.tenplex-probe-{uuid.uuid4().hex[:12]}"
        with fs.open(probe, "wb") as f:
            f.write(b"")
        fs.rm(probe)
    except (OSError, ValueError, ImportError, TypeError) as e:
        raise ConfigError(f"{option} {url}: cannot create and write files there ({_describe(e)}); pass a directory "
                          "this process can create and write") from None


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__}: {e.strerror}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}" if not isinstance(e, TenplexError) else str(e)


def _failed_ranks(error: BaseException | str | None, device: torch.device) -> int:
    """How many ranks report a failure (a collective over the default group; local without one)."""
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag)
    return int(flag.item())


def _check_resume(state: RescaleResult, corpus: TokenCorpus, tc: TrainConfig) -> RescaleResult:
    """``state`` if its data state fits this job's batch and data, else ConfigError naming both
    fingerprints; with ``allow_data_change`` the data state moves to this data (same position)."""
    if state.fresh or state.shard is None:
        return state
    saved = DataState.from_json(dict(state.shard[DATA_OBJECT]))
    if saved.global_batch != tc.global_batch:
        raise ConfigError(f"checkpoint step {state.step} was trained with global batch {saved.global_batch}, "
                          f"not {tc.global_batch}: keep --global-batch {saved.global_batch} when resuming")
    now = corpus.fingerprint()
    if saved.source == now and saved.num_samples == corpus.num_samples:
        return state
    what = (f"checkpoint step {state.step} was trained on data {saved.source or '(not recorded)'} "
            f"({saved.num_samples} samples); {corpus.path} is {now} ({corpus.num_samples} samples of "
            f"{corpus.seq_len + 1} tokens)")
    if not tc.allow_data_change:
        raise ConfigError(f"{what}: resume with the data it was trained on, or pass --allow-data-change to "
                          "continue on this data")
    log.warning("%s: continuing on this data from sample position %d (--allow-data-change)", what, saved.consumed)
    data = dataclasses.replace(saved, source=now, num_samples=corpus.num_samples)
    return dataclasses.replace(state, shard={**state.shard, DATA_OBJECT: data.to_json()})


def _all_skipped(mine: tuple[tuple[int, str, str], ...]) -> list[dict[str, Any]]:
    """The attempts any rank passed over at start-up, with the ranks that did (rank 0 reports them)."""
    parts: list[Any] = [list(mine)]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, list(mine))
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for r, items in enumerate(parts):
        for step, sid, why in items:
            entry = merged.setdefault((step, sid), {"step": step, "save_id": sid, "reason": why, "ranks": []})
            entry["ranks"].append(r)
    return sorted(merged.values(), key=lambda e: (-e["step"], e["save_id"]))


class _Writer:
    """Background checkpoint writes, one at a time. An exception in the thread is kept as a
    message for the main thread (``poll``, ``wait``), not printed by threading's hook and lost."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, describe: Callable[[BaseException], str], fn: Callable[..., Any], *args: Any,
              **kwargs: Any) -> None:
        assert self._thread is None, "wait() for the previous write first"

        def target() -> None:
            try:
                fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - any failure is the main thread's to report
                log.debug("background save failed", exc_info=True)
                self._error = describe(e)

        self._thread = threading.Thread(target=target, name="tenplex-save", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        """Whether a write is under way."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> str | None:
        """The error of a finished write (None while one runs or when all succeeded)."""
        if self._thread is not None and not self._thread.is_alive():
            return self.wait()
        return self._error

    def wait(self, interrupt: Callable[[], None] | None = None) -> str | None:
        """Wait for the write under way; the error of any write so far. ``interrupt`` (in-process
        runs: ``Membership.check``) is called every 10 ms meanwhile: its ``PeerFailure`` abandons
        the wait (the write goes on; a later ``wait`` joins it), so a death found during a long
        write starts the recovery at once."""
        if self._thread is not None:
            while interrupt is not None and self._thread.is_alive():
                interrupt()
                self._thread.join(0.01)
            self._thread.join()
            self._thread = None
        return self._error


def run(tc: TrainConfig) -> int:
    """Train one rank; returns the exit code (2: the job could not start, on every rank).
    Raises CheckpointWriteError on every rank when any rank's save or snapshot failed."""
    rank, world = env_world()
    if os.environ.get("TENPLEX_PID_DIR"):  # lets a simulated node failure kill this worker by pid
        with open(os.path.join(os.environ["TENPLEX_PID_DIR"], f"local-{os.environ.get('LOCAL_RANK', '0')}.pid"),
                  "w") as f:
            f.write(str(os.getpid()))
    t_start = time.perf_counter()
    if tc.join:
        return _join(tc, t_start)
    # Start-up: each rank finds its own problems (a directory it cannot write, damage only it
    # reads, another model or data), then all ranks agree, so that all stop together (exit 2).
    start: _Start | None = None
    error: BaseException | None = None
    try:
        start = _prepare(tc, rank, world)
    except Exception as e:  # noqa: BLE001 - reported once the ranks have agreed
        error = e
    device = join_process_group(timeout_s=tc.pg_timeout)
    try:
        failed = _failed_ranks(error, device)
        if not failed:
            assert start is not None
            try:  # ranks that fell back to different steps settle on one, then the data is checked
                state = agree_on_step(start.state, tc.ckpt, start.ptc, tiers=start.tiers,
                                      allow_meta_change=tc.allow_model_change, gpus_per_host=tc.gpus_per_host)
                state = _check_resume(state, start.corpus, tc)
            except Exception as e:  # noqa: BLE001
                error = e
            failed = _failed_ranks(error, device)
        if failed:
            return _startup_failed(error, failed, rank, world)
        assert start is not None
        return _train(tc, start, state, rank, world, t_start)
    finally:
        if dist.is_initialized():
            # groups the trainer's reference cycles keep go now, while the interpreter runs: a gloo worker
            # thread still dropping its last collective's tensors when the interpreter finalizes aborts the
            # process ("terminate called without an active exception", seen in a core dump)
            gc.collect()
            dist.destroy_process_group()


def _join(tc: TrainConfig, t_start: float) -> int:
    """A joiner: prepare alone, register with the running job and train from the state it receives."""
    try:
        start = _prepare(tc, -1, 0)
        device = local_device()
        print(f"{PROG}: joiner: waiting for job {job_key()!r} in the store {os.environ.get(MEMBERSHIP_STORE_ENV)}",
              file=sys.stderr, flush=True)
        membership = join_membership(membership_store(), "nccl" if device.type == "cuda" else "gloo",
                                     timeout_s=tc.join_timeout, dead_after=tc.dead_after)
    except Exception as e:  # noqa: BLE001 - one line, like a start-up failure
        if not isinstance(e, _USER_ERRORS):
            log.error("the joiner could not start", exc_info=e)
        print(f"{PROG}: error: joiner: {_one_line(_describe(e))}", file=sys.stderr, flush=True)
        return JOIN_FAILED
    print(f"{PROG}: joiner {membership.id}: registered with {membership.prefix}; waiting to be admitted",
          file=sys.stderr, flush=True)
    try:
        return _train(tc, start, None, -1, 0, t_start, joiner=membership)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _startup_failed(error: BaseException | None, failed: int, rank: int, world: int) -> int:
    """Say why this rank stops at start-up; the exit code: 2, or 1 for an error that is no input's
    fault (a bug: its traceback is logged)."""
    bug = error is not None and not isinstance(error, _USER_ERRORS)
    if bug:
        log.error("rank %d could not start", rank, exc_info=error)
    message = _describe(error) if error is not None else \
        f"{failed} other rank(s) could not start (their output says why)"
    where = f"rank {rank}: " if world > 1 else ""
    print(f"{PROG}: error: {where}{_one_line(message)}", file=sys.stderr, flush=True)
    return 1 if bug else 2


def _one_line(message: str) -> str:
    return " | ".join(ln.strip() for ln in message.strip().splitlines() if ln.strip()) or "failed (no message)"


def _train(tc: TrainConfig, start: _Start, state: RescaleResult | None, rank: int, world: int, t_start: float,
           joiner: Membership | None = None) -> int:
    """The training loop of a rank whose start-up every rank agreed on; with ``joiner``, of a
    process joining a running job (its layout, state, groups and trainer come with its admission)."""
    return _Loop(tc, start, state, rank, world, t_start, joiner).run()


class _Loop:
    """One rank's run in named steps: set-up (groups, trainer, membership, ring), an in-process
    regroup (:meth:`recover`), a training step, its snapshot and its checkpoint, the end."""

    def __init__(self, tc: TrainConfig, start: _Start, state: RescaleResult | None, rank: int, world: int,
                 t_start: float, joiner: Membership | None) -> None:
        self.tc, self.start, self.ptc, self.store = tc, start, start.ptc, start.store
        self.state, self.rank, self.world = state, rank, world
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.groups: Any = None
        self.trainer: Any = None
        if joiner is None:
            assert state is not None
            self.groups = init_distributed(state.cfg, timeout_s=tc.pg_timeout)
            self.trainer = Trainer(tc, self.ptc, self.groups, state, start.corpus) if self.groups.placed else \
                Spare(tc, self.groups, state)
            _start_record(tc, state, self.groups, rank, world, self.restart, t_start, self.trainer.step)
        # --measure-memory: the second step of this process
        self.first_step = self.trainer.step if self.trainer is not None else -2
        # Save ids must differ between launches. Under a process group the default does (a nonce shared
        # through its store); a process alone has only its environment, the same at every launch, so a
        # relaunch that saves a step again (after --resume-step, or passing over a damaged step) would
        # reuse the id: it gets a random one. A joiner saves in the group that admits it.
        self.save_id = None if dist.is_initialized() or joiner is not None else uuid.uuid4().hex[:8]
        self.writer = _Writer()
        self.snapper = _Writer()  # host-store snapshots: in the foreground, but a recovery need not wait for one
        self.fault: str | None = None  # this rank's first failed save or snapshot: every rank stops at the next step
        self.where = f"rank {rank}: " if world > 1 else ""
        # testing: by first-group rank (a joiner: by its member id)
        self.die = DieAt.hook(DieAt.parse(tc.die_at), rank if joiner is None else joiner.id) \
            if self.restart == 0 else None
        self.membership: Membership | None = joiner
        self.ring: StateRing | None = StateRing(tc.live_keep) if joiner is not None else None
        # the trainer whose states the ring holds (set with ring.held_as); weak: a reference kept past a
        # failure would keep its broken groups' connections open and the peers blocked on them
        self.ring_trainer: Callable[[], Any] = lambda: None
        if self.trainer is not None:
            self.trainer.die = self.die
        self.choose = _chooser(tc, self.ptc)
        if joiner is None and tc.in_process and dist.is_initialized():
            self.membership = start_membership(membership_store(), dead_after=tc.dead_after)
            self.ring = StateRing(tc.live_keep)
            self._describe_ring()
            _record(self.ring, self.trainer)
            _ring_side_task(self.ring, self.trainer, self.groups)
            assert state is not None
            self.membership.fits = layout_fits(self.ptc, state.cfg, self.choose)
            warm_up(self.ptc, state.cfg, self.choose, self.membership.members)
        self.recovered: dict[str, Any] | None = None  # the in-process recovery whose first step is still to come
        # why the next pass regroups before training: "join" (a boundary the members agreed to admit
        # joiners at), "joining" (this process is a joiner), else the failure's message
        self.regroup: str | None = "joining" if joiner is not None else None
        self.writing: list[int] = []  # the step the background writer writes
        self.snapped: set[int] = set()  # steps whose snapshot of this rank's state is in the host store
        self.snapping: list[int] = []  # the step whose snapshot the main thread is writing
        if self.membership is not None and self.store is not None:
            exit_on_sigterm(self.flush)

    # -- in-process state ----------------------------------------------------------------------
    def _describe_ring(self) -> None:
        """What the ring's states are, set with them (its layout, this rank, the snapshots' save id):
        the SIGTERM flush writes them into the attempt the other ranks write. Derived in the handler,
        the id changed once a recovery had dropped the process group (its launch nonce): a rank that
        noticed a peer's exit before its own SIGTERM wrote the step every rank held into another
        attempt, which the store's GC then ranked against the others' (issue 29 item 6); a handler
        running inside a recovery must not mix the old ring with the new layout, rank or trainer."""
        assert self.state is not None and self.ring is not None
        sid = self.save_id or default_save_id(self.state.cfg, self.ptc)
        self.ring.held_as = HeldAs(self.state.cfg, self.rank, sid)
        self.ring_trainer = weakref.ref(self.trainer)

    def flush(self) -> None:
        """SIGTERM (torchrun's agent restarting the workers, e.g. for a joining node): put the
        consistent states held in memory that the host store lacks there (``flush_ring``)."""
        if self.snapping and self.snapper.wait() is None:  # the periodic snapshot under way: os._exit would cut
            self.snapped.update(self.snapping)  # it off (its temporary file left, this rank's part missing)
        ring, trainer, store = self.ring, self.trainer, self.store
        assert ring is not None and store is not None
        extra = {}
        if ring.states() and isinstance(trainer, Trainer) and trainer is self.ring_trainer() and not trainer.updating:
            extra[trainer.step] = trainer.consistent_state()  # completed, not yet copied into the ring

        def write(held_as: HeldAs, step: int, state: Mapping[str, Any]) -> None:
            store.snapshot(self.ptc, held_as.layout, held_as.rank, state, step=step, replicate=bool(store.url),
                           save_id=held_as.save_id)

        # (a failed snapshot is written again: its attempt would be refused)
        flush_ring(ring, write, where=f"the host store {store.root}", skip=self.snapped | set(self.snapping),
                   extra=extra)

    def guard(self) -> Any:
        return self.membership.guard() if self.membership is not None else contextlib.nullcontext()

    def pending_fault(self) -> str | None:
        """A background write that failed by now counts in this step."""
        return self.fault or self.writer.poll()

    def written(self) -> bool:
        """Whether this rank's writes of the oldest step the ring holds for them are done."""
        ring = self.ring
        return ring is None or ring.oldest_held is None or \
            not (self.writer.running() and self.writing == [ring.oldest_held])

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        failed = 0
        while True:
            if self.regroup is not None:
                self.recover()
            try:
                if self.train_steps():
                    continue  # regroup first (joiners to admit)
                self.fault = self.fault or self.writer.wait()
                with self.guard():
                    failed = _failed_ranks(self.fault, self.groups.device)  # the last saves, agreed by every rank
            except PeerFailure as e:
                self.regroup = str(e)
                if self.ring is not None and self.trainer is not None:
                    settle_ring(self.ring, self.trainer)
            else:
                break
        if self.membership is not None:
            self.membership.close()
        if failed:
            raise CheckpointWriteError(f"{failure_message(self.fault, failed, self.rank)}; training stopped after "
                                       f"step {self.trainer.step}{' on every rank' if dist.is_initialized() else ''}")
        return 0

    def recover(self) -> None:
        """Regroup in-process (after a peer failure, or to admit joiners, or as a joiner) and rebuild
        the groups and the trainer for the new layout; any failure exits with RECOVERY_FAILED
        (a joiner: JOIN_FAILED) so that the launcher's restart path takes over."""
        membership, ring, tc, regroup = self.membership, self.ring, self.tc, self.regroup
        assert membership is not None and ring is not None and regroup is not None
        # Out of the except block: the exception's frames (the step's autograd graph, its p2p work)
        # are gone. Dropping the trainer too frees the last references to the broken groups, so
        # gloo closes their connections and peers still blocked on this rank fail at once (kept,
        # they held a peer blocked until a process exited; no gc.collect() needed, measured).
        if regroup == "join":
            log.info("rank %d: admitting joiners %s after step %d", self.rank, list(membership.pending()),
                     self.trainer.step)
        elif regroup != "joining":
            log.warning("rank %d: %s: recovering in-process", self.rank, regroup)
        at = self.trainer.step + 1 if self.trainer is not None else 0
        self.trainer = self.groups = None
        # gloo closes a group's connections only when its last reference goes: a young
        # reference cycle through the step's objects must not keep one (1 ms)
        gc.collect(1)
        die = self.die
        config = RecoveryConfig(url=tc.ckpt, sources=tuple(_sources(self.store, tc.ckpt)), choose=self.choose,
                                tiers=self.start.tiers, gpus_per_host=tc.gpus_per_host, join_timeout=tc.join_timeout,
                                before_migrate=(lambda: die("migrate", at)) if die else None)
        try:
            if not membership.joining:
                assert self.state is not None
                membership.order = live_order(self.ptc, self.state.cfg, self.choose, membership.members)
            rec = recover_in_process(membership, ring, lambda nm: self.ptc, config, join=regroup == "join")
            t_built = time.perf_counter()
            self.groups = init_distributed(rec.result.cfg, timeout_s=tc.pg_timeout)
            self.trainer = Trainer(tc, self.ptc, self.groups, rec.result, self.start.corpus) if self.groups.placed \
                else Spare(tc, self.groups, rec.result)
            if rec.times is not None:  # the trainer's groups and modules for the new layout: its rebuild
                rec = dataclasses.replace(rec, times=rec.times.with_extra(rebuild_s=time.perf_counter() - t_built))
        except Exception as e2:  # noqa: BLE001 - any failure here: the launcher's restart takes over
            self._recovery_failed(e2)
        before = self.state.cfg if self.state is not None else rec.result.previous
        self.state = rec.result
        membership.fits = layout_fits(self.ptc, self.state.cfg, self.choose)
        self.trainer.die = die
        self.rank, self.world = self.groups.rank, dist.get_world_size()
        self.where = f"rank {self.rank}: "
        ring.clear()
        self._describe_ring()
        _record(ring, self.trainer)
        _ring_side_task(ring, self.trainer, self.groups)
        self.recovered = _recovery_record(rec, before, self.trainer.step,
                                          "failure" if regroup not in ("join", "joining") else "join")
        if self.rank == 0:
            log.warning("%s", self.state.summary())
            _emit(tc.log, {"event": "recover", **self.recovered})
        self.regroup = None

    def _recovery_failed(self, e: BaseException) -> None:
        """Say why the recovery (a joiner: its admission) failed and exit with its code at once."""
        assert self.membership is not None
        joining = self.membership.joining
        code = JOIN_FAILED if joining else RECOVERY_FAILED
        who = f"joiner {self.membership.id}" if joining or self.rank < 0 else f"rank {self.rank}"
        what = "admission" if joining else "recovery"
        log.error("%s: in-process %s failed", who, what, exc_info=e)
        print(f"{PROG}: error: {who}: in-process {what} failed ({_one_line(_describe(e))}); exiting with code "
              f"{code}{'' if joining else ' so that the launcher restarts the job'}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(code)  # no clean-up that could wait on a dead peer

    def train_steps(self) -> bool:
        """Train until ``tc.steps``, snapshotting and checkpointing on the way; True when the
        members agreed to admit joiners after the step just done (regroup first)."""
        tc, membership = self.tc, self.membership
        while self.trainer.step < tc.steps:
            step, done = self.step()
            self.snapshot(step)
            self.checkpoint(step, done)
            if tc.fail_at_step is not None and self.trainer.step == tc.fail_at_step and self.restart == 0:
                self.writer.wait()  # deterministic for tests: the pending checkpoint lands first
                log.error("rank %d: simulated failure after step %d", self.rank, self.trainer.step)
                os._exit(17)
            # scale up: every member votes on this boundary (one store call), so all admit the waiting
            # joiners after the same step; none with no step left to run, nor at a launch's first
            # boundary (the ring's state of that step is recorded in the next step's bubbles: the join
            # would move the launch's first state and redo the step)
            if membership is not None and not done and membership.join_due(
                    step, propose=step + 1 < tc.steps and step > self.first_step + 1):
                self.regroup = "join"
                return True
        return False

    def step(self) -> tuple[int, bool]:
        """One training step (its state into the ring, its record logged); the step reached and
        whether it is the last."""
        tc, trainer, ring, state = self.tc, self.trainer, self.ring, self.state
        assert state is not None
        t0 = time.perf_counter()
        if self.membership is not None:
            self.membership.check()  # a death the heartbeats found between collectives
        with self.guard():
            if tc.measure_memory and trainer.step == self.first_step + 1 and self.groups.placed:
                loss, samples = measure_step_memory(trainer, tc.measure_memory, fault=self.pending_fault,
                                                    written=self.written)
            else:
                loss, samples = trainer.train_step(fault=self.pending_fault, written=self.written)
        if ring is not None and trainer.all_written:
            ring.confirm()  # every rank's write of that step is done: a dead rank's pieces are there
        if ring is not None and getattr(trainer, "snapshot_task", None) is None:  # else: the next step's bubbles
            _record(ring, trainer)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {trainer.step}")
        if self.recovered is not None and self.recovered.get("latency"):  # the recovery's table, its first step done
            times = RecoveryTimes(**{k: v for k, v in self.recovered["latency"].items() if k != "total_s"})
            times = times.with_first_step(time.perf_counter() - t0)
            self.recovered["latency"] = times.to_json()
            if self.rank == 0:
                log.warning("%s", times.table())
        if self.rank == 0:
            _emit(tc.log, {"step": trainer.step, "loss": loss, "world_size": self.world, "dp": state.cfg.dp,
                           "tp": state.cfg.tp, "pp": state.cfg.pp, "samples": samples.tolist(),
                           "split": list(trainer.split), "idle": self.world - state.cfg.world_size,
                           "time_s": time.perf_counter() - t0, "restart": self.restart, "wall": time.time(),
                           **_ring_copy(trainer),
                           **({"after_recovery": self.recovered} if self.recovered is not None else {})})
        self.recovered = None
        return trainer.step, trainer.step >= tc.steps

    def snapshot(self, step: int) -> None:
        """Every ``--snapshot-every`` steps: this rank's state to the host store, in the foreground
        (an in-process run's wait is interruptible: a death found meanwhile recovers now)."""
        tc, store, ring, state = self.tc, self.store, self.ring, self.state
        if self.fault is not None or not self.groups.placed or store is None or not tc.snapshot_every or \
                step % tc.snapshot_every:
            return
        assert state is not None
        self.snapping[:] = [step]
        where = self.where

        def describe_snap(e: BaseException, step: int = step) -> str:
            return f"{where}could not write the snapshot of step {step} to the host store {store.root}: {_describe(e)}"

        self.snapper.wait()  # one abandoned by a recovery is finished first
        snap = self.trainer.shard()
        if ring is not None:
            ring.hold(step, snap)  # written in the foreground: done when the wait below returns
        sid = ring.held_as.save_id if ring is not None and ring.held_as is not None else \
            self.save_id or default_save_id(state.cfg, self.ptc)
        self.snapper.start(describe_snap, store.snapshot, self.ptc, state.cfg, self.groups.rank, snap,
                           step=step, replicate=bool(store.url), save_id=sid)
        self.fault = self.snapper.wait(self.membership.check if self.membership is not None else None)
        if self.fault is None:
            self.snapped.add(step)  # (an error is reported on every rank at the next step)
        self.snapping.clear()

    def checkpoint(self, step: int, done: bool) -> None:
        """Every ``--ckpt-every`` steps and at the end: this rank's part of the checkpoint, written in
        the background (training waits only for the copy; one write at a time)."""
        tc, ring, state, where = self.tc, self.ring, self.state, self.where
        if self.fault is not None or not self.groups.placed or not tc.ckpt or \
                not ((tc.ckpt_every and step % tc.ckpt_every == 0) or done):
            return
        assert state is not None
        shard = self.trainer.shard()
        self.fault = self.writer.wait(self.membership.check if self.membership is not None else None)
        if self.fault is not None:
            return

        def describe(e: BaseException, step: int = step) -> str:
            return f"{where}could not write checkpoint step {step} to {tc.ckpt}: {_describe(e)}"

        if ring is not None:
            ring.hold(step, shard)  # confirmed once every rank's write is done (train_step)
        self.writing[:] = [step]
        self.writer.start(describe, _save, self.die, tc.ckpt, self.ptc, state.cfg, self.groups.rank, shard, step=step,
                          keep_last=tc.keep_last, save_id=self.save_id)


def _start_record(tc: TrainConfig, state: RescaleResult, groups: Any, rank: int, world: int, restart: int,
                  t_start: float, step: int) -> None:
    """Rank 0 logs how the job started (bytes every rank read: a collective over the group)."""
    tiers = ("local", "peer", "storage")
    read = torch.tensor([state.load_stats.bytes_read if state.load_stats else 0,
                         state.load_stats.bytes_needed if state.load_stats else 0,
                         *(state.bytes_by_tier.get(t, 0) for t in tiers)], dtype=torch.float64, device=groups.device)
    if dist.is_initialized():
        dist.all_reduce(read)  # bytes every rank read from the checkpoint, for the start record
    skipped = _all_skipped(state.skipped)
    if rank == 0:
        log.warning("%s", state.summary())
        for s in skipped:
            log.warning("passed over checkpoint step %d (%s) on ranks %s: %s", s["step"], s["save_id"], s["ranks"],
                        s["reason"])
        _emit(tc.log, {"event": "start", "step": step, "world_size": world, "layout": str(state.cfg),
                       "previous": str(state.previous) if state.previous else None, "restart": restart,
                       "idle_ranks": list(state.idle_ranks),
                       "resume_step": tc.resume_step, "skipped": skipped,
                       "timings": state.timings, "startup_s": time.perf_counter() - t_start,
                       "process_start": PROCESS_START, "wall": time.time(),
                       "bytes_read": state.load_stats.bytes_read if state.load_stats else 0,
                       "bytes_needed": state.load_stats.bytes_needed if state.load_stats else 0,
                       "bytes_read_all": int(read[0]), "bytes_needed_all": int(read[1]),
                       "plan_bytes_moved": state.plan_stats.bytes_moved if state.plan_stats else 0,
                       "bytes_by_tier": state.bytes_by_tier,
                       "bytes_by_tier_all": {t: int(read[2 + i]) for i, t in enumerate(tiers)}})


def _record(ring: StateRing, trainer: Trainer | Spare) -> None:
    if isinstance(trainer, Spare):  # holds nothing: a fresh joiner of the next in-process rescale
        return
    ring.record(trainer.step, trainer.consistent_state())


def _ring_copy(trainer: Trainer | Spare) -> dict[str, Any]:
    """Bytes of the ring's snapshots so far copied in bubbles and blocking (by this trainer)."""
    task = getattr(trainer, "snapshot_task", None)
    return {} if task is None else {"ring_bubble_bytes": task.bubble_bytes, "ring_blocking_bytes": task.blocking_bytes}


def _ring_side_task(ring: StateRing, trainer: Trainer | Spare, groups: Any) -> None:
    """The per-step copy into the ring as a side task of the trainer's pipeline bubbles."""
    if not isinstance(trainer, Spare):
        ring_in_bubbles(ring, trainer, groups.device)


def _save(die: Callable[[str, int], None] | None, *args: Any, **kwargs: Any) -> None:
    if die is not None:
        die("save", kwargs["step"])  # testing: this rank's part of the step never lands
        die("slow-save", kwargs["step"])  # testing: nor does it here, but the rank trains on
    save(*args, **kwargs)


def _chooser(tc: TrainConfig, ptc: PTC) -> Chooser:
    """How an in-process recovery picks the layout: the layout ``--parallel`` pins for the world
    size, else ``choose_layout`` as at start-up."""
    options = layout_options_for(ptc, dict(global_batch=tc.global_batch, micro_batch=tc.micro_batch,
                                           recompute=tc.recompute), gpus_per_host=tc.gpus_per_host)
    chooser = default_chooser(options)

    def choose(ptc: PTC, world: int, previous: ParallelConfig | None) -> ParallelConfig:
        return _pinned_layout(tc.parallel, world, quiet=True) or chooser(ptc, world, previous)

    return choose


def _sources(store: Any, ckpt: str | None) -> list[str]:
    """Where pieces no survivor holds are read, cheapest first: this host's store, then the checkpoints."""
    return [u for u in (store.root if store is not None else None, ckpt) if u]


def _recovery_record(rec: LiveRecovery, before: ParallelConfig | None, step: int, reason: str) -> dict[str, Any]:
    nm, res = rec.membership, rec.result
    stats = res.plan_stats
    return {"wall": time.time(), "reason": reason, "joiners": list(nm.joiners), "failed_at": nm.failed_at,
            "world_size": nm.world_size, "layout": str(res.cfg),
            "previous": str(before), "live": res.live, "step": step, "newest": rec.newest,
            "steps_lost": max(0, rec.newest - step), "alive": list(nm.alive), "round": nm.round,
            "detect_s": nm.detect_s, "agree_s": nm.agree_s, "regroup_s": nm.regroup_s,
            "recover_s": rec.recover_s, "rescale_s": rec.rescale_s, "timings": dict(rec.slowest),
            "bytes_live": rec.bytes["live"], "bytes_storage": rec.bytes["storage"],
            "bytes_local": rec.bytes["local"], "storage_urls": list(rec.storage_urls),
            "plan_bytes_moved": stats.bytes_moved if stats else 0,
            "plan_bytes_peer": (stats.bytes_same_host + stats.bytes_cross_host) if stats else 0,
            "plan_bytes_storage": stats.bytes_storage if stats else 0, "bytes_full_replica": rec.full_replica,
            # the latency table (issue 31 item 4); its first step is added by that step's record
            "latency": rec.times.to_json() if rec.times is not None else None}


def _host_store(spec: str | None) -> Any:
    if not spec:
        return None
    if spec == "auto":
        store = HostStore.from_env()
        if store is None:
            raise ConfigError("--store auto needs TENPLEX_STORE_ROOT and TENPLEX_STORE_URL (set by the launcher)")
        return store
    return HostStore(spec, "")


def _pinned_layout(text: str | None, world: int, *, quiet: bool = False) -> ParallelConfig | None:
    """The layout pinned for this world size: ``--parallel`` lists one or more layouts separated
    by '/', each ``LAYOUT`` (for the world size it fills) or ``WORLD:LAYOUT`` (for world size
    WORLD, the ranks beyond the layout's size waiting as spares); the first that matches is used,
    other world sizes are left to the chooser."""
    if not text:
        return None
    for item in (t.strip() for t in text.split("/")):
        if not item:
            continue
        size, sep, layout = item.rpartition(":")
        cfg = ParallelConfig.parse(layout)
        if sep and not size.strip().isdigit():
            raise ConfigError(f"--parallel {item!r}: WORLD:LAYOUT needs a world size before ':', e.g. 5:dp=3")
        if (int(size) if sep else cfg.world_size) == world:
            return cfg
    if not quiet:
        log.warning("no pinned layout (%s) has world size %d: rescale chooses one", text, world)
    return None


def _emit(path: str | None, obj: dict[str, Any]) -> None:
    line = json.dumps(obj)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    elif "loss" in obj:
        print(f"step {obj['step']:>5}  loss {obj['loss']:.5f}  layout dp={obj['dp']},tp={obj['tp']},pp={obj['pp']}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 trained; 2 bad options or the job cannot start (one line on stderr, every
    rank); 1 a checkpoint or snapshot could not be written (every rank stops, naming it); 75 an
    in-process recovery failed (``--in-process``: the launcher's restart takes over)."""
    logging.basicConfig(level=os.environ.get("TENPLEX_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tc = parse_args(argv)
    try:
        return run(tc)
    except CheckpointWriteError as e:
        print(f"{PROG}: error: {_one_line(str(e))}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
