"""Every world size gets a layout (issue #20, item 1): spares and uneven batch splits, end to end.

The elastic run: the reference trainer (``tiny``, global batch 8, micro-batch 2) on 8 workers,
then 5, then 7, one step each, each launch resuming the previous one's checkpoint under a new
layout that leaves ranks as spares and splits the 4 micro-batches of a step unevenly over 3
replicas (2, 1, 1). Its losses must equal an uninterrupted single-process run's within 1e-4
relative and every sample must be seen exactly once. The workers are forked from a forkserver
that imported torch and the trainer once (20 interpreters importing torch on 2 CPUs would take
most of a minute). TENPLEX_SPARES_EXTRA=1 adds a longer run (plain optimizer, the default
chooser at 8 workers, TP and PP with an uneven split, three steps a launch) and in-process
recovery with spares (a spare dies, then a placed rank, whose place a spare takes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex
from tenplex import ParallelConfig
from tenplex.planning.choose import default_chooser, layout_options_for
from tenplex.planning.layouts import batch_split
from tenplex.train.trainer import trainer_ptc

from conftest import examples
from spawned import free_port, worker_context
from test_train import read_log

COMMON = ["--model", "tiny", "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3", "--seed", "7"]
REL_TOL = 1e-4


# -- the chooser rescale() uses -----------------------------------------------------------------
def test_default_chooser_gives_every_world_size_of_tiny_a_layout() -> None:
    """rescale()'s default chooser (spares and uneven splits allowed) on 1..16 workers: a layout
    of at most that many ranks whose replicas take whole micro-batches differing by at most one."""
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    choose = default_chooser(layout_options_for(ptc, dict(global_batch=8, micro_batch=2, gpu_mem="16GiB")))
    previous = None
    for world in range(1, 17):
        cfg = choose(ptc, world, previous)
        assert cfg.world_size <= world and cfg.dp <= 4, (world, cfg)
        split = batch_split(8, 2, cfg.dp)
        assert sum(split) == 4 and max(split) - min(split) <= 1
        previous = cfg
    refuse = default_chooser(layout_options_for(ptc, dict(global_batch=8, micro_batch=2, gpu_mem="16GiB",
                                                          allow_idle=False, uneven_batch=False)))
    with pytest.raises(tenplex.LayoutError):
        refuse(ptc, 5, None)


STEP = 3
SAVED = ParallelConfig(dp=2, tp=1, pp=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A checkpoint of step 3 of tiny under dp=2."""
    url = str(tmp_path_factory.mktemp("ck"))
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    for r in range(2):
        shard = {n: torch.zeros(ptc.local_shape(n, SAVED), dtype=ptc.tensors[n].dtype)
                 for n in ptc.rank_tensors(SAVED, r)}
        tenplex.save(url, ptc, SAVED, r, {**shard, "optimizer.step": STEP, "data": {}}, step=STEP)
    return url


@settings(max_examples=examples(20))
@given(st.integers(1, 12), st.integers(0, 11))
def test_rescale_spares_load_nothing_and_resume_the_step(saved: str, world: int, rank: int) -> None:
    """A rank beyond the chosen layout is a spare: no state, the step the placed ranks resume."""
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    rank %= world
    res = tenplex.rescale(saved, ptc, rank=rank, world_size=world,
                          layout_options=dict(global_batch=8, micro_batch=2, gpu_mem="16GiB"))
    assert res.step == STEP and not res.fresh and res.previous == SAVED
    assert res.idle_ranks == tuple(range(res.cfg.world_size, world))
    assert res.idle == (rank in res.idle_ranks)
    assert (res.shard is None) == res.idle
    pinned = tenplex.rescale(saved, ptc, rank=rank, world_size=world, parallel=ParallelConfig(dp=1))
    assert pinned.idle == (rank >= 1) and pinned.idle_ranks == tuple(range(1, world))
    if not pinned.idle:
        assert pinned.shard is not None and pinned.shard["optimizer.step"] == STEP


# -- the elastic run ----------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, argv: Sequence[str], out: str, env: dict[str, str]) -> None:
    """One trainer rank in this (forked) process; its output goes to ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                       "GLOO_SOCKET_IFNAME": "lo", "TENPLEX_DEVICE": "cpu", **env})
    if world == 1:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k)
    from tenplex.train.run import main  # lazy: preloaded by the forkserver

    code = main(list(argv))
    os._exit(code)  # no interpreter teardown: the next launch waits for this one


def _launch(ctx: multiprocessing.context.BaseContext, tmp: Path, n: int, argv: list[str], tag: str,
            timeout: float = 120, env: dict[str, str] | None = None, codes: list[int | None] | None = None) -> None:
    """``n`` ranks of one job; fails unless each exits with ``codes`` (default 0)."""
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, argv, str(tmp / f"{tag}-{r}.log"), env or {}))
             for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    got = [p.exitcode for p in procs]
    if got != (codes or [0] * n):
        tails = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(tmp.glob(f"{tag}-*.log")))
        pytest.fail(f"{tag}: exit codes {got}\n{tails}")


def _forkserver() -> multiprocessing.context.BaseContext:
    return worker_context()  # the test session's forkserver: it imported tenplex.train.run and torch.distributed


def _compare(ref: dict[int, dict], got: dict[int, dict], total: int) -> None:
    assert sorted(got) == sorted(ref) == list(range(1, total + 1))
    for step in ref:
        rel = abs(got[step]["loss"] - ref[step]["loss"]) / abs(ref[step]["loss"])
        assert rel <= REL_TOL, f"step {step}: loss {got[step]['loss']} vs {ref[step]['loss']} (rel {rel:.2e})"
        assert got[step]["samples"] == ref[step]["samples"], f"step {step}: other samples"
        assert sum(got[step]["split"]) == 8 and max(got[step]["split"]) - min(got[step]["split"]) <= 2
    seen = [x for s in sorted(got) for x in got[s]["samples"]]
    assert len(seen) == len(set(seen)) == total * 8, "a sample was repeated or left out"


def _elastic(tmp: Path, phases: list[tuple[int, str | None]], per: int, extra: list[str]) -> list[dict]:
    """The reference run and the elastic one (``phases``: (workers, --parallel) per launch,
    ``per`` steps each); checks losses and samples; returns the elastic run's start records."""
    ctx = _forkserver()
    total = per * len(phases)
    ref_log, log, ckpt = tmp / "ref.jsonl", tmp / "log.jsonl", tmp / "ckpt"
    _launch(ctx, tmp, 1, [*COMMON, *extra, "--steps", str(total), "--log", str(ref_log)], "ref")
    for i, (n, pin) in enumerate(phases):
        _launch(ctx, tmp, n, [*COMMON, *extra, "--steps", str(per * (i + 1)), "--ckpt", str(ckpt), "--log", str(log),
                              *(["--parallel", pin] if pin else [])], f"w{n}")
    ref, _ = read_log(ref_log)
    got, starts = read_log(log)
    _compare(ref, got, total)
    assert [s["world_size"] for s in starts] == [n for n, _ in phases]
    for s in starts[1:]:
        assert s["bytes_read"] >= s["bytes_needed"] > 0, s
    return starts


@pytest.mark.timeout(240)
def test_elastic_run_8_5_7_workers_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    """8 workers (dp=2,tp=2,pp=2), then 5 (dp=3: micro-batches 2, 1, 1; 2 spares), then 7 (dp=3,
    tp=2: the same uneven split, 1 spare), one step each, ZeRO-1 (Adam state sharded over 2, then
    3 replicas): every loss within 1e-4 of the single-process run, every sample once."""
    starts = _elastic(tmp_path, [(8, "dp=2,tp=2,pp=2"), (5, "5:dp=3,tp=1,pp=1"), (7, "7:dp=3,tp=2,pp=1")], 1,
                      ["--distributed-optimizer"])
    assert [s["layout"] for s in starts] == ["dp=2,tp=2,pp=2", "dp=3,tp=1,pp=1", "dp=3,tp=2,pp=1"]
    assert [s["idle_ranks"] for s in starts] == [[], [3, 4], [6]]
    got, _ = read_log(tmp_path / "log.jsonl")
    assert [got[s]["split"] for s in (1, 2, 3)] == [[4, 4], [4, 2, 2], [4, 2, 2]]


@pytest.mark.skipif(not os.environ.get("TENPLEX_SPARES_EXTRA"), reason="TENPLEX_SPARES_EXTRA=1: the longer run")
@pytest.mark.timeout(600)
def test_elastic_run_with_the_default_chooser_and_pipelines(tmp_path: Path) -> None:
    """Plain Adam, three steps a launch: 8 workers under the default chooser (spares), 5 with
    dp=3 x pp=1 and 7 with dp=3 x pp=2 (a 2-stage pipeline whose replicas run 2, 1, 1 micro-batches)."""
    starts = _elastic(tmp_path, [(8, None), (5, "5:dp=3,tp=1,pp=1"), (7, "7:dp=3,tp=1,pp=2")], 3, [])
    assert starts[0]["idle_ranks"] and starts[2]["layout"] == "dp=3,tp=1,pp=2"


@pytest.mark.skipif(not os.environ.get("TENPLEX_SPARES_EXTRA"), reason="TENPLEX_SPARES_EXTRA=1: about 40 s")
@pytest.mark.timeout(240)
def test_in_process_recovery_with_spares(tmp_path: Path) -> None:
    """--in-process on 6 workers (the default chooser: dp=1,tp=1,pp=4 and 2 spares): spare 5 dies
    in step 2 (the 4 placed ranks move nothing among themselves, spare 4 waits on), then placed
    rank 1 dies in step 4: the 3 survivors holding state and spare 4, a fresh joiner (new rank 3:
    fresh joiners take the last new ranks), move the state live to pp=4 again, the dead rank's
    stage read from the checkpoint. Losses and samples as the uninterrupted run's."""
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    ctx = _forkserver()
    ref_log, log = tmp_path / "ref.jsonl", tmp_path / "log.jsonl"
    _launch(ctx, tmp_path, 1, [*COMMON, "--steps", "6", "--log", str(ref_log)], "ref")
    _launch(ctx, tmp_path, 6, [*COMMON, "--steps", "6", "--in-process", "--log", str(log), "--ckpt",
                               str(tmp_path / "ckpt"), "--ckpt-every", "1", "--die-at", "5:2:forward,1:4:forward"],
            "w", env={"TENPLEX_MEMBERSHIP_STORE": f"127.0.0.1:{store.port}"}, codes=[0, -9, 0, 0, 0, -9])
    ref, _ = read_log(ref_log)
    got, _ = read_log(log)
    _compare(ref, got, 6)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    recs = [e for e in events if e.get("event") == "recover"]
    assert [(r["world_size"], r["layout"], r["live"]) for r in recs] == [(5, "dp=1,tp=1,pp=4", True),
                                                                      (4, "dp=1,tp=1,pp=4", True)]
    assert recs[0]["bytes_live"] == recs[0]["bytes_storage"] == 0
    assert recs[1]["bytes_live"] > 0 and recs[1]["bytes_storage"] > 0 and recs[1]["steps_lost"] <= 1
    records = [e for e in events if "loss" in e]  # steps redone after a rollback included
    assert {e["world_size"] for e in records} == {6, 5, 4}
    assert all(e["idle"] == e["world_size"] - 4 and e["pp"] == 4 for e in records)
