"""Uneven data parallelism under ``ElasticRuntime`` (issue #32 with #31's runtime): a DP degree that
does not divide the global batch runs when the job weighs each rank's loss by its share.

1. Pure (hypothesis): the shares of any DP size cover the global batch, differ by at most one
   micro-batch, the first ranks taking more; ``loss_scale`` makes the average over the ranks of the
   scaled per-rank means the global batch's mean (what an averaging DP gradient reduction computes);
   ``dp_refusal`` (``ElasticRuntime.fits`` and every mesh the runtime builds) admits a non-dividing
   DP degree only with ``uneven_dp``.
2. Spawned, one step's gradient: 4 gloo ranks under FSDP2 and under HSDP 2 x 2 split a global batch of
   6 as 2, 2, 1, 1; with each rank's mean loss times ``loss_scale`` (FSDP2's default averaging), or
   its summed loss over the global batch with FSDP2's reduction a sum, the gradient is the full
   batch's on one process within 1e-5; the plain per-rank mean is not (the samples of the smaller
   shares weigh twice).
3. Spawned: ``examples/elastic_loop.py --uneven`` (FSDP2 over every worker, global batch 8) on 4 gloo
   workers; worker 3 is SIGKILLed in step 3 and the 3 survivors continue in process as DP 3 reading
   3, 3 and 2 samples: every step's loss within 1e-5 of the uninterrupted run's, every sample of the
   run read exactly once (the ids each rank read), in the uninterrupted run's order.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.data import loss_scale, replica_slice
from tenplex.elastic.runtime import dp_refusal

from spawned import free_port, log_tails, run_spawned, wait_procs
from test_elastic_runtime import _loop_workers
from test_native_inprocess import check_native_run, native_reference

STEPS, BATCH = 6, 8  # 8 over 4 ranks: 2 each; over 3: 3, 3, 2
ROOT = Path(__file__).resolve().parent.parent


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 40), st.integers(1, 6), st.data())
def test_uneven_shares_weighed_by_loss_scale_give_the_global_mean(micro_batches: int, micro: int, data) -> None:
    g = micro_batches * micro
    dp = data.draw(st.integers(1, micro_batches), label="dp")
    slices = [replica_slice(g, dp, r, micro) for r in range(dp)]
    counts = [c for _, c in slices]
    assert [f for f, _ in slices] == list(np.cumsum([0, *counts[:-1]])) and sum(counts) == g  # contiguous, all of it
    assert counts == sorted(counts, reverse=True) and counts[0] - counts[-1] <= micro  # the first ranks take more
    scales = [loss_scale(g, dp, r, micro) for r in range(dp)]
    if g % (dp * micro) == 0:
        assert scales == [1.0] * dp  # an even split: the loss untouched
    losses = np.asarray(data.draw(st.lists(st.floats(0, 20, allow_nan=False), min_size=g, max_size=g), label="losses"))
    means = [losses[f:f + c].mean() for f, c in slices]
    averaged = sum(s * m for s, m in zip(scales, means)) / dp  # FSDP2 / DDP average the ranks' gradients so
    assert averaged == pytest.approx(losses.mean(), rel=1e-12, abs=1e-12)


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 64), st.integers(1, 4), st.integers(1, 16), st.integers(1, 4), st.booleans())
def test_a_mesh_runs_when_its_dp_degree_divides_the_batch_or_the_job_weighs_uneven_shares(
        g: int, rep: int, shard: int, tp: int, uneven: bool) -> None:
    dims = {"dp_replicate": rep, "dp_shard": shard, "tp": tp}
    dp = rep * shard
    why = dp_refusal(dims, g, uneven)
    assert (why is None) == (dp <= g and (g % dp == 0 or uneven)), (dims, g, uneven, why)
    if why is not None and dp <= g:
        assert f"{g} % {dp} = {g % dp}" in why and "uneven_dp=True" in why


@pytest.mark.timeout(240)
def test_a_job_continues_in_process_as_uneven_dp_3_after_losing_one_of_4(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    log, ids = tmp_path / "log.jsonl", tmp_path / "ids"
    ids.mkdir()
    procs = _loop_workers(tmp_path, 4, ["--ckpt", str(tmp_path / "ckpt"), "--steps", str(STEPS), "--global-batch",
                                        str(BATCH), "--log", str(log), "--kill-at", "3:3", "--uneven",
                                        "--ids", str(ids)], store.port)
    reference = native_reference(STEPS, BATCH)
    codes = wait_procs(procs, 200)
    assert codes == [0, 0, 0, -9], (codes, log_tails(tmp_path))
    recs = check_native_run(tmp_path, log, reference, steps=STEPS, global_batch=BATCH)
    assert len(recs) == 1 and recs[0]["live"] and recs[0]["world_size"] == 3 and recs[0]["mesh"] == {"dp_shard": 3}
    losses = [json.loads(line) for line in log.read_text().splitlines()]
    for e in (e for e in losses if "loss" in e):  # the uninterrupted run's mean loss over each global batch
        assert abs(e["loss"] - reference[e["step"]][0]) <= 1e-5 * abs(reference[e["step"]][0]), e
    reads = [json.loads(line) for f in sorted(ids.iterdir()) for line in f.read_text().splitlines()]
    worlds = []
    for step in range(STEPS):
        attempts: dict[int, list[dict]] = {}
        for r in (r for r in reads if r["step"] == step):
            attempts.setdefault(r["world_size"], []).append(r)
        final = sorted(max(attempts.values(), key=lambda a: min(r["t"] for r in a)), key=lambda r: r["dp_rank"])
        worlds.append(final[0]["world_size"])
        # the ranks of the step's final attempt read the global batch of the uninterrupted run, each id once
        assert [i for r in final for i in r["ids"]] == reference[step][1], (step, attempts)
        shares = [(len(r["ids"]), r["loss_scale"]) for r in final]
        assert shares == ([(2, 1.0)] * 4 if len(final) == 4 else [(3, 9 / 8), (3, 9 / 8), (2, 6 / 8)]), (step, shares)
    assert worlds[0] == 4 and worlds[-1] == 3 and set(worlds) == {4, 3}, worlds  # DP 4, then uneven DP 3


def _gradient_worker(rank: int, port: int, out: Any) -> None:
    """One step's gradient of every (mesh, convention) against the full batch's on one process."""
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "examples"))
    import native_llama as nl

    res: dict[str, Any] = {"error": None}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                                timeout=datetime.timedelta(seconds=60))
        cfg = dataclasses.replace(nl.PRESETS["tiny"], vocab_size=259)
        g = 6
        tokens, targets = nl.batch(0, g, cfg.seq_len, cfg.vocab_size, seed=3)
        ref = nl.reference_model(cfg, 0)
        nl.loss_fn(ref(tokens), targets).backward()
        want = dict(ref.named_parameters())
        for dims in ({"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2}):
            for convention in ("scale", "sum", "mean"):
                mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
                model = nl.parallelize(nl.reference_model(cfg, 0), mesh)
                dp_rank, dp = nl.dp_rank_and_size(mesh)
                first, count = replica_slice(g, dp, dp_rank, 1)
                x, y = tokens[first:first + count], targets[first:first + count]
                if convention == "sum":  # summed over the rank's samples / the global batch, a SUM reduction
                    for m in model.modules():
                        if hasattr(m, "set_gradient_divide_factor"):
                            m.set_gradient_divide_factor(1.0)
                            m.set_force_sum_reduction_for_comms(True)  # gloo runs no PREMUL_SUM
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1), reduction="sum") / (g * cfg.seq_len)
                else:
                    loss = nl.loss_fn(model(x), y) * (loss_scale(g, dp, dp_rank) if convention == "scale" else 1.0)
                loss.backward()
                res[f"{'x'.join(dims)}/{convention}"] = max(
                    float((p.grad.full_tensor() - want[k].grad).abs().max() / want[k].grad.abs().max())
                    for k, p in model.named_parameters())
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test with it
        res["error"] = f"{type(e).__name__}: {e}"
    out.put((rank, res))


@pytest.mark.timeout(120)
def test_weighed_uneven_shares_give_the_full_batchs_gradient_under_fsdp2_and_hsdp() -> None:
    port = free_port()
    got = run_spawned(_gradient_worker, [(r, port) for r in range(4)], expect=4, timeout=100)
    assert all(not r["error"] for r in got.values()), got
    errs = got[0]
    for mesh in ("dp_shard", "dp_replicatexdp_shard"):
        assert errs[f"{mesh}/scale"] < 1e-5 and errs[f"{mesh}/sum"] < 1e-5, errs
        assert errs[f"{mesh}/mean"] > 1e-2, errs  # the test sees the weighting
