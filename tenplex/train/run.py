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
on (``tenplex.train.live``, docs/inprocess.md); a failure during that recovery exits with code
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
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist

from ..checkpoint import default_save_id, save
from ..config import ParallelConfig
from ..data.corpus import TokenCorpus, stdlib_corpus
from ..data.partition import DataState
from ..choose import Chooser, default_chooser, layout_options_for
from ..elastic import RescaleResult, agree_on_step, env_world, rescale
from ..errors import CheckpointMismatchError, CheckpointWriteError, ConfigError, PeerFailure, TenplexError
from ..membership import Membership
from ..memory import RECOMPUTE
from ..models import ModelSpec
from ..ptc import PTC
from ..store import HostStore, recovery_tiers
from .memory_probe import measure_step_memory
from .live import DIE_POINTS, JOB_ENV, JOIN_FAILED, MEMBERSHIP_STORE_ENV, RECOVERY_FAILED, DieAt, LiveRecovery, \
    StateRing, join_membership, job_key, layout_fits, membership_store, recover_live, ring_in_bubbles, settle_ring, \
    start_membership, warm_up
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
        fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/") or "/"
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
    ptc, store = start.ptc, start.store
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    groups: Any = None
    trainer: Any = None
    if joiner is None:
        assert state is not None
        groups = init_distributed(state.cfg, timeout_s=tc.pg_timeout)
        trainer = Trainer(tc, ptc, groups, state, start.corpus) if groups.placed else Spare(tc, groups, state)
        _start_record(tc, state, groups, rank, world, restart, t_start, trainer.step)
    first_step = trainer.step if trainer is not None else -2  # --measure-memory: the second step of this process
    # Save ids must differ between launches. Under a process group the default does (a nonce shared
    # through its store); a process alone has only its environment, the same at every launch, so a
    # relaunch that saves a step again (after --resume-step, or passing over a damaged step) would
    # reuse the id: it gets a random one. A joiner saves in the group that admits it.
    save_id = None if dist.is_initialized() or joiner is not None else uuid.uuid4().hex[:8]
    writer = _Writer()
    snapper = _Writer()  # host-store snapshots: in the foreground, but a recovery need not wait for one
    fault: str | None = None  # this rank's first failed save or snapshot: every rank stops at the next step
    where = f"rank {rank}: " if world > 1 else ""
    # testing: by first-group rank (a joiner: by its member id)
    die = DieAt.hook(DieAt.parse(tc.die_at), rank if joiner is None else joiner.id) if restart == 0 else None
    membership: Membership | None = joiner
    ring: StateRing | None = StateRing(tc.live_keep) if joiner is not None else None
    if joiner is None and tc.in_process and dist.is_initialized():
        membership = start_membership(membership_store(), dead_after=tc.dead_after)
        ring = StateRing(tc.live_keep)
        _record(ring, trainer)
        _ring_side_task(ring, trainer, groups)
    if trainer is not None:
        trainer.die = die
    choose = _chooser(tc, ptc)
    if membership is not None and joiner is None:
        assert state is not None
        membership.fits = layout_fits(ptc, state.cfg, choose)
        warm_up(ptc, state.cfg, choose, membership.members)
    recovered: Any = None  # the in-process recovery whose first step is still to come
    # why the next pass regroups before training: "join" (a boundary the members agreed to admit
    # joiners at), "joining" (this process is a joiner), else the failure's message
    regroup: str | None = "joining" if joiner is not None else None

    def pending_fault() -> str | None:  # a background write that failed by now counts in this step
        return fault or writer.poll()

    writing: list[int] = []  # the step the background writer writes

    def written() -> bool:  # this rank's writes of the oldest step the ring holds for them are done
        return ring is None or ring.oldest_held is None or not (writer.running() and writing == [ring.oldest_held])

    snapped: set[int] = set()  # steps whose snapshot of this rank's state is in the host store
    snapping: list[int] = []  # the step whose snapshot the main thread is writing
    # (layout, save id, rank, trainer) of the states the ring holds, set with them: the SIGTERM flush
    # writes them into the attempt the other ranks write. Derived in the handler, the id changed once
    # a recovery had dropped the process group (its launch nonce): a rank that noticed a peer's exit
    # before its own SIGTERM wrote the step every rank held into another attempt, which the store's
    # GC then ranked against the others' (issue 29 item 6); a handler running inside a recovery must
    # not mix the old ring with the new layout, rank or trainer either
    ring_as: list[tuple[ParallelConfig, str, int, Any]] = []

    def ring_layout() -> None:
        assert state is not None
        ring_as[:] = [(state.cfg, save_id or default_save_id(state.cfg, ptc), rank, trainer)] if store else []

    if state is not None:
        ring_layout()

    def terminated(signum: int, frame: Any) -> None:
        """SIGTERM (torchrun's agent restarting the workers, e.g. for a joining node): put the
        consistent states held in memory that the host store lacks there, then exit at once."""
        if snapping and snapper.wait() is None:  # the periodic snapshot under way: os._exit would cut it off
            snapped.update(snapping)  # (its temporary file left behind, this rank's part of that step missing)
        held_states = ring.states() if ring is not None and ring_as and store is not None else {}
        if held_states and isinstance(trainer, Trainer) and trainer is ring_as[0][3] and not trainer.updating \
                and trainer.step not in held_states:
            held_states[trainer.step] = trainer.consistent_state()  # completed, not yet copied into the ring
        # the two newest (ranks are at most one step apart, so every rank writes the step they all
        # hold), oldest first: the host store keeps the attempts that arrived last
        for step, held in sorted(held_states.items())[-2:]:
            assert store is not None
            if step in snapped or step in snapping:  # (a failed one: written again, its attempt would be refused)
                continue
            cfg, sid, as_rank, _ = ring_as[0]
            try:
                store.snapshot(ptc, cfg, as_rank, held, step=step, replicate=bool(store.url), save_id=sid)
                log.warning("rank %d: SIGTERM: step %d's state is in the host store %s", as_rank, step, store.root)
            except Exception:  # noqa: BLE001 - exiting anyway; the restart loads what is there
                log.exception("rank %d: SIGTERM: could not snapshot step %d", as_rank, step)
        logging.shutdown()
        os._exit(128 + signum)

    if membership is not None and store is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, terminated)  # (handlers can only be set from the main thread)

    def guard() -> Any:
        return membership.guard() if membership is not None else contextlib.nullcontext()

    while True:
        if regroup is not None:
            # Out of the except block: the exception's frames (the step's autograd graph, its p2p work)
            # are gone. Dropping the trainer too frees the last references to the broken groups, so
            # gloo closes their connections and peers still blocked on this rank fail at once (kept,
            # they held a peer blocked until a process exited; no gc.collect() needed, measured).
            assert membership is not None and ring is not None
            if regroup == "join":
                log.info("rank %d: admitting joiners %s after step %d", rank, list(membership.pending()),
                         trainer.step)
            elif regroup != "joining":
                log.warning("rank %d: %s: recovering in-process", rank, regroup)
            at = trainer.step + 1 if trainer is not None else 0
            trainer = groups = None
            # gloo closes a group's connections only when its last reference goes: a young
            # reference cycle through the step's objects must not keep one (1 ms)
            gc.collect(1)
            try:
                rec = recover_live(membership, ring, ptc, state.cfg if state is not None else None, choose,
                                   sources=_sources(store, tc.ckpt), url=tc.ckpt, tiers=start.tiers,
                                   gpus_per_host=tc.gpus_per_host,
                                   before_migrate=(lambda: die("migrate", at)) if die else None,
                                   join=regroup == "join", join_timeout=tc.join_timeout)
                groups = init_distributed(rec.result.cfg, timeout_s=tc.pg_timeout)
                trainer = Trainer(tc, ptc, groups, rec.result, start.corpus) if groups.placed else \
                    Spare(tc, groups, rec.result)
            except Exception as e2:  # noqa: BLE001 - any failure here: the launcher's restart takes over
                code = JOIN_FAILED if membership.joining else RECOVERY_FAILED
                who = f"joiner {membership.id}" if membership.joining or rank < 0 else f"rank {rank}"
                log.error("%s: in-process %s failed", who, "admission" if membership.joining else "recovery",
                          exc_info=e2)
                print(f"{PROG}: error: {who}: in-process {'admission' if membership.joining else 'recovery'} "
                      f"failed ({_one_line(_describe(e2))}); exiting with code {code}"
                      f"{'' if membership.joining else ' so that the launcher restarts the job'}",
                      file=sys.stderr, flush=True)
                logging.shutdown()
                os._exit(code)  # no clean-up that could wait on a dead peer
            before = state.cfg if state is not None else rec.result.previous
            state = rec.result
            membership.fits = layout_fits(ptc, state.cfg, choose)
            trainer.die = die
            rank, world = groups.rank, dist.get_world_size()
            where = f"rank {rank}: "
            ring.clear()
            ring_layout()
            _record(ring, trainer)
            _ring_side_task(ring, trainer, groups)
            recovered = _recovery_record(rec, before, trainer.step, "failure" if regroup not in ("join", "joining")
                                         else "join")
            if rank == 0:
                log.warning("%s", state.summary())
                _emit(tc.log, {"event": "recover", **recovered})
            regroup = None
        assert state is not None
        try:
            while trainer.step < tc.steps:
                t0 = time.perf_counter()
                if membership is not None:
                    membership.check()  # a death the heartbeats found between collectives
                with guard():
                    if tc.measure_memory and trainer.step == first_step + 1 and groups.placed:
                        loss, samples = measure_step_memory(trainer, tc.measure_memory, fault=pending_fault,
                                                            written=written)
                    else:
                        loss, samples = trainer.train_step(fault=pending_fault, written=written)
                if ring is not None and trainer.all_written:
                    ring.confirm()  # every rank's write of that step is done: a dead rank's pieces are there
                if ring is not None and getattr(trainer, "snapshot_task", None) is None:  # else: the next step's bubbles
                    _record(ring, trainer)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {trainer.step}")
                if rank == 0:
                    _emit(tc.log, {"step": trainer.step, "loss": loss, "world_size": world, "dp": state.cfg.dp,
                                   "tp": state.cfg.tp, "pp": state.cfg.pp, "samples": samples.tolist(),
                                   "split": list(trainer.split), "idle": world - state.cfg.world_size,
                                   "time_s": time.perf_counter() - t0, "restart": restart, "wall": time.time(),
                                   **_ring_copy(trainer),
                                   **({"after_recovery": recovered} if recovered is not None else {})})
                recovered = None
                done = trainer.step >= tc.steps
                step = trainer.step
                if fault is None and groups.placed and store is not None and tc.snapshot_every and \
                        step % tc.snapshot_every == 0:
                    snapping[:] = [step]

                    def describe_snap(e: BaseException, step: int = step) -> str:
                        return f"{where}could not write the snapshot of step {step} to the host store " \
                               f"{store.root}: {_describe(e)}"

                    snapper.wait()  # one abandoned by a recovery (below) is finished first
                    snap = trainer.shard()
                    if ring is not None:
                        ring.hold(step, snap)  # written in the foreground: done when the wait below returns
                    snapper.start(describe_snap, store.snapshot, ptc, state.cfg, groups.rank, snap,
                                  step=step, replicate=bool(store.url), save_id=ring_as[0][1])
                    # in-process runs wait interruptibly: a death found meanwhile recovers now, not after it
                    fault = snapper.wait(membership.check if membership is not None else None)
                    if fault is None:
                        snapped.add(step)  # (an error is reported on every rank at the next step)
                    snapping.clear()
                if fault is None and groups.placed and tc.ckpt and ((tc.ckpt_every and step % tc.ckpt_every == 0)
                                                                    or done):
                    # persistent checkpoints run in the background: training waits only for the copy
                    shard = trainer.shard()
                    fault = writer.wait(membership.check if membership is not None else None)  # one at a time
                    if fault is None:
                        def describe(e: BaseException, step: int = step) -> str:
                            return f"{where}could not write checkpoint step {step} to {tc.ckpt}: {_describe(e)}"

                        if ring is not None:
                            ring.hold(step, shard)  # confirmed once every rank's write is done (train_step)
                        writing[:] = [step]
                        writer.start(describe, _save, die, tc.ckpt, ptc, state.cfg, groups.rank, shard, step=step,
                                     keep_last=tc.keep_last, save_id=save_id)
                if tc.fail_at_step is not None and trainer.step == tc.fail_at_step and restart == 0:
                    writer.wait()  # deterministic for tests: the pending checkpoint lands first
                    log.error("rank %d: simulated failure after step %d", rank, trainer.step)
                    os._exit(17)
                # scale up: every member reads the agreed boundary here (one store read), so all admit
                # the waiting joiners after the same step; none is proposed with no step left to run
                if membership is not None and not done and membership.join_due(step, propose=step + 1 < tc.steps):
                    regroup = "join"
                    break
            if regroup is not None:
                continue
            fault = fault or writer.wait()
            with guard():
                failed = _failed_ranks(fault, groups.device)  # the last saves, agreed by every rank before it exits
        except PeerFailure as e:
            regroup = str(e)
            if ring is not None and trainer is not None:
                settle_ring(ring, trainer)
        else:
            break
    if membership is not None:
        membership.close()
    if failed:
        raise CheckpointWriteError(f"{failure_message(fault, failed, rank)}; training stopped after step "
                                   f"{trainer.step}{' on every rank' if dist.is_initialized() else ''}")
    return 0


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
            "plan_bytes_storage": stats.bytes_storage if stats else 0}


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
