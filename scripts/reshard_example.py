#!/usr/bin/env python
"""tenplex demo: save a model under one (DP, TP, PP) layout, lose GPUs, continue under another.

1. A Llama-style model with Adam state is sharded over 8 GPUs as dp=2,tp=2,pp=2 and saved.
2. Two GPUs fail. tenplex plans the move to 6 GPUs (tp=2,pp=3, uneven stages) from the
   surviving shards, preferring bytes already in place, and reads from the checkpoint only
   what no survivor holds.
3. Every new rank also loads its shard straight from the checkpoint, reading only the bytes it
   needs. Both results are compared bit for bit with the global tensors.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tenplex  # noqa: E402
from tenplex.cli import human_bytes  # noqa: E402
from tenplex.planning.reshard import reshard  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="checkpoint URL (default: a temporary directory)")
    args = ap.parse_args()

    ptc = tenplex.model_ptc(arch="llama", num_layers=8, hidden=256, heads=8, kv_heads=4, ffn_hidden=688,
                            vocab=1000, vocab_pad=64, dtype=torch.float32)
    old = tenplex.ParallelConfig.parse("dp=2,tp=2,pp=2")
    new = tenplex.ParallelConfig.parse("dp=1,tp=2,pp=3")
    failed = [6, 7]
    alive = [r for r in range(old.world_size) if r not in failed]
    print(f"model: Llama, 8 layers, hidden 256, GQA 8/4 heads, SwiGLU, vocab 1000 (padded per TP) "
          f"+ Adam state: {len(ptc)} tensors, {human_bytes(ptc.nbytes)}")

    torch.manual_seed(0)
    global_state = {n: torch.randn(s.shape, dtype=s.dtype) for n, s in ptc.tensors.items()}
    global_state["optimizer.step"] = 100
    shards = ptc.shard(global_state, old)

    tmp = None
    url = args.ckpt
    if url is None:
        tmp = tempfile.mkdtemp(prefix="tenplex-demo-")
        url = tmp
    try:
        t0 = time.perf_counter()
        written = sum(tenplex.save(url, ptc, old, r, shards[r], step=100).bytes_written
                      for r in range(old.world_size))
        t_save = time.perf_counter() - t0
        print(f"\n[1] saved step 100 under {old} ({old.world_size} GPUs) to {url}: "
              f"{human_bytes(written)} written in {t_save:.2f}s "
              f"(replicated chunks written once: {written / ptc.nbytes:.2f}x the model's bytes)")

        print(f"\n[2] GPUs {failed} fail; {len(alive)} survive -> new layout {new} (stages "
              f"{'+'.join(map(str, new.layers_per_stage(ptc.num_layers)))}), 4 GPUs per host")
        p = tenplex.plan(ptc, old, new, alive=alive, gpus_per_host=4)
        s = p.stats
        for label, value in (("needed by the new ranks", s.bytes_needed), ("already on the right GPU", s.bytes_local),
                             ("from a GPU on the same host", s.bytes_same_host),
                             ("from a GPU on another host", s.bytes_cross_host),
                             ("from the checkpoint (no survivor)", s.bytes_storage),
                             ("lower bound on movement", s.bytes_lower_bound),
                             ("most sent by one GPU", s.max_send_bytes)):
            print(f"    {label:<36} {human_bytes(value):>11}")
        print(f"    planned {s.num_moves} moves in {s.plan_seconds * 1e3:.1f} ms")

        flats = {n: ptc.tensors[n].to_canonical(global_state[n]) for n in ptc.tensors}
        storage_reads = 0

        def read_storage(name: str, start: int, length: int) -> torch.Tensor:
            nonlocal storage_reads
            storage_reads += length * ptc.tensors[name].itemsize
            return flats[name][start : start + length]

        moved = reshard(p, {r: shards[r] for r in alive}, read_storage=read_storage)
        expected = ptc.shard(global_state, new)
        ok_plan = all(torch.equal(moved[r][n], expected[r][n]) for r in expected for n in ptc.rank_tensors(new, r))
        print(f"    executed in memory: new shards {'MATCH' if ok_plan else 'DIFFER FROM'} the global tensors "
              "bit for bit")

        print(f"\n[3] each of the {new.world_size} new ranks loads its shard from the checkpoint:")
        total_read = total_needed = 0
        t0 = time.perf_counter()
        ok_load = True
        for r in range(new.world_size):
            res = tenplex.load(url, new, r, ptc=ptc)
            total_read += res.stats.bytes_read
            total_needed += res.stats.bytes_needed
            ok_load &= all(torch.equal(res.shard[n], expected[r][n]) for n in ptc.rank_tensors(new, r))
            ok_load &= res.shard["optimizer.step"] == 100
        t_load = time.perf_counter() - t0
        print(f"    read {human_bytes(total_read)} for {human_bytes(total_needed)} needed "
              f"({total_read / total_needed:.3f}x) in {t_load:.2f}s; shards "
              f"{'MATCH' if ok_load else 'DIFFER FROM'} the global tensors bit for bit")

        print("\nsummary")
        print(f"  {old} -> {new} after losing GPUs {failed}")
        print(f"  from survivors: {human_bytes(s.bytes_moved - s.bytes_storage)} moved, "
              f"{human_bytes(s.bytes_local)} kept in place, {human_bytes(s.bytes_storage)} from storage")
        print(f"  from checkpoint only: {human_bytes(total_read)} read ({total_read / total_needed:.3f}x needed)")
        print(f"  correctness: {'OK' if ok_plan and ok_load else 'FAILED'}")
        return 0 if ok_plan and ok_load else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
