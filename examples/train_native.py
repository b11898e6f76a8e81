"""A torch-native training job that uses tenplex: the example of docs/your_model.md.

The model is plain torch (``native_llama.py``: a Llama parallelized with torch's own TP and
FSDP2 APIs). tenplex adds three calls: ``choose_mesh`` at start-up (the mesh for however many
workers torchrun started), ``rescale`` (fill the freshly built model and optimizer in place from
the newest checkpoint, whatever mesh wrote it; a fresh start without one), ``save_state_dict``
every K steps; batches come from tenplex's dataset index reader, so a rescale continues the same
sample order.

    torchrun --nproc-per-node=4 examples/train_native.py --ckpt /tmp/ckpt --steps 12 --log /tmp/log.jsonl

Kill some workers (or a node) and let torchrun's elastic agent restart the rest: they pick a new
mesh and continue from the last checkpoint.

``--in-process`` (with ``TENPLEX_MEMBERSHIP_STORE=host:port``, a c10d store that outlives the
workers): the survivors of a failure are not restarted. Every step runs under
``Membership.guard()``; after each step this rank's local shards are copied into a ``StateRing``
(the step of the last checkpoint kept pinned). On a peer failure the survivors agree on a new group
(``Membership.recover``: the default group re-formed on a fresh store prefix), build the mesh and
the model for their number, and ``rescale(url, state_dict, live=LiveState(...))`` moves the state
live from the newest step every survivor holds; only pieces whose every holder died come from the
checkpoint (then at its step, which the ring keeps). A failure during that recovery exits with
code 75 (the launcher's restart path takes over).

``--in-process --join`` (scale up without a restart): a process started beside the running job
(the same ``TENPLEX_MEMBERSHIP_STORE``, and ``TENPLEX_JOB_ID`` or the job's ``MASTER_ADDR`` /
``MASTER_PORT``, no ``RANK`` / ``WORLD_SIZE``) registers as a joiner. The workers notice it at a step
boundary (``Membership.join_due``), agree on a round with it and rebuild mesh and model for the
larger group; the joiner builds its own and receives its shards, the step and the data position
live from them (``LiveState(cfg=None)``), nothing from the checkpoint. A node joining under
torchrun is another matter: its agent and the running ones restart every worker (SIGTERM, a new
rendezvous). ``--in-process`` workers first write the newest states their ring holds into the
checkpoint (each its own part, ``tenplex.checkpoint.save``: no message), so the restarted job
resumes from the newest step every worker completed, not from the last periodic checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
import native_llama as nl  # noqa: E402 - the user's model, next to this script

import tenplex  # noqa: E402
from tenplex.checkpoint import default_save_id  # noqa: E402
from tenplex.data import DataState, global_batch_ids, stdlib_corpus  # noqa: E402
from tenplex.data.batches import IndexBatches  # noqa: E402
from tenplex.elastic import live_order  # noqa: E402
from tenplex.elastic.inprocess import (  # noqa: E402
    JOIN_FAILED, RECOVERY_FAILED, DieAt, RecoveryConfig, recover_in_process, warm_up,
)
from tenplex.elastic.membership_runtime import join_membership, membership_store, start_membership  # noqa: E402
from tenplex.elastic.ring import HeldAs, StateRing, exit_on_sigterm, flush_ring  # noqa: E402
from tenplex.errors import PeerFailure  # noqa: E402
from tenplex.native.dtensor import release_mesh  # noqa: E402
from tenplex.native.state_dict import describe_state_dict, local_shard  # noqa: E402
from tenplex.planning.assignment import load_solvers  # noqa: E402
from tenplex.planning.choose import choose_mesh, predict_layout  # noqa: E402

log = logging.getLogger("train_native")


def mesh_rule(world: int, *, hsdp: bool = False) -> dict[str, int]:
    """This job's own rule: FSDP2 x TP2 (``hsdp``: 2 replicas of FSDP2, HSDP) when there are at least 4
    workers and an even number, else FSDP2 alone."""
    if world >= 4 and world % 2 == 0:
        return {"dp_replicate": 2, "dp_shard": world // 2} if hsdp else {"dp_shard": world // 2, "tp": 2}
    return {"dp_shard": world}


def emit(path: str, record: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint URL (a directory or any fsspec URL)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--log", default="", help="JSON lines: one per step (rank 0) and one per start and recovery")
    p.add_argument("--in-process", action="store_true",
                   help="survivors of a failure recover in-process (TENPLEX_MEMBERSHIP_STORE=host:port)")
    p.add_argument("--dead-after", type=float, default=0.8, help="--in-process: heartbeat silence that means death")
    p.add_argument("--join", action="store_true",
                   help="--in-process: join a running job (scale up): wait for it, be admitted at a step boundary "
                        "and receive the state live")
    p.add_argument("--join-timeout", type=float, default=120.0,
                   help=f"--join: seconds to wait for the job and for admission (then exit code {JOIN_FAILED})")
    p.add_argument("--hsdp", action="store_true", help="HSDP (2 replicas) instead of TP on 4 or more workers")
    p.add_argument("--die-at", default="", help="testing: RANK:STEP:POINT, POINT forward, optimizer or save")
    args = p.parse_args()
    if args.join and not args.in_process:
        p.error("--join needs --in-process (the joiner is admitted by the running workers' membership)")
    who = "joiner" if args.join else f"rank {os.environ.get('RANK', '0')}"
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {who} %(message)s")

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.join:  # the default group comes with the admission
        rank, world = -1, 0
    else:
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
    first_rank = rank  # --die-at names ranks of the first group (a joiner: none)

    def joined() -> Any:
        """Register with the running job (found through the membership store) as a joiner."""
        print(f"train_native: joiner: waiting for job {os.environ.get('TENPLEX_JOB_ID') or 'at MASTER_ADDR:MASTER_PORT'} "
              f"in the store {os.environ.get('TENPLEX_MEMBERSHIP_STORE')}", flush=True)
        try:
            m = join_membership(membership_store(), backend, timeout_s=args.join_timeout, dead_after=args.dead_after)
        except Exception as e:  # noqa: BLE001 - no job to join: say so and exit
            print(f"train_native: joiner: {e}", file=sys.stderr, flush=True)
            sys.exit(JOIN_FAILED)
        print(f"train_native: joiner {m.id}: registered with {m.prefix}; waiting to be admitted at the job's next "
              "step boundary", flush=True)
        return m

    if os.environ.get("TENPLEX_PID_DIR"):  # lets a simulated node failure kill this worker too
        Path(os.environ["TENPLEX_PID_DIR"], f"local-{os.environ.get('LOCAL_RANK', '0')}.pid").write_text(
            str(os.getpid()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    cfg = dataclasses.replace(nl.PRESETS["tiny"], vocab_size=259, seq_len=args.seq_len)
    corpus = stdlib_corpus(args.seq_len)
    batches = IndexBatches(corpus)
    die = DieAt.hook(DieAt.parse(args.die_at), first_rank) if not args.join else None
    step, data = 0, DataState(corpus.num_samples, args.global_batch, seed=1)

    # 1. the mesh for this world size, then the model built and parallelized for it
    def rule(w: int) -> dict[str, int]:
        return mesh_rule(w, hsdp=args.hsdp)

    def fits(n: int) -> bool:
        """Whether a group of n can run this job: the rule gives a mesh whose data-parallel degree divides
        the global batch (``Membership(fits=)``: joiners that would make the group unusable wait)."""
        dims = choose_mesh(n, choose=rule)
        return args.global_batch % (dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)) == 0

    def build(world: int, dims: dict[str, int] | None = None) -> tuple[dict[str, int], Any, Any, Any]:
        dims = dims or choose_mesh(world, choose=rule)
        mesh = nl.build_mesh(dims, device)
        model = nl.parallelize(nl.reference_model(cfg, seed=0).to(device), mesh)
        optimizer = nl.make_optimizer(model)
        if die is not None:  # testing: a kill after the backward pass, before this rank's optimizer step
            optimizer.register_step_pre_hook(lambda *_: die("optimizer", step))
        return dims, mesh, model, optimizer

    # the objects of the imports never die: out of the collector's way, so that the gc.collect() of a
    # recovery (FSDP2's modules are reference cycles) only walks what was made since; in-process, the
    # survivors' locality order's scipy modules among them (imported now, not by the first recovery)
    if args.in_process:
        load_solvers()
    if args.join:
        # a joiner's first mesh, model and state dict pay one-time costs (lazy imports, first FSDP2/TP
        # set-up: 0.6 s measured) that the workers would wait for in the join: paid now, alone, on a
        # private 1-process group, before registering
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _, warm_mesh, model, optimizer = build(1, {d: 1 for d in rule(4)})
        get_state_dict(model, optimizer)
        release_mesh(warm_mesh)
        model = optimizer = warm_mesh = None
        dist.destroy_process_group()
        membership = joined()
    gc.freeze()
    t0 = time.perf_counter()
    dims, mesh, model, optimizer = build(world) if not args.join else ({}, None, None, None)

    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": step, "data": data.to_json()}

    def restore(sd: dict[str, Any]) -> tuple[int, DataState]:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return sd["step"], DataState.from_json(sd["data"])

    # 2. resume: fill the new model and optimizer in place from the newest checkpoint (get_state_dict
    # creates the optimizer state the load fills: on a fresh start it is not called before the first
    # step, whose AdamW step count it would advance)
    resumed = not args.join and any(s.complete for s in tenplex.list_steps(args.ckpt))
    start: dict[str, Any] = {"start": True, "world_size": world, "mesh": dims, "step": 0, "fresh": not resumed}
    if resumed:
        sd = state()
        res = tenplex.rescale(args.ckpt, sd)
        step, data = restore(sd)
        del sd
        assert res.load_stats is not None
        start.update(step=step, bytes_read=res.load_stats.bytes_read, bytes_needed=res.load_stats.bytes_needed,
                     load_s=res.timings["load"])
    start["startup_s"] = time.perf_counter() - t0
    if rank == 0:
        emit(args.log, start)

    # in-process: watch the peers, keep the last consistent states of this rank
    if not args.join:
        membership = start_membership(membership_store(), dead_after=args.dead_after) if args.in_process else None
    if membership is not None:  # a joiner's too: once admitted, it admits later joiners like the others
        membership.fits = fits
    ring = StateRing(3) if args.in_process else None
    # what the ring's states are (their description, this rank and the save id of the mesh they were
    # taken on: ring.held_as) is set with them. Derived when SIGTERM came, a recovery under way (the
    # group dropped, the rank renumbered) gave another save id and rank: the step every rank held
    # landed in two attempts, neither complete (issue 29 item 6)
    seen: dict[tuple[tuple[str, int], ...], Any] = {}  # the state dict's layout on every mesh this process ran

    def guard() -> Any:
        return membership.guard() if membership is not None else contextlib.nullcontext()

    warmed = False

    def remember() -> None:
        """The state after ``step`` into the ring, and (at a mesh's first step) the layout it has, with
        the survivors' order for a failure: where most of each new rank's state already is."""
        nonlocal warmed
        sd = state()
        if ring.held_as is None:  # collective: while every rank of this mesh is alive
            live_ptc, live_layout = describe_state_dict(sd)
            ring.held_as = HeldAs(live_layout, rank, default_save_id(live_layout, live_ptc), ptc=live_ptc)
            seen[tuple(dims.items())] = live_layout
            membership.order = live_order(live_ptc, live_layout, rule, membership.members, known=seen)
            if not warmed:  # the scipy import and the assignment once, before any failure needs them
                warm_up(live_ptc, live_layout, rule, membership.members)
                warmed = True
        ring.record(step, local_shard(sd))

    saved: set[int] = set()  # steps this launch checkpointed (complete on every rank)

    def write(held_as: HeldAs, step: int, shard: dict[str, Any]) -> None:
        """One of the ring's states into the checkpoint, as this rank's part (its values on rank 0)."""
        part = shard if held_as.rank == 0 else {k: v for k, v in shard.items() if isinstance(v, torch.Tensor)}
        tenplex.save(args.ckpt, held_as.ptc, held_as.layout, held_as.rank, part, step=step, save_id=held_as.save_id)

    # SIGTERM (torchrun's agents restarting the workers, e.g. for a joining node): the two newest states
    # of the ring the checkpoint lacks go there first (each rank its own part: no message), then exit
    if ring is not None:
        exit_on_sigterm(lambda: flush_ring(ring, write, where=f"the checkpoint {args.ckpt}", skip=saved))

    if ring is not None and resumed:  # fresh: the ring starts after the first step (see above)
        with guard():
            remember()
        ring.pin(step)
    if resumed:
        saved.add(step)

    filled: dict[str, Any] = {}  # the state dict the last recovery filled

    def rebuilt(nm: Any) -> dict[str, Any]:
        """The mesh, model and optimizer for the new group; the fresh model's state dict, whose values
        the recovery replaces by the survivors' state."""
        nonlocal rank, world, dims, mesh, model, optimizer, filled
        rank, world = nm.new_rank, nm.world_size
        dims, mesh, model, optimizer = build(world)
        filled = state()
        return filled

    def recover(reason: str) -> dict[str, Any]:
        """Agree on the members (the survivors; at a join, the workers and the joiners), rebuild mesh and
        model for them, move the state live; exit 75 on failure (a joiner: 76)."""
        nonlocal mesh, model, optimizer, step, data, filled
        joining = membership.joining
        try:
            t0, wall0 = time.perf_counter(), time.time()
            old = ring.held_as
            newest = max(ring.states()) if ring.states() else None
            # the last references to the broken mesh groups (FSDP2's modules hold them in reference cycles):
            # freed, their connections close, and a survivor blocked in one of them with this rank fails
            if mesh is not None:
                release_mesh(mesh)
            model = optimizer = mesh = None
            gc.collect()
            t_released = time.perf_counter()
            rec = recover_in_process(membership, ring, rebuilt, RecoveryConfig(url=args.ckpt,
                                                                               join_timeout=args.join_timeout),
                                     join=reason == "join")
            summed_s = time.time() - rec.rescaled_at  # the group-wide sums after rescale: counted in ring_s
            nm, res = rec.membership, rec.result
            t_restore = time.perf_counter()
            step, data = restore(filled)
            filled = {}
            # the state is in place when rescale returned and the optimizer got it
            t3 = time.perf_counter()
            wall3 = rec.rescaled_at + (t3 - t_restore)
            try:  # not timed: whether the order was computed for the layout the rebuilt model has
                predicted = old is not None and predict_layout(old.layout, tuple(dims.items()), seen) == res.cfg
            except tenplex.LayoutError:
                predicted = False
            ring.clear()
            remember()  # a failure here: exit 75 (the except below)
            ring.pin(step)  # a checkpoint step when pieces came from storage; else the state the survivors held
            t4 = time.perf_counter()
            ps = res.plan_stats
            # not timed: the same move in the survivors' old rank order (what the locality order saved)
            by_rank = tenplex.plan(old.ptc, old.layout, res.cfg, alive=sorted(nm.alive)).stats if old else ps
            return {"event": "recover", "reason": reason.splitlines()[0][:200], "world_size": world, "mesh": dims,
                    "alive": list(nm.alive), "joiners": list(nm.joiners), "live": res.live, "step": step,
                    "newest": newest,
                    "bytes_live": rec.bytes["live"], "bytes_storage": rec.bytes["storage"],
                    "bytes_local": rec.bytes["local"],
                    "plan_bytes_peer": ps.bytes_same_host + ps.bytes_cross_host if ps else None,
                    "plan_bytes_storage": ps.bytes_storage if ps else None,
                    "plan_bytes_moved": ps.bytes_moved if ps else None,
                    "rank_order_plan_bytes_peer": by_rank.bytes_same_host + by_rank.bytes_cross_host if by_rank
                    else None,
                    "layout_predicted": predicted,
                    "detect_s": nm.detect_s, "agree_s": nm.agree_s, "regroup_s": nm.regroup_s,
                    # unwind: from learning of the failure to this recovery's start (the blocked collective
                    # failing, leaving the step); ring: the bytes summed over the group, the new mesh's layout
                    # described and its first state kept
                    "unwind_s": max(0.0, wall0 - nm.failed_at), "release_s": t_released - t0,
                    "recover_s": t_released - t0 + rec.recover_s, "rebuild_s": rec.rebuild_s,
                    "rescale_s": rec.rescale_s + (t3 - t_restore), "ring_s": t4 - t3 + summed_s,
                    "failure_to_state_s": wall3 - nm.failed_at + nm.detect_s,
                    "timings": res.timings}
        except Exception:  # noqa: BLE001 - any failure here: the launcher's restart takes over
            code = JOIN_FAILED if joining else RECOVERY_FAILED
            log.exception("%s: in-process %s failed; exiting with %d", f"joiner {membership.id}" if joining else
                          f"rank {rank}", "admission" if joining else "recovery", code)
            logging.shutdown()
            os._exit(code)  # no clean-up that could wait on a dead peer

    # 3. train; save every K steps
    # why the next pass regroups first: a peer's failure (its message), "join" (the boundary the workers
    # agreed to admit joiners at) or "joining" (this process is a joiner)
    failure: str | None = "joining" if args.join else None
    recovered: dict[str, Any] | None = None
    while True:
        if failure is not None:  # out of the except block: its frames (the step's graph) are gone
            recovered = recover(failure)
            failure = None
            if rank == 0:
                log.warning("recovered in-process: %s", recovered)
                emit(args.log, recovered)
        if step >= args.steps:
            break
        try:
            t0 = time.perf_counter()
            if membership is not None:
                membership.check()  # a death the heartbeats found between collectives
            dp_rank, dp = nl.dp_rank_and_size(mesh)
            with guard():
                raw = batches.batch(data, dp, dp_rank).to(device)
                if die is not None:
                    die("forward", step)
                loss = nl.train_step(model, optimizer, raw[:, :-1], raw[:, 1:])
            if rank == 0:
                emit(args.log, {"step": step, "loss": loss, "world_size": world, "mesh": dims,
                                "samples": global_batch_ids(data).tolist(), "time_s": time.perf_counter() - t0,
                                **({"after_recovery": recovered} if recovered is not None else {})})
            recovered = None
            step, data = step + 1, data.advance()
            if ring is not None:
                with guard():
                    remember()
            if step % args.ckpt_every == 0 or step == args.steps:
                with guard():
                    if die is not None:
                        die("save", step)
                    tenplex.save_state_dict(state(), args.ckpt, step=step)
                saved.add(step)
                if ring is not None:
                    ring.pin(step)  # complete on every rank: pieces only a dead rank holds can come from it
            # scale up: every worker reads the agreed boundary here (one store read), so all admit the
            # waiting joiners after the same step; none is proposed with no step left to run
            if membership is not None and step < args.steps and \
                    membership.join_due(step, propose=step + 1 < args.steps):
                failure = "join"
        except PeerFailure as e:
            failure = str(e)
    if membership is not None:
        membership.close()
    # the mesh's gloo groups go now, while the interpreter runs: kept alive past the end of main by the
    # modules (FSDP2's reference cycles), a group's worker thread could still be dropping its last
    # collective's tensors when the interpreter finalizes, which aborts the process after all its work
    # ("terminate called without an active exception": caught in a core dump, 2 of 15 runs on loaded CPUs)
    release_mesh(mesh)
    model = optimizer = mesh = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
