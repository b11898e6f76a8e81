#!/usr/bin/env python
"""Loads through an S3-protocol server: one ranged GET per piece versus coalesced GETs in flight.

A ~20 MiB GPT is saved under dp=2,tp=2 to a moto S3 server on 127.0.0.1 (s3fs), then every
rank of a new layout loads its shard twice per run: with ``TENPLEX_CONCURRENT_READS=0`` (the
old path: one GET per piece, one after another) and with the default (pieces of a file
coalesced within the gap budget, up to 16 GETs in flight). Reported per rank: data GETs
(counted in s3fs), bytes read / needed, wall time; three runs (modes interleaved), median and
spread. ``--latency-ms`` adds a delay to every data GET, as a distant object store would.

    python scripts/bench_remote.py --json            # docs/bench/bench_remote.{md,json}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tenplex.checkpoint import load, save  # noqa: E402
from tenplex.checkpoint.part_reader import CONCURRENT_ENV  # noqa: E402
from tenplex.layout.config import ParallelConfig  # noqa: E402
from tenplex.layout.models import model_ptc  # noqa: E402
from tenplex.train.launch import free_port  # noqa: E402

MODES = ("sequential", "concurrent")


def bench_ptc() -> Any:
    """A GPT of about 20 MiB (float32, with its optimizer state); hidden 256 keeps TP pieces
    aligned to checksum blocks, so bytes read / needed shows the reader, not the rounding."""
    return model_ptc(arch="gpt", num_layers=2, hidden=256, heads=4, vocab=1000, seq_len=256, dtype=torch.float32)


def layout(text: str) -> ParallelConfig:
    return ParallelConfig(**{k: int(v) for k, v in (kv.split("=") for kv in text.split(","))})


class Counter:
    """Counts s3fs's data GETs (``*.safetensors``), optionally delaying each by ``latency`` s."""

    def __init__(self, real: Any, latency: float) -> None:
        self.real, self.latency, self.gets = real, latency, 0

    def wrapper(self) -> Any:
        async def _cat_file(fs: Any, path: str, *args: Any, **kw: Any) -> bytes:
            if path.endswith(".safetensors"):
                self.gets += 1
                if self.latency:
                    await asyncio.sleep(self.latency)
            return await self.real(fs, path, *args, **kw)

        return _cat_file


def load_rank(url: str, cfg: ParallelConfig, rank: int, opts: dict, mode: str, latency: float) -> dict:
    import s3fs

    os.environ[CONCURRENT_ENV] = "0" if mode == "sequential" else "1"
    counter = Counter(s3fs.S3FileSystem._cat_file, latency)
    with mock.patch.object(s3fs.S3FileSystem, "_cat_file", counter.wrapper()):
        t0 = time.perf_counter()
        res = load(url, cfg, rank, storage_options=opts)
        wall = time.perf_counter() - t0
    st = res.stats
    assert st.ranges == counter.gets, (st.ranges, counter.gets)
    return {"gets": counter.gets, "bytes_read": st.bytes_read, "bytes_needed": st.bytes_needed,
            "ratio": st.bytes_read / st.bytes_needed, "wall_s": wall}


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "runs": samples}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Start moto, save once, load every rank of every new layout ``args.runs`` times per mode
    and added latency (modes interleaved, their order alternating per run)."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    load0 = os.getloadavg()
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        opts = {"key": "x", "secret": "y", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
        ptc = bench_ptc()
        old = layout(args.old)
        g = torch.Generator().manual_seed(0)
        glob = {n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in ptc.tensors.items()}
        url = "s3://bench/ckpt"
        shards = ptc.shard(glob, old)
        t0 = time.perf_counter()
        for r in range(old.world_size):
            save(url, ptc, old, r, shards[r], step=1, storage_options=opts)
        save_s = time.perf_counter() - t0
        rows: dict[tuple[float, str], dict[str, list[dict]]] = {}
        for latency in args.latency_ms:
            for run in range(args.runs):
                for new in args.new:
                    cfg = layout(new)
                    for mode in MODES if run % 2 == 0 else MODES[::-1]:
                        results = [load_rank(url, cfg, r, opts, mode, latency / 1000) for r in range(cfg.world_size)]
                        rows.setdefault((latency, new), {}).setdefault(mode, []).append(
                            {"ranks": results, "wall_s": sum(x["wall_s"] for x in results)})
    finally:
        server.stop()
    return {"ptc": ptc, "rows": rows, "save_s": save_s, "load0": load0, "load1": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--old", default="dp=2,tp=2")
    ap.add_argument("--new", nargs="+", default=["tp=4", "tp=2,pp=2"])
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 10.0],
                    help="delays added to every data GET, one table each (0: moto on loopback as it is)")
    ap.add_argument("--json", action="store_true", help="write docs/bench/bench_remote.{md,json}")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "bench_remote"))
    args = ap.parse_args()
    import s3fs

    res = run_all(args)
    ptc, load0, load1 = res["ptc"], res["load0"], res["load1"]
    out: dict[str, Any] = {
        "model": {"nbytes": ptc.nbytes, "tensors": len(ptc)}, "old": args.old, "runs": args.runs,
        "save_s": res["save_s"], "loadavg_before": load0, "loadavg_after": load1,
        "host": {"python": platform.python_version(), "torch": torch.__version__, "s3fs": s3fs.__version__,
                 "cpus": os.cpu_count()},
        "results": [],
    }
    lines = [f"model {ptc.nbytes / 2**20:.1f} MiB ({len(ptc)} tensors) saved under {args.old} to moto S3 on "
             f"127.0.0.1, {args.runs} runs per mode; load average {load0[0]:.2f} before, {load1[0]:.2f} after", "",
             "| added GET latency | new layout | rank | mode | data GETs | read / needed | wall s (median, min-max) |",
             "|---|---|---|---|---|---|---|"]
    for (latency, new), modes in res["rows"].items():
        for mode, runs in modes.items():
            ranks = []
            for r in range(len(runs[0]["ranks"])):
                first = runs[0]["ranks"][r]
                walls = summarize([run["ranks"][r]["wall_s"] for run in runs])
                ranks.append({"gets": first["gets"], "bytes_read": first["bytes_read"],
                              "bytes_needed": first["bytes_needed"], "ratio": first["ratio"], "wall_s": walls})
                lines.append(f"| {latency:g} ms | {new} | {r} | {mode} | {first['gets']} | {first['ratio']:.4f} | "
                             f"{walls['median']:.3f} ({walls['min']:.3f}-{walls['max']:.3f}) |")
            total = summarize([run["wall_s"] for run in runs])
            gets = sum(x["gets"] for x in ranks)
            out["results"].append({"latency_ms": latency, "new": new, "mode": mode, "ranks": ranks,
                                   "gets_total": gets, "wall_s_all_ranks": total})
            lines.append(f"| {latency:g} ms | {new} | all | {mode} | {gets} | {max(x['ratio'] for x in ranks):.4f} "
                         f"(max) | {total['median']:.3f} ({total['min']:.3f}-{total['max']:.3f}) |")
    table = "\n".join(lines)
    print(table)
    if args.json:
        Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
        Path(args.out + ".md").write_text(
            "# Loads through an S3-protocol server\n\n"
            "`python scripts/bench_remote.py --json` (issue #17 item 5). `sequential`: "
            f"`{CONCURRENT_ENV}=0`, one ranged GET per piece, one after another (the old path); "
            "`concurrent`: the default for async filesystems, each file's pieces coalesced (overlapping "
            "checksum blocks fetched once, gaps of at most 64 KiB bridged while they total at most 0.5 % "
            "of the planned bytes, GETs of at most 32 MiB), 16 GETs in flight. Ranks load one after "
            "another, each with a fresh s3fs instance; data GETs are counted in s3fs and equal "
            "`LoadStats.ranges`; wall time includes listing, manifest, indexes and objects. An added "
            "latency delays every data GET in the client (`asyncio.sleep`), as a distant object store "
            "would; moto on loopback answers in about a millisecond.\n\n"
            + table + "\n")


if __name__ == "__main__":
    main()
