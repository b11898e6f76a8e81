"""Cost of the survivors' locality order for torch-native state dicts (``StateLayout``), timed.

A Llama-like state dict (``--layers`` layers of ``--dim`` hidden, ``--ffn`` FFN, ``--vocab`` vocab:
the model's weights and AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step`` per weight, placed as FSDP2
and torchtitan's TP place them) on ``n`` ranks, one rank dead, the survivors' mesh the native
example's rule gives (``dp_shard = n - 1``). Per case and size, what a recovery runs in
``elastic.live_order`` before the new mesh exists: ``StateLayout.remesh`` (the new layout) and
``planner.locality_order`` (holder tables, the sparse byte matrix, the matching):

- ``cold``: the holder tables of the new layout not yet computed (module caches cleared);
- ``warm``: computed before (what ``inprocess.warm_up`` leaves for a single failure: the same new
  world size).

Also the bytes the plan moves between survivors in the old rank order and in the locality order.
Medians with min/max of ``--repeats``, the load average before and after, the command; JSON to
``--out`` (default docs/bench/bench_locality.json).

    PYTHONPATH=. python scripts/bench_locality.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tenplex.layout import mesh as mesh_module
from tenplex.layout import state_layout
from tenplex.layout.mesh import NamedMesh, Replicate, Shard, StridedShard
from tenplex.layout.ptc import PTC
from tenplex.layout.state_layout import Placed, StateLayout, spec_for
from tenplex.planning.planner import locality_order, plan

ROOT = Path(__file__).resolve().parent.parent


def llama_tensors(layers: int, dim: int, ffn: int, vocab: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every state-dict key: its shape and how torchtitan's TP places it (col, row, rep; scalar: AdamW's step)."""
    kv = dim // 4
    model: dict[str, tuple[tuple[int, ...], str]] = {
        "tok_embeddings.weight": ((vocab, dim), "row"), "norm.weight": ((dim,), "rep"),
        "output.weight": ((vocab, dim), "col")}
    for layer in range(layers):
        p = f"layers.{layer}."
        model.update({
            p + "attention.wq.weight": ((dim, dim), "col"), p + "attention.wk.weight": ((kv, dim), "col"),
            p + "attention.wv.weight": ((kv, dim), "col"), p + "attention.wo.weight": ((dim, dim), "row"),
            p + "feed_forward.w1.weight": ((ffn, dim), "col"), p + "feed_forward.w3.weight": ((ffn, dim), "col"),
            p + "feed_forward.w2.weight": ((dim, ffn), "row"), p + "attention_norm.weight": ((dim,), "rep"),
            p + "ffn_norm.weight": ((dim,), "rep")})
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, v in model.items():
        out["model." + name] = v
        out[f"optim.state.{name}.exp_avg"] = v
        out[f"optim.state.{name}.exp_avg_sq"] = v
        out[f"optim.state.{name}.step"] = ((), "scalar")
    return out


def job_layout(tensors: dict[str, tuple[tuple[int, ...], str]], dims: dict[str, int]) -> tuple[PTC, StateLayout]:
    """The collection and layout ``describe_state_dict`` gives such a job on the mesh ``dims``."""
    mesh = NamedMesh(tuple(dims.items()))
    n, tp = mesh.world_size, dims.get("tp", 1)
    ranks = tuple(range(n))
    placed: dict[str, Placed] = {}
    for name, (shape, kind) in tensors.items():
        if kind == "scalar":
            placed[name] = Placed.replicated(ranks)
            continue
        pl: list[Any] = []
        for d in mesh.names:
            if d == "dp_replicate":
                pl.append(Replicate())
            elif d == "dp_shard":
                pl.append(StridedShard(0, tp) if kind == "col" and tp > 1 else Shard(0))
            else:
                pl.append({"col": Shard(0), "row": Shard(1), "rep": Replicate()}[kind])
        placed[name] = Placed(mesh, tuple(pl), ranks)
    specs = [spec_for(k, tensors[k][0], "float32", placed[k].placements) for k in sorted(tensors)]
    return PTC(specs, num_layers=0), StateLayout.of(n, sorted(placed.items()))


CASES = {"fsdp_tp": lambda n: {"dp_shard": n // 2, "tp": 2}, "hsdp": lambda n: {"dp_replicate": 2, "dp_shard": n // 2}}


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def clear_caches() -> None:
    """The module-level holder-table caches: a new layout's tables computed again."""
    state_layout._table.cache_clear()
    state_layout._box_table.cache_clear()
    mesh_module._holder_table.cache_clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,64,512")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dead", type=int, default=3, help="the old rank that dies")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "bench_locality.json"))
    args = ap.parse_args()
    tensors = llama_tensors(args.layers, args.dim, args.ffn, args.vocab)
    locality_order(*job_layout(tensors, {"dp_shard": 2}), job_layout(tensors, {"dp_shard": 2})[1], [0, 1])  # scipy import
    load_before = os.getloadavg()
    result: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "model": {"layers": args.layers, "dim": args.dim, "ffn": args.ffn, "vocab": args.vocab,
                                        "tensors": len(tensors)},
                              "dead": args.dead, "repeats": args.repeats, "loadavg_before": load_before, "cases": {}}
    for case in args.cases.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            ptc, old = job_layout(tensors, CASES[case](n))
            survivors = [r for r in range(n) if r != args.dead]
            dims = {"dp_shard": n - 1}
            cold, warm = [], []
            for _ in range(args.repeats):
                clear_caches()
                for spec in ptc.tensors.values():  # the old layout's tables: computed at start-up (warm_up)
                    old.holder_table(spec)
                t0 = time.perf_counter()
                new = old.remesh(dims)
                order = locality_order(ptc, old, new, survivors)
                cold.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                new = old.remesh(dims)
                again = locality_order(ptc, old, new, survivors)
                warm.append(time.perf_counter() - t0)
                assert again == order
            by_rank, by_locality = (plan(ptc, old, new, alive=a).stats for a in (survivors, order))
            key = f"{case}/{n}"
            result["cases"][key] = {
                "from": CASES[case](n), "to": dims,
                "cold_s": summary(cold), "warm_s": summary(warm),
                "moved_order_changed": int(np.sum(np.asarray(order) != np.asarray(survivors))),
                "peer_bytes_rank_order": by_rank.bytes_same_host + by_rank.bytes_cross_host,
                "peer_bytes_locality_order": by_locality.bytes_same_host + by_locality.bytes_cross_host,
                "local_bytes_rank_order": by_rank.bytes_local, "local_bytes_locality_order": by_locality.bytes_local,
                "bytes_needed": by_rank.bytes_needed,
            }
            c = result["cases"][key]
            print(f"{key}: cold {c['cold_s']['median'] * 1e3:.1f} ms [{c['cold_s']['min'] * 1e3:.1f}, "
                  f"{c['cold_s']['max'] * 1e3:.1f}], warm {c['warm_s']['median'] * 1e3:.1f} ms "
                  f"[{c['warm_s']['min'] * 1e3:.1f}, {c['warm_s']['max'] * 1e3:.1f}]; peer bytes "
                  f"{c['peer_bytes_rank_order']:,} (old rank order) -> {c['peer_bytes_locality_order']:,} (locality); "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    result["loadavg_after"] = os.getloadavg()
    print(f"load average before {load_before}, after {result['loadavg_after']}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
