"""The host store under load: reused-connection latency, idle sockets, concurrent GETs, a stalled peer.

Starts ``tenplex store serve`` in a child process (token through TENPLEX_STORE_TOKEN) and
measures, from raw sockets and ``http.client``:

1. latency of small range GETs on one reused keep-alive connection (median, p90);
2. the store's threads while ``--idle`` sockets are connected and idle, and after its timeout;
3. the store's peak RSS (VmHWM) growth while ``--concurrent`` clients GET a ``--mib`` MiB file;
4. how long recovery takes to give up on a stalled peer (a store stopped with SIGSTOP after
   ``recovery_tiers`` found it alive) and load from persistent storage instead.

Run it against another checkout with PYTHONPATH to compare (docs/store.md has the figures):
``PYTHONPATH=. python scripts/bench_store.py``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tenplex.train.launch import free_port  # noqa: E402

TOKEN = "bench-token-0123456789"
STEP = "step-000000000001-0123abcd"


def _proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)



def _start(root: str, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TENPLEX_STORE_TOKEN": TOKEN}
    p = subprocess.Popen([sys.executable, "-m", "tenplex", "store", "serve", "--root", root, "--listen",
                          f"127.0.0.1:{port}", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                         text=True)
    if "serving" not in (p.stdout.readline() if p.stdout else ""):
        raise RuntimeError("store did not start")
    return p


def latency(port: int, n: int) -> dict[str, float]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        c.request("GET", f"/{STEP}/small.bin", headers={"Authorization": f"Bearer {TOKEN}",
                                                          "Range": f"bytes={i}-{i + 1023}"})
        r = c.getresponse()
        r.read()
        times.append(time.perf_counter() - t0)
    c.close()
    times.sort()
    return {"median_ms": statistics.median(times) * 1e3, "p90_ms": times[int(0.9 * len(times))] * 1e3}


def idle_sockets(pid: int, port: int, n: int, wait_after: float) -> dict[str, int]:
    before = _proc_status(pid, "Threads")
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    time.sleep(1.0)
    held = _proc_status(pid, "Threads")
    time.sleep(wait_after)
    later = _proc_status(pid, "Threads")
    for s in socks:
        s.close()
    return {"threads_before": before, "threads_with_idle": held, f"threads_after_{wait_after:.0f}s": later}


def concurrent_gets(pid: int, port: int, clients: int, size: int) -> dict[str, float]:
    hwm0 = _proc_status(pid, "VmHWM")
    errors: list[str] = []

    def get() -> None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("GET", f"/{STEP}/big.bin", headers={"Authorization": f"Bearer {TOKEN}",
                                                            "Range": f"bytes=0-{size - 1}"})
            r = c.getresponse()
            got = 0
            while chunk := r.read(1 << 20):
                got += len(chunk)
                time.sleep(0.002)  # a client slower than memory
            if got != size:
                errors.append(f"got {got} of {size}")
        except OSError as e:
            errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=get) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"rss_peak_before_mib": hwm0 / 1024, "rss_peak_after_mib": _proc_status(pid, "VmHWM") / 1024,
            "seconds": time.perf_counter() - t0, "errors": len(errors)}


def stalled_peer(work: Path, limit: float) -> dict[str, float | str]:
    """Store B holds rank 1's part; B is stopped (SIGSTOP) after recovery_tiers saw it alive."""
    import torch

    from tenplex import ParallelConfig, model_ptc, save
    from tenplex.store import HostStore, load_tiered, recovery_tiers

    ptc = model_ptc("tiny")
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s.shape, generator=g) for n, s in ptc.tensors.items()}
    full["optimizer.step"] = 1
    old, new = ParallelConfig(dp=2), ParallelConfig(tp=2)
    shards = ptc.shard(full, old)
    roots = [work / "a", work / "b"]
    ports = [free_port(), free_port()]
    persistent = str(work / "persistent")
    for r in range(2):
        save(str(roots[r]), ptc, old, r, shards[r], step=5, save_id="0000abcd")
        save(persistent, ptc, old, r, shards[r], step=5, save_id="0000abcd")
    procs = [_start(str(roots[i]), ports[i]) for i in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        local = HostStore(str(roots[0]), urls[0], TOKEN)
        tiers = recovery_tiers(local, urls, persistent, token=TOKEN)
        kinds = [t.kind for t in tiers]
        os.kill(procs[1].pid, signal.SIGSTOP)
        box: dict = {}

        def run() -> None:
            t0 = time.perf_counter()
            try:
                res = load_tiered(tiers, new, 0, ptc=ptc)
                box["bytes_by_kind"] = res.bytes_by_kind
            except Exception as e:  # noqa: BLE001 - reported
                box["error"] = repr(e)
            box["seconds"] = time.perf_counter() - t0

        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(limit)
        out: dict[str, float | str] = {"tiers": ",".join(kinds)}
        if th.is_alive():
            out["seconds"] = f"> {limit:.0f} (still waiting)"
        else:
            out.update({k: (v if isinstance(v, float) else json.dumps(v)) for k, v in box.items()})
        return out
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--idle", type=int, default=300)
    ap.add_argument("--idle-wait", type=float, default=35.0, help="seconds to wait with idle sockets held")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--stall-limit", type=float, default=60.0)
    ap.add_argument("--skip", default="", help="comma-separated: latency,idle,memory,stall")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    with tempfile.TemporaryDirectory() as work:
        root = Path(work) / "store"
        (root / STEP).mkdir(parents=True)
        (root / STEP / "small.bin").write_bytes(os.urandom(1 << 16))
        if "memory" not in skip:
            with open(root / STEP / "big.bin", "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(1 << 20))
        port = free_port()
        p = _start(str(root), port)
        out: dict = {}
        try:
            if "latency" not in skip:
                out["latency"] = latency(port, args.requests)
            if "idle" not in skip:
                out["idle"] = idle_sockets(p.pid, port, args.idle, args.idle_wait)
            if "memory" not in skip:
                out["memory"] = concurrent_gets(p.pid, port, args.concurrent, args.mib << 20)
        finally:
            p.kill()
            p.wait()
        if "stall" not in skip:
            out["stalled_peer"] = stalled_peer(Path(work), args.stall_limit)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
