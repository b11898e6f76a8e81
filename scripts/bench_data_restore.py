"""Restoring a loader's data position under a new layout at 10^9 samples (issue #32's goal: <= 10 ms/rank).

A run over 10^9 samples (global batch 1024, "feistel" order) stops at a position in its fourth epoch
under DP 8; its state (JSON, as saved) is loaded by every rank of DP 6 (uneven: 6 does not divide
1024), each of which then computes the sample ids of its first batch. One repeat times, per rank:
the JSON decode, ``ElasticBatchSampler.load_state_dict`` and the first batch's ids (what a restored
rank does before it reads data); the figure is a rank's restore in ms (median/min/max over the
repeats and the ranks). For contrast, the same restore in the PCG64 order (the permutation
materialised, O(n)) at 10^7 samples.

    PYTHONPATH=. python scripts/bench_data_restore.py --json [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tenplex.data import DataState, ElasticBatchSampler, loader_state, sample_order

N = 10**9
BATCH = 1024
OLD_DP, NEW_DP = 8, 6


def spread(xs: list[float]) -> dict[str, object]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def restore_ms(saved: str, start: DataState, dp: int, rank: int) -> float:
    """One rank's restore: decode the saved state, load it, compute its first batch's ids (ms)."""
    sampler = ElasticBatchSampler(start, dp, rank)
    t0 = time.perf_counter()
    sampler.load_state_dict(json.loads(saved))
    ids = next(iter(sampler))
    ms = (time.perf_counter() - t0) * 1e3
    assert len(ids) in (BATCH // dp, BATCH // dp + 1)
    return ms


def measure(num_samples: int, order: str, repeats: int) -> list[float]:
    start = DataState(num_samples, BATCH, seed=1234, order=order)
    old = ElasticBatchSampler(start, OLD_DP, 0)
    old.load_state_dict({"data": {**start.to_json(), "consumed": 3 * num_samples + 1_234_567 * BATCH % num_samples}})
    saved = json.dumps(old.state_dict())
    runs = []
    for _ in range(repeats):
        for r in range(NEW_DP):
            sample_order.cache_clear()  # each rank restores cold (its own process): no permutation kept
            runs.append(restore_ms(saved, start, NEW_DP, r))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    assert loader_state(N, BATCH).order == "feistel"
    feistel = measure(N, "feistel", args.repeats)
    pcg = measure(10**7, "pcg64", max(1, args.repeats // 2))
    out = {
        "restore_ms_per_rank": {**spread(feistel), "num_samples": N, "global_batch": BATCH,
                                "dp": f"{OLD_DP}->{NEW_DP}", "order": "feistel", "goal_ms": 10.0},
        "restore_ms_per_rank_pcg64_1e7": {**spread(pcg), "num_samples": 10**7},
        "load_average": os.getloadavg()[0],
    }
    f = out["restore_ms_per_rank"]
    print(f"restore at {N:.0e} samples, DP {OLD_DP} -> {NEW_DP}: {f['median']:.3f} ms/rank "
          f"[{f['min']:.3f}, {f['max']:.3f}] over {len(feistel)} rank restores (goal <= 10 ms); "
          f"PCG64 order at 1e7: {statistics.median(pcg):.0f} ms; load {out['load_average']:.1f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
