"""Spawned gloo worlds for tests: start one process per rank, collect what each reports, always clean up.

Workers start from one forkserver per test session (``worker_context``) that imported torch,
torch.distributed (DTensor and DCP included) and tenplex once: a worker costs a fork instead of
2-6 s of imports (20 interpreters importing torch on 2 CPUs took about a minute of the suite).

A worker is ``target(*args, queue)``; it puts ``(key..., result)`` tuples on the queue, where
``result`` is a dict with an ``"error"`` entry (empty or None when it went well). The test gets
the results by key (``key`` alone for 2-tuples, else the tuple of keys), stops early at the first
error, and fails with the keys that did not report in time.
"""

from __future__ import annotations

import importlib
import multiprocessing.forkserver
import os
import pickle
import queue
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.reduction import DupFd
from pathlib import Path
from typing import Any

import pytest

from tenplex.train.launch import free_port  # a port on 127.0.0.1 nobody listens on: the launcher's

__all__ = ["free_port", "gloo_env", "reap", "run_spawned", "wait_procs", "log_tails", "worker_context", "here", "in_env",
           "Forked", "start_trainer", "rank_env", "script_workers"]

# imported once by the forkserver: what the workers of tests import (torch.distributed.tensor alone
# takes 3.5 s: dynamo, sympy); a module that cannot be imported is skipped by multiprocessing
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "tenplex",
           "tenplex.train.run", "tenplex.elastic.membership_runtime", "tenplex.elastic.migrate", "hypothesis", "pytest")


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


def worker_context() -> Any:
    """The multiprocessing context of test workers: a forkserver started once (under ``gloo_env``, so
    torch and OpenBLAS start no threads before the forks) that has imported ``PRELOAD``. Start a
    worker as ``ctx.Process(target=in_env, args=(*here(), target, *args))`` (``run_spawned`` does):
    a forked worker has the forkserver's environment and output, ``in_env`` gives it the caller's
    (the running test's captured stdout and stderr), as spawn would."""
    import torch.multiprocessing as mp  # lazy: the tensor reductions for queues, as the workers use them

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # only the first call's list counts: the server is started once
    with gloo_env():
        multiprocessing.forkserver.ensure_running()
    return ctx


class _Inherited:
    """A file descriptor of this process that a forkserver worker receives as it starts (pickled while
    the worker starts: multiprocessing's ``DupFd`` passes it along with the worker's own pipes)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _same, (DupFd(self.fd),)


def _same(x: Any) -> Any:
    return x


def here() -> tuple[dict[str, str], tuple[_Inherited, _Inherited]]:
    """This process's environment and stdout / stderr, for ``in_env`` (call it where a worker is started)."""
    return dict(os.environ), (_Inherited(1), _Inherited(2))


def in_env(env: dict[str, str], fds: tuple[Any, Any], target: Callable[..., None], *args: Any) -> None:
    """Run ``target(*args)`` in a forked worker under the environment and output of ``here()``."""
    os.environ.clear()
    os.environ.update(env)
    for fd, to in zip(fds, (1, 2)):
        os.dup2(fd.detach(), to)
    target(*args)


class Forked:
    """A worker of ``worker_context`` behind the part of ``subprocess.Popen`` that tests use (``pid``,
    ``poll``, ``wait``, ``kill``): ``wait_procs`` takes both."""

    def __init__(self, proc: Any, log: Path | None = None) -> None:
        self.proc, self.log = proc, log

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked worker {self.proc.pid}", timeout or 0)
        return int(self.proc.exitcode)

    def kill(self) -> None:
        self.proc.kill()


def start_trainer(argv: Sequence[str], log: Path, env: dict[str, str], *, fsize_limit: int | None = None,
                  main: str = "tenplex.train.run:main") -> Forked:
    """``python -m tenplex.train ARGV`` under ``env``, its output to ``log`` (``Forked.log``), as a worker
    of ``worker_context``: the trainer's ``main`` in a fork of a process that imported it (a worker
    starts in milliseconds, not after 2-3 s of imports); exit codes as the command's.
    ``fsize_limit``: its files cannot grow past that many bytes (a quota, a full disk: writes past it
    fail with EFBIG; Python ignores SIGXFSZ). ``main``: another ``module:function`` taking ``argv``
    (e.g. ``tenplex.train.bubble_bench:main``)."""
    Path(log).write_bytes(b"")  # there once this returns, as with Popen(stdout=log.open("w"))
    proc = worker_context().Process(target=_train, args=(main, list(argv), str(log), dict(env), fsize_limit))
    proc.start()
    return Forked(proc, Path(log))


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun gives worker ``rank`` of a one-host world of ``world`` (env:// on ``port``)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def script_workers(script: str, tmp: Path, n: int, args: Sequence[str], store_port: int | None,
                   name: str = "worker") -> list[subprocess.Popen]:
    """``n`` workers of ``script`` (an example under examples/) on env:// as torchrun would start them, their
    membership store the TCPStore at ``store_port`` (None: none, the job only checkpoints and resumes);
    their output to ``tmp/{name}{rank}.log``."""
    root = str(Path(__file__).resolve().parent.parent)
    port, procs = free_port(), []
    with gloo_env():
        for r in range(n):
            env = {k: v for k, v in os.environ.items() if k != "TENPLEX_MEMBERSHIP_STORE"}
            env.update(rank_env(r, n, port), PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
            if store_port is not None:
                env["TENPLEX_MEMBERSHIP_STORE"] = f"127.0.0.1:{store_port}"
            procs.append(subprocess.Popen([sys.executable, script, *args], env=env,
                                          stdout=(tmp / f"{name}{r}.log").open("w"), stderr=subprocess.STDOUT))
    return procs


def _train(main: str, argv: list[str], log: str, env: dict[str, str], fsize_limit: int | None) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    for to in (1, 2):
        os.dup2(fd, to)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if fsize_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
    module, function = main.split(":")
    sys.exit(getattr(importlib.import_module(module), function)(argv))


def reap(procs: Sequence[Any], timeout: float = 10) -> None:
    """Join every process, killing those still alive after ``timeout`` seconds."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class ValueQueue:
    """A queue whose items travel pickled by value (plain ``pickle``): torch's multiprocessing pickler
    sends a tensor's storage as a file descriptor the receiver fetches from the sender, which failed
    (FileNotFoundError in resource_sharer) whenever the worker had exited before the parent read it."""

    def __init__(self, q: Any) -> None:
        self.q = q

    def put(self, item: Any) -> None:
        self.q.put(pickle.dumps(item))

    def get(self, timeout: float | None = None) -> Any:
        return pickle.loads(self.q.get(timeout=timeout))


def run_spawned(target: Callable[..., None], args: Sequence[tuple], *, expect: int, timeout: float) -> dict[Any, dict]:
    """Run ``target(*a, queue)`` for every ``a`` in ``args`` in worker processes (``worker_context``,
    ``gloo_env``) until ``expect`` results arrived, one reported an error, or ``timeout`` seconds passed."""
    ctx = worker_context()
    q = ValueQueue(ctx.Queue())
    results: dict[Any, dict] = {}
    with gloo_env():
        procs = [ctx.Process(target=in_env, args=(*here(), target, *a, q)) for a in args]
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
