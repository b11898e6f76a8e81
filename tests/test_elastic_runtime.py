"""``tenplex.ElasticRuntime`` (issue #31 items 1 and 4): the user's own loop, elastic in process.

1. Pure: the latency table (``RecoveryTimes``) validates its figures, sums its components per path,
   and a torchft-style heal's bytes are one whole replica of the state.
2. Spawned: ``examples/elastic_loop.py`` (a user's minimal loop: ``build(mesh)``, a mesh rule, one
   ``with step:`` per step; not the reference trainer) on 4 gloo workers; worker 3 is SIGKILLed in
   the forward pass of step 3, inside its second layer (the survivors fail mid-forward: their old
   model's FSDP2 groups must still close); the 3 survivors recover in process through the runtime and every
   step's loss and samples match an uninterrupted single-process run; the recovery's record has its
   latency table with every component > 0 and bytes moved below the full-replica copy's.
3. Spawned, spares: 6 workers under a rule whose mesh holds 4; workers 4, 5 wait as spares (no model,
   no step); trainer 1 is SIGKILLed mid-step and the recovery promotes spare 4 (spare 5 stays one):
   the mesh keeps 4 workers, every step's loss within 1e-5 of the uninterrupted run's, every sample once.
4. Spawned, a restart with spares: a job of 5 (2 spares) killed, restarted on 4 under the same rule;
   the trainers load the checkpoint under the new mesh, the spares load nothing; every step once.
5. Spawned, a spare's death: nothing moves, the trainers keep their places and their step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tenplex.elastic import RecoveryTimes
from tenplex.elastic.latency import full_replica_bytes
from tenplex.errors import ConfigError
from tenplex.layout.ptc import PTC, Replicated, Split, TensorSpec

from spawned import free_port, log_tails, script_workers, wait_procs
from test_native_inprocess import BATCH, check_native_run, native_reference

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "elastic_loop.py")
STEPS = 6


def test_recovery_times_sum_their_path_and_refuse_bad_figures() -> None:
    t = RecoveryTimes.in_process(detect_s=0.5, unwind_s=0.25, agree_s=0.125, regroup_s=0.0625, rebuild_s=1.0,
                                 timings={"choose": 0.25, "plan": 0.25, "agree": 0.125, "migrate": 0.5, "fill": 0.5},
                                 bytes_moved={"live": 10, "storage": 5}, full_replica=100)
    assert t.first_step_s is None and t.total_s == 0.75 + 0.25 + 0.0625 + 1.0 + 0.5 + 1.0
    done = t.with_first_step(2.0).with_extra(regroup_s=0.0625)
    assert done.parts == {"detection": 0.75, "agreement": 0.25, "regroup": 0.125, "rebuild": 1.0, "choose_plan": 0.5,
                          "transfer": 1.0, "first_step": 2.0}
    assert done.to_json()["total_s"] == done.total_s == 5.625
    table = done.table()
    assert "first_step" in table and "full-replica copy would move 100" in table
    restart = RecoveryTimes("restart", teardown_s=1.0, restart_s=2.0, load_s=0.5)
    assert list(restart.parts) == ["teardown", "restart", "load", "first_step"] and restart.total_s == 3.5
    with pytest.raises(ConfigError, match="detection_s must be a finite number of seconds >= 0, got -1"):
        RecoveryTimes("in-process", detection_s=-1)
    with pytest.raises(ConfigError, match="path must be"):
        RecoveryTimes("elsewhere")
    with pytest.raises(ConfigError, match="bytes_live must be an integer >= 0"):
        RecoveryTimes("in-process", bytes_live=-3)


def test_a_full_replica_copy_is_the_whole_state() -> None:
    """A torchft heal copies the dead rank's replica group's whole state, whatever share it held."""
    ptc = PTC([TensorSpec("w", (8, 4), torch.float32, Split(0)), TensorSpec("b", (4,), torch.bfloat16, Replicated())],
              num_layers=0)
    assert full_replica_bytes(ptc) == 8 * 4 * 4 + 4 * 2 == ptc.nbytes


def test_a_mesh_rule_may_leave_spares_only_when_asked() -> None:
    """``choose_mesh(spares=True)``: a rule's mesh may hold fewer ranks than the job (the rest wait as
    spares), never more; without it every rank must be used (a joiner's ``fits`` asks so)."""
    from tenplex.planning.choose import choose_mesh

    rule = lambda world: {"dp_shard": min(world, 4)}  # noqa: E731
    assert choose_mesh(5, choose=rule, spares=True) == {"dp_shard": 4} == choose_mesh(4, choose=rule)
    with pytest.raises(ConfigError, match=r"hold 4 = 4 ranks, but the job has 5: the chooser must use every rank"):
        choose_mesh(5, choose=rule)
    with pytest.raises(ConfigError, match=r"hold 6 = 6 ranks, but the job has 5: the chooser must use at most 5 ranks"):
        choose_mesh(5, choose=lambda world: {"dp_shard": 6}, spares=True)


def _loop_workers(tmp: Path, n: int, args: list[str], store_port: int | None,
                  name: str = "worker") -> list[subprocess.Popen]:
    """``n`` workers of ``examples/elastic_loop.py`` (``script_workers``)."""
    return script_workers(SCRIPT, tmp, n, args, store_port, name)


@pytest.mark.timeout(240)
def test_a_users_own_loop_survives_a_kill_in_process(tmp_path: Path) -> None:
    import torch.distributed as dist

    from tenplex.checkpoint import read_manifest

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    procs = _loop_workers(tmp_path, 4, ["--ckpt", str(ckpt), "--steps", str(STEPS), "--global-batch", str(BATCH),
                                        "--log", str(log), "--kill-at", "3:3"], store.port)
    reference = native_reference(STEPS)
    codes = wait_procs(procs, 200)
    assert codes == [0, 0, 0, -9], (codes, log_tails(tmp_path))
    recs = check_native_run(tmp_path, log, reference, steps=STEPS)
    assert len(recs) == 1 and recs[0]["live"] and recs[0]["world_size"] == 3, recs
    rec = recs[0]
    lat = rec["latency"]
    assert lat["path"] == "in-process", lat
    parts = ("detection", "agreement", "regroup", "rebuild", "choose_plan", "transfer", "first_step")
    assert all(lat[f"{p}_s"] > 0 for p in parts), lat
    assert abs(lat["total_s"] - sum(lat[f"{p}_s"] for p in parts)) < 1e-9
    # the bytes: what the recovery moved and read, and a full-replica copy's (the whole state dict)
    whole = read_manifest(str(ckpt), STEPS)["ptc"].nbytes
    assert lat["bytes_full_replica"] == rec["bytes_full_replica"] == whole, (lat, whole)
    assert (lat["bytes_live"], lat["bytes_storage"]) == (rec["bytes_live"], rec["bytes_storage"])
    assert 0 < rec["bytes_live"] + rec["bytes_storage"] < whole, rec
    # summed over the group after the first step (not on its path): the plan's bytes, not rank 0's share
    assert (rec["bytes_live"], rec["bytes_storage"]) == (rec["plan_bytes_peer"], rec["plan_bytes_storage"]), rec
    assert rec["rank_order_plan_bytes_peer"] is not None, rec
    assert "recovery (in-process) latency" in (tmp_path / "worker0.log").read_text()
    json.dumps(rec)  # the record the benchmarks read is plain JSON


@pytest.mark.timeout(60)
def test_an_empty_rebuild_initialises_nothing_and_its_optimizer_state_is_shaped_as_the_old_one() -> None:
    """A recovery's rebuild (issue #31 goal): ``build(mesh)`` runs on the meta device (the user's
    ``.to("cpu")`` and weight init touch no data, and the init's ops are not even run there), the
    model is materialised empty with the optimizer still over its parameters, and the optimizer's
    state is created empty as the old one's (keys, shapes, dtypes), so that ``get_state_dict`` runs
    no initialising step. A model with a
    non-persistent buffer (no state dict restores it) is refused: built for real."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tenplex.elastic.runtime import build_empty, optimizer_template, prime_optimizer

    sys.path.insert(0, str(ROOT / "examples"))
    import native_llama as nl

    cfg = dataclasses.replace(nl.PRESETS["tiny"], vocab_size=259)
    seen_meta = []

    seen_random: list[tuple[bool, tuple[int, ...], torch.dtype, bool]] = []

    def build(mesh):  # noqa: ANN001, ANN202 - as a user writes it (examples/train_native.py)
        model = nl.parallelize(nl.reference_model(cfg, seed=0).to("cpu"), mesh)
        seen_meta.append(next(model.parameters()).is_meta)
        if seen_meta[-1]:  # on meta the init's ops are not run: a random tensor is an empty one of its shape,
            # an in-place fill the tensor as it is; one asked for on another device is made as usual
            w = next(model.parameters())
            r = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            c = torch.randn(2, device="cpu", generator=torch.Generator().manual_seed(0))
            seen_random.append((r.is_meta, tuple(r.shape), r.dtype, w.normal_() is w and w.copy_(w) is w))
            assert not c.is_meta and torch.equal(c, torch.randn(2, generator=torch.Generator().manual_seed(0),
                                                                device="cpu"))
        return model, nl.make_optimizer(model)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        model, opt = build(mesh)
        x, y = nl.batch(0, 2, cfg.seq_len, cfg.vocab_size)
        nl.train_step(model, opt, x, y)
        template = optimizer_template(opt)
        to = torch.nn.Module.to
        built = build_empty(build, mesh, "cpu")
        assert built is not None and seen_meta == [False, True] and torch.nn.Module.to is to
        assert seen_random == [(True, (2, 3), torch.float64, True)], seen_random
        model2, opt2 = built
        params = list(model2.parameters())
        assert not any(p.is_meta for p in params)
        assert [id(p) for g in opt2.param_groups for p in g["params"]] == [id(p) for p in params]
        assert prime_optimizer(opt2, template) and not prime_optimizer(opt2, template)  # only an empty state
        old = [opt.state[p] for g in opt.param_groups for p in g["params"]]
        new = [opt2.state[p] for g in opt2.param_groups for p in g["params"]]
        assert [{k: (tuple(v.shape), v.dtype) for k, v in s.items()} for s in old] == \
            [{k: (tuple(v.shape), v.dtype) for k, v in s.items()} for s in new]
        def bits(p: torch.Tensor) -> torch.Tensor:  # uninitialised memory may hold NaNs: compare the bits
            return p.detach().to_local().view(torch.int32).clone()

        before = [bits(p) for p in params]
        get_state_dict(model2, opt2)  # no initialising step: the state is the primed one, the parameters as they were
        assert all(opt2.state[p]["exp_avg"] is s["exp_avg"] for p, s in zip(params, new))
        assert all(torch.equal(a, bits(p)) for a, p in zip(before, params))

        class WithCache(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Linear(4, 4)
                self.register_buffer("cache", torch.arange(4.0), persistent=False)

        def build_cached(mesh):  # noqa: ANN001, ANN202
            m = WithCache()
            return m, torch.optim.AdamW(m.parameters())

        assert build_empty(build_cached, mesh, "cpu") is None
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_spare_takes_a_dead_trainers_place(tmp_path: Path) -> None:
    """6 workers, a mesh of at most 4: workers 4 and 5 wait as spares. Trainer 1 is SIGKILLed in the
    forward pass of step 3; the recovery gives spare 4 its place (the survivors first, then the
    spares: live_order) and moves it its state live, spare 5 stays a spare of the new group of 5.
    Every step's loss within 1e-5 of the uninterrupted run's, every sample once."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    procs = _loop_workers(tmp_path, 6, ["--ckpt", str(ckpt), "--steps", str(STEPS), "--global-batch", str(BATCH),
                                        "--log", str(log), "--kill-at", "1:3", "--mesh", "4"], store.port)
    reference = native_reference(STEPS)
    codes = wait_procs(procs, 150)
    assert codes == [0, -9, 0, 0, 0, 0], (codes, log_tails(tmp_path))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    start = next(e for e in events if e.get("start"))
    assert start["world_size"] == 6 and start["mesh"] == {"dp_shard": 4}, start
    # worker 4 was a spare until the recovery; worker 5 before and after it
    spare = [(tmp_path / f"worker{r}.log").read_text().count("a spare (the mesh") for r in (4, 5)]
    assert spare == [1, 2], spare
    recs = check_native_run(tmp_path, log, reference, steps=STEPS)
    for e in (e for e in events if "loss" in e):  # within 1e-5 of the uninterrupted run (check_native_run: 1e-4)
        assert abs(e["loss"] - reference[e["step"]][0]) <= 1e-5 * abs(reference[e["step"]][0]), e
    assert len(recs) == 1, recs
    rec = recs[0]
    # the survivors first, then the spares (first-group ranks 4, 5); the mesh keeps its 4 ranks
    assert rec["live"] and rec["world_size"] == 5 and rec["mesh"] == {"dp_shard": 4}, rec
    assert sorted(rec["alive"][:3]) == [0, 2, 3] and rec["alive"][3:] == [4, 5] and rec["joiners"] == [], rec
    # the spare's shard: what only trainer 1 held comes from the checkpoint of step 2, the rest from survivors
    assert rec["bytes_live"] > 0 and rec["bytes_storage"] > 0, rec


def _within(events: list[dict], reference: dict[int, tuple[float, list[int]]], steps: int) -> None:
    """Every step logged exactly once, its loss within 1e-5 (relative) of the uninterrupted run's, its
    samples the run's (so every sample once)."""
    logged = [e for e in events if "loss" in e]
    assert sorted(e["step"] for e in logged) == list(range(steps)), [e["step"] for e in logged]
    for e in logged:
        loss, samples = reference[e["step"]]
        assert abs(e["loss"] - loss) <= 1e-5 * abs(loss) and e["samples"] == samples, (e, loss)


@pytest.mark.timeout(240)
def test_a_job_with_spares_restarts_from_its_checkpoint_under_a_new_mesh(tmp_path: Path) -> None:
    """The restart fallback with spares. Run 1: 5 workers, no membership store (the launcher's restart
    is the recovery), the rule leaving 2 spares: dp_shard=3. Trainer 1 is SIGKILLed in the forward
    pass of step 4 (step 4's checkpoint complete: every 2 steps); the others are stopped as torchrun's
    agent stops them (SIGTERM). Run 2, the workers restarted: 4, with a membership store, the same
    rule: 2 trainers load step 4 under dp_shard=2, the 2 spares load nothing and learn the step;
    steps 4-5 run. Every step logged once over both runs, each loss within 1e-5 of the uninterrupted run's."""
    import torch.distributed as dist

    from tenplex.checkpoint import list_steps

    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    args = ["--ckpt", str(ckpt), "--steps", str(STEPS), "--global-batch", str(BATCH), "--log", str(log), "--spares", "2"]
    procs = _loop_workers(tmp_path, 5, [*args, "--kill-at", "1:4"], None, name="first")
    reference = native_reference(STEPS)
    assert wait_procs(procs[1:2], 120) == [-9], log_tails(tmp_path)
    for p in procs:  # torchrun's agent: a worker failed, the others are stopped
        if p.poll() is None:
            p.terminate()
    codes = wait_procs(procs, 30)
    assert codes[1] == -9 and all(c not in (0, None) for c in codes), (codes, log_tails(tmp_path))
    assert max(s.step for s in list_steps(str(ckpt)) if s.complete) == 4
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    procs = _loop_workers(tmp_path, 4, args, store.port, name="second")
    codes = wait_procs(procs, 150)
    assert codes == [0] * 4, (codes, log_tails(tmp_path))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e for e in events if e.get("start")]
    assert [(s["world_size"], s["mesh"], s["step"]) for s in starts] == [(5, {"dp_shard": 3}, 0),
                                                                        (4, {"dp_shard": 2}, 4)], starts
    assert starts[1]["fresh"] is False and 0 < starts[1]["bytes_needed"] <= starts[1]["bytes_read"], starts[1]
    spares = [(tmp_path / f"second{r}.log").read_text().count("a spare (the mesh") for r in range(4)]
    assert spares == [0, 0, 1, 1], spares
    _within(events, reference, STEPS)
    assert not [e for e in events if e.get("event") == "recover"]


@pytest.mark.timeout(180)
def test_a_spares_death_moves_no_state(tmp_path: Path) -> None:
    """6 workers, a mesh of 4: workers 4 and 5 wait as spares. Spare 5 is SIGKILLed while the
    trainers are in step 2 or later. A spare holds no state: the recovery (a membership change,
    then the model rebuilt on the same mesh, today's one path) keeps the mesh of 4 trainers in their
    places, moves 0 bytes between ranks and reads 0 from storage; every step logged once, its loss
    within 1e-5 of the uninterrupted run's."""
    import time

    import torch.distributed as dist

    # steps to spare after the kill's step: the tiny model's steps take tens of ms, and a kill that lands
    # after the trainers' last step would find no step left to fail (no recovery, the spare exited)
    steps = STEPS + 4
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    procs = _loop_workers(tmp_path, 6, ["--ckpt", str(ckpt), "--steps", str(steps), "--global-batch", str(BATCH),
                                        "--log", str(log), "--mesh", "4"], store.port)
    reference = native_reference(steps)
    deadline = time.monotonic() + 120
    while not (log.exists() and any(json.loads(line).get("step", -1) >= 2 and "loss" in line
                                     for line in log.read_text().splitlines())):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), log_tails(tmp_path)
        time.sleep(0.05)
    procs[5].kill()
    codes = wait_procs(procs, 120)
    assert codes == [0, 0, 0, 0, 0, -9], (codes, log_tails(tmp_path))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    _within(events, reference, steps)
    recs = [e for e in events if e.get("event") == "recover"]
    assert len(recs) == 1, recs
    rec = recs[0]
    # the trainers keep their ranks and the mesh; spare 4 stays a spare
    assert rec["live"] and rec["world_size"] == 5 and rec["mesh"] == {"dp_shard": 4}, rec
    assert rec["alive"] == [0, 1, 2, 3, 4] and rec["joiners"] == [], rec
    assert rec["bytes_live"] == rec["bytes_storage"] == 0 and rec["plan_bytes_moved"] == 0, rec
    assert (tmp_path / "worker4.log").read_text().count("a spare (the mesh") == 2


def _spare_start(rank: int, port: int, ckpt: str, store_port: int | None, q: Any) -> None:
    """Rank ``rank`` of 2 under a mesh rule that places 1 rank (in process with the membership store at
    ``store_port``, else not): what its ``build`` saw and ran; every optimizer step hook, the
    optimizer's own and torch's global ones, counted."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import tenplex

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    if store_port is not None:
        os.environ["TENPLEX_MEMBERSHIP_STORE"] = f"127.0.0.1:{store_port}"
    builds: list[list[int]] = []
    hooks: list[int] = []
    out: dict[str, Any] = {"error": None}
    try:
        def build(mesh: Any) -> tuple[Any, Any]:
            builds.append(mesh.mesh.flatten().tolist())
            model = fully_shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), mesh=mesh)
            optimizer = torch.optim.AdamW(model.parameters())
            optimizer.register_step_pre_hook(lambda *_: hooks.append(rank))
            return model, optimizer

        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(lambda *_: hooks.append(100 + rank))
        register_optimizer_step_post_hook(lambda *_: hooks.append(200 + rank))
        rt = tenplex.ElasticRuntime(build, lambda world: {"dp_shard": 1}, ckpt=ckpt,
                                    in_process=store_port is not None)
        out.update(spare=rt.spare, builds=builds, hooks=hooks, holds=rt.model is not None,
                   # what a rebuild without an old optimizer primes its state from: per parameter, the
                   # parameter-shaped entries by dtype, the small ones as real tensors (not the meta warm-up's)
                   template=[{k: v if isinstance(v, tuple) else (str(v.device), v.shape) for k, v in spec.items()}
                             for spec in rt._warm_template or []])
        rt.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    q.put((rank, out))


@pytest.mark.timeout(120)
def test_a_spare_pays_its_first_build_at_its_start(tmp_path: Path) -> None:
    """A spare builds the model once at its start, on a mesh of its own rank alone (a group no other
    rank takes part in), and drops it: the first build's one-time costs (torch._dynamo's import, FSDP2's
    first set-up: 0.43 s of a 1.9 s recovery in scripts/bench_recovery.py's spare row) are not paid at
    the recovery that gives it a place, where the trainers wait for it. The optimizer step that
    ``get_state_dict`` runs on that model to create its state runs none of the job's step hooks (the
    optimizer's own, torch's global ones); the state's structure is kept to prime the optimizer of the
    spare's place (no initialising step then). In process, a member builds so at its start too."""
    from spawned import run_spawned

    port = free_port()
    got = run_spawned(_spare_start, [(r, port, str(tmp_path / "ckpt"), None) for r in range(2)], expect=2,
                      timeout=100)
    assert all(got[r]["error"] is None for r in range(2)), got
    assert got[0]["spare"] is False and got[0]["builds"] == [[0]] and got[0]["holds"], got[0]
    assert got[1]["spare"] is True and got[1]["builds"] == [[1]] and not got[1]["holds"], got[1]
    assert got[0]["hooks"] == got[1]["hooks"] == [], got
    assert got[1]["template"] == [{"step": ("cpu", torch.Size([])), "exp_avg": ("param", torch.float32),
                                   "exp_avg_sq": ("param", torch.float32)}] * 4, got[1]["template"]
    # in process: the member builds once more at its start, on its own rank (its first build's imports
    # before the runtime's gc.freeze()), and runs no hook either
    store = torch.distributed.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    port = free_port()
    got = run_spawned(_spare_start, [(r, port, str(tmp_path / "ckpt2"), store.port) for r in range(2)], expect=2,
                      timeout=100)
    assert all(got[r]["error"] is None for r in range(2)), got
    assert got[0]["spare"] is False and got[0]["builds"] == [[0], [0]] and got[0]["holds"], got[0]
    assert got[1]["spare"] is True and got[1]["builds"] == [[1]] and not got[1]["holds"], got[1]
    assert got[0]["hooks"] == got[1]["hooks"] == [], got



def _interrupted(rank: int, port: int, store_port: int, ckpt: str, q: Any) -> None:
    """Rank ``rank`` of 2, in process, with a model of 30 slow blocks and no collective in its forward
    (as HSDP's other replica's forward has none with a dead rank): rank 1 SIGKILLs itself as step 1
    starts; rank 0 counts the blocks it ran after its membership knew of the death."""
    import os
    import signal

    import tenplex

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      TENPLEX_MEMBERSHIP_STORE=f"127.0.0.1:{store_port}")
    out: dict[str, Any] = {"error": None, "after": 0, "blocks": 0}
    rt: Any = None

    class Slow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out["blocks"] += 1
            out["after"] += int(rt is not None and rt.membership.failed)
            time.sleep(0.03)
            return self.lin(x)

    try:
        def build(mesh: Any) -> tuple[Any, Any]:
            model = torch.nn.Sequential(*(Slow() for _ in range(30)))
            return model, torch.optim.SGD(model.parameters(), lr=0.1)

        rt = tenplex.ElasticRuntime(build, lambda world: {"dp_shard": world}, ckpt=ckpt, in_process=True)
        for step in rt.steps(3):
            with step:
                if rt.step == 1 and rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                rt.model(torch.ones(2, 4)).sum().backward()
                rt.optimizer.step()
                rt.optimizer.zero_grad()
        out.update(step=rt.step, world=rt.world_size)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    q.put((rank, out))


@pytest.mark.timeout(120)
def test_a_known_death_ends_the_step_at_the_next_block(tmp_path: Path) -> None:
    """A survivor whose forward has no collective with the dead rank (HSDP's other replica) leaves
    the step at the next block of its model once its membership knows of the death, not after the
    whole forward (before: up to 0.17 s of computing on in the native bench's rank-0 kill): of the
    30 blocks of 30 ms each, at most the one running when the link broke runs with the death known.
    Then it recovers alone and finishes."""
    from spawned import run_spawned

    store = torch.distributed.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    port = free_port()
    got = run_spawned(_interrupted, [(r, port, store.port, str(tmp_path / "ckpt")) for r in range(2)], expect=1,
                      timeout=100)
    assert 0 in got, got
    r = got[0]
    assert r["error"] is None, r
    assert r["world"] == 1 and r["step"] == 3, r
    assert r["after"] <= 1, r  # without the blocks' hook: the rest of the forward, about 25 blocks
    assert r["blocks"] >= 90, r  # steps 0 and 2 and the redone step 1 whole


def _blocked_on_a_release(rank: int, port: int, destroy: bool, q: Any) -> None:
    """3 gloo ranks, a (1, 2) mesh over ranks 0 and 1 (its dp_shard group a group of its own, not the
    default one; rank 2 a spare): rank 0 waits in an all_reduce over the dp_shard group that rank 1
    never joins; rank 1 releases the mesh (``release_mesh``), holds no other reference to it and stays
    alive 3 s. Rank 0 reports how long it waited."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from tenplex.native.dtensor import release_mesh

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                                timeout=datetime.timedelta(seconds=8))
        mesh = DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        x = torch.ones(4)
        if rank < 2:
            dist.all_reduce(x, group=mesh.get_group("dp_shard"))  # connected
        dist.barrier()
        if rank == 2:
            time.sleep(3.5)
            q.put((rank, {"error": None}))
        elif rank == 0:
            t0 = time.monotonic()
            try:
                dist.all_reduce(x, group=mesh.get_group("dp_shard"))
                q.put((rank, {"error": "the all_reduce returned"}))
            except RuntimeError:
                q.put((rank, {"error": None, "waited": time.monotonic() - t0}))
        else:
            time.sleep(0.3)
            release_mesh(mesh, destroy=destroy)
            del mesh
            time.sleep(3.0)
            q.put((rank, {"error": None}))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, {"error": f"{type(e).__name__}: {e}"}))


@pytest.mark.timeout(90)
def test_a_released_mesh_closes_its_groups_at_once_when_destroyed() -> None:
    """``release_mesh(mesh, destroy=True)`` drops torch.distributed's references to the mesh's groups
    too: a peer blocked on this rank in one of them fails at once (a recovery's release, before the
    collection and the default group's destroy). Without ``destroy`` torch.distributed still holds
    the group: the peer waits until this process exits."""
    from spawned import run_spawned

    waited = {}
    for destroy in (True, False):
        port = free_port()
        got = run_spawned(_blocked_on_a_release, [(r, port, destroy) for r in range(3)], expect=3, timeout=40)
        assert all(v["error"] is None for v in got.values()), got
        waited[destroy] = got[0]["waited"]
    assert waited[True] < 1.5 and waited[False] > 2.5, waited
