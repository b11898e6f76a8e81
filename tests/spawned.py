"""Spawned gloo worlds for tests: start one process per rank, collect what each reports, always clean up.

A worker is ``target(*args, queue)``; it puts ``(key..., result)`` tuples on the queue, where
``result`` is a dict with an ``"error"`` entry (empty or None when it went well). The test gets
the results by key (``key`` alone for 2-tuples, else the tuple of keys), stops early at the first
error, and fails with the keys that did not report in time.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from contextlib import contextmanager
from typing import Any

import pytest

__all__ = ["free_port", "gloo_env", "reap", "run_spawned", "wait_procs", "log_tails"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gloo_env() -> Iterator[None]:
    """One torch thread per process and gloo on loopback for processes spawned inside; the caller's
    environment is restored afterwards."""
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def reap(procs: Sequence[Any], timeout: float = 10) -> None:
    """Join every process, killing those still alive after ``timeout`` seconds."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_spawned(target: Callable[..., None], args: Sequence[tuple], *, expect: int, timeout: float) -> dict[Any, dict]:
    """Run ``target(*a, queue)`` for every ``a`` in ``args`` in spawned processes (``gloo_env``) until
    ``expect`` results arrived, one reported an error, or ``timeout`` seconds passed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, q)) for a in args]
    results: dict[Any, dict] = {}
    with gloo_env():
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while len(results) < expect:
                try:
                    item = q.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    pytest.fail(f"only {sorted(results, key=str)} of {expect} results reported within {timeout:.0f}s")
                key = item[0] if len(item) == 2 else tuple(item[:-1])
                results[key] = item[-1]
                if item[-1].get("error"):
                    break
            return results
        finally:
            reap(procs)


def wait_procs(procs: Sequence[Any], timeout: float) -> list[int | None]:
    """Wait up to ``timeout`` seconds in all for ``subprocess.Popen`` s to exit; their exit codes (None:
    still running, then killed)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # killed below
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    return codes


def log_tails(tmp: Path, pattern: str = "worker*.log") -> str:
    """The last 3000 characters of every log under ``tmp`` matching ``pattern``, for a failing assert."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob(pattern)))
