"""A replicated membership store for simulated hosts: an etcd cluster, one member per host (issue 31
item 3).

:class:`EtcdCluster` starts ``n`` ``etcd`` processes (Debian's ``etcd-server``; ``make setup``
installs it) that form one Raft cluster: member ``i`` on host ``i``'s address (loopback ports, or
host ``i``'s network namespace with ``nets``), waits until every member reports healthy, and kills
them and removes their data on exit. Raft timings follow etcd's tuning rule for a round trip of
microseconds (heartbeat 10 ms, election time-out 10x that, 100 ms; etcd's defaults, 100 / 1000 ms,
are for data-centre links and disks), with pre-vote. After the leader's SIGKILL a new one is
elected after 0.110 s [0.033, 0.166] (15 / 150 ms: 0.174 s [0.136, 0.237]), and a client that
wrote at the kill, on a follower, writes again after 0.135 s [0.061, 0.190] (its request hung on the
dead leader is retried after 0.05 s; 15 / 150 ms: 0.189 s [0.151, 0.237]). ``scripts/bench_etcd.py
--raft 10/100,15/150 --trials 7 --burn 8 --idle-s 30``: 7 trials each beside 8 CPU burners on 2
cores, median [min, max]. Beside them no election happened in 30 s that no death caused (pre-vote:
a starved member that missed heartbeats asks first, and the others, who hear the leader, say no); a
spurious one would stall writes for one election, which the store's retries ride out. A job's
agreement writes once its survivors left their step, 0.12-0.2 s after the death. The price: an
idle cluster of 3 uses about 17% of a core against 9-12% at 15 / 150 ms.
Workers reach it through :class:`~tenplex.elastic.etcd_store.EtcdStore` (``TENPLEX_MEMBERSHIP_STORE``
= :attr:`EtcdCluster.spec`, ``etcd://host:port,...``), their own host's member first.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..elastic.etcd_store import ETCD_SCHEME, EtcdTLS
from ..errors import ConfigError
from .netns import LOOPBACK, HostNet, free_port

__all__ = ["EtcdCluster", "EtcdMember", "etcd_binary"]

log = logging.getLogger(__name__)

HEARTBEAT_MS = 10
ELECTION_MS = 100


def etcd_binary() -> str | None:
    """The ``etcd`` server on PATH (or ``$TENPLEX_ETCD``), None when it is not installed."""
    return os.environ.get("TENPLEX_ETCD") or shutil.which("etcd")


# one HTTP request from inside a host's namespace (the root namespace has no route to it); with TLS
# files (CA, certificate, key) after the timeout, over https with them
_FETCH = ("import json, ssl, sys, urllib.request as u\n"
          "d = None if sys.argv[2] == '-' else sys.argv[2].encode()\n"
          "r = u.Request(sys.argv[1], d, {'Content-Type': 'application/json'})\n"
          "c = None\n"
          "if len(sys.argv) > 4:\n"
          "    c = ssl.create_default_context(cafile=sys.argv[4])\n"
          "    c.load_cert_chain(sys.argv[5], sys.argv[6])\n"
          "sys.stdout.write(u.urlopen(r, timeout=float(sys.argv[3]), context=c).read().decode())\n")


def _call(net: HostNet, url: str, payload: dict[str, Any] | None, timeout: float,
          tls: EtcdTLS | None = None) -> dict[str, Any]:
    """GET (``payload`` None) or POST ``url`` as a process of host ``net`` would (with ``tls``'s CA,
    certificate and key for an https URL); its JSON answer. OSError when it does not answer within ``timeout``."""
    if not net.netns:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        ctx = tls.client_context() if tls is not None else None
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:  # noqa: S310 - a URL we built
            return json.loads(r.read())
    arg = "-" if payload is None else json.dumps(payload)
    files = [tls.ca, tls.cert, tls.key] if tls is not None else []
    try:
        res = subprocess.run(net.command([sys.executable, "-c", _FETCH, url, arg, str(timeout), *files]),
                             capture_output=True, text=True, timeout=timeout + 10)
    except subprocess.TimeoutExpired as e:
        raise OSError(f"{url}: no answer within {timeout} s") from e
    if res.returncode != 0:
        raise OSError(f"{url}: {res.stderr.strip()[-300:]}")
    return json.loads(res.stdout)


class EtcdMember:
    """One ``etcd`` process: ``name`` in a cluster of ``initial_cluster`` (``name=peer-url,...``). With
    ``tls`` its client and peer URLs are https, served with ``tls``'s certificate, and it accepts only
    clients and peers whose certificates ``tls``'s CA signed (``--client-cert-auth``)."""

    def __init__(self, name: str, data_dir: Path, client_port: int, peer_port: int, initial_cluster: str,
                 token: str, *, net: HostNet = LOOPBACK, binary: str = "etcd", v2: bool = False,
                 tls: EtcdTLS | None = None, raft_ms: tuple[int, int] = (HEARTBEAT_MS, ELECTION_MS)) -> None:
        self.name, self.data_dir, self.net, self.tls = name, data_dir, net, tls
        scheme = "https" if tls is not None else "http"
        self.client_url = f"{scheme}://{net.address}:{client_port}"
        self.peer_url = f"{scheme}://{net.address}:{peer_port}"
        secure = [] if tls is None else [
            "--cert-file", tls.cert, "--key-file", tls.key, "--trusted-ca-file", tls.ca, "--client-cert-auth",
            "--peer-cert-file", tls.cert, "--peer-key-file", tls.key, "--peer-trusted-ca-file", tls.ca,
            "--peer-client-cert-auth"]
        cmd = [binary, "--name", name, "--data-dir", str(data_dir),
               "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
               "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
               "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
               "--initial-cluster-token", token, "--heartbeat-interval", str(raft_ms[0]),
               "--election-timeout", str(raft_ms[1]), "--logger", "zap", "--log-level", "warn",
               # a member that missed heartbeats (starved on a loaded host) asks first whether it could
               # win: while the leader lives the others say no, and no spurious election stalls writes
               "--pre-vote",
               # every heartbeat is a write: without compaction the history grows by ~100 revisions a
               # second until etcd's space quota stops all writes; keep the last 5 minutes
               "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
               *(["--enable-v2=true"] if v2 else []), *secure]
        self.log_path = data_dir.parent / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill
        self.proc = subprocess.Popen(net.command(cmd), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether this member answers and sees a leader (etcd's ``/health``)."""
        try:
            return self.call("/health", None, timeout).get("health") == "true"
        except (OSError, ValueError):
            return False

    def call(self, path: str, payload: dict[str, Any] | None, timeout: float = 5.0) -> dict[str, Any]:
        """GET (``payload`` None) or POST ``path`` of this member's client URL, from its own host."""
        return _call(self.net, self.client_url + path, payload, timeout, self.tls)

    def status(self, timeout: float = 1.0) -> dict[str, Any]:
        """etcd's maintenance status of this member (``header.member_id``, ``leader``: ids as strings)."""
        return self.call("/v3/maintenance/status", {}, timeout)

    def kill(self) -> None:
        """A host failure: SIGKILL, no goodbye to the cluster."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


class EtcdCluster:
    """``n`` etcd members forming one cluster, member ``i`` on ``nets[i]`` (default loopback); a
    context manager that kills them and removes ``work`` (default a fresh directory under /dev/shm,
    where etcd's fsyncs cost nothing) on exit. Raises ConfigError when etcd is not installed and
    RuntimeError when the cluster is not healthy within ``start_timeout`` seconds. ``v2``: also serve
    etcd's v2 API, which torchrun's ``--rdzv-backend=etcd-v2`` (through ``python-etcd``) needs. ``tls``:
    every member serves https with its certificate (one that names every member's address) and takes
    only clients and peers whose certificates its CA signed (:class:`EtcdMember`). ``raft_ms``: the
    members' heartbeat interval and election time-out in ms (the module docstring)."""

    def __init__(self, n: int = 3, *, nets: Sequence[HostNet] | None = None, work: str | Path | None = None,
                 start_timeout: float = 30.0, v2: bool = False, tls: EtcdTLS | None = None,
                 raft_ms: tuple[int, int] = (HEARTBEAT_MS, ELECTION_MS)) -> None:
        binary = etcd_binary()
        if binary is None:
            raise ConfigError("etcd is not installed: install Debian's etcd-server (make setup does, as root) "
                              "or set TENPLEX_ETCD to the etcd binary")
        if n < 1:
            raise ConfigError(f"an etcd cluster needs n >= 1 members, got {n}")
        if not 0 < 5 * raft_ms[0] <= raft_ms[1]:
            raise ConfigError(f"raft_ms (heartbeat, election) = {raft_ms}: etcd needs 0 < heartbeat and an election "
                              f"time-out of at least 5 heartbeats ({5 * raft_ms[0]} ms)")
        nets = list(nets) if nets is not None else [LOOPBACK] * n
        if len(nets) != n:
            raise ConfigError(f"{n} etcd members need {n} host networks, got {len(nets)}")
        base = "/dev/shm" if work is None and os.path.isdir("/dev/shm") else None
        self._own_work = work is None
        self.work = Path(tempfile.mkdtemp(prefix="tenplex-etcd-", dir=base) if work is None else work)
        token = f"tenplex-{secrets.token_hex(6)}"  # members of another cluster never join this one
        free: list[int] = []
        while len(free) < 2 * n:  # free_port may hand out a port twice: two members on one port, one dies
            if (p := free_port()) not in free:
                free.append(p)
        ports = list(zip(free[0::2], free[1::2]))
        scheme = "https" if tls is not None else "http"
        initial = ",".join(f"e{i}={scheme}://{net.address}:{pp}" for i, (net, (_, pp)) in enumerate(zip(nets, ports)))
        self.members: list[EtcdMember] = []
        try:
            for i, (net, (cp, pp)) in enumerate(zip(nets, ports)):
                d = self.work / f"e{i}"
                d.mkdir(parents=True, exist_ok=True)
                self.members.append(EtcdMember(f"e{i}", d / "data", cp, pp, initial, token, net=net, binary=binary,
                                               v2=v2, tls=tls, raft_ms=raft_ms))
            self.wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise
        log.info("etcd cluster of %d up: %s", n, self.spec)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.client_url for m in self.members)

    def spec_for(self, first: int = 0) -> str:
        """``etcd://host:port,...`` with member ``first`` (the caller's own host's) first."""
        order = self.members[first:] + self.members[:first]
        return ETCD_SCHEME + ",".join(m.client_url.split("://", 1)[1] for m in order)

    @property
    def spec(self) -> str:
        return self.spec_for(0)

    def wait_healthy(self, timeout: float, members: Sequence[int] | None = None) -> None:
        """Until every member of ``members`` (default: those alive) reports healthy (it sees a leader)."""
        deadline = time.monotonic() + timeout
        idx = [i for i, m in enumerate(self.members) if m.alive()] if members is None else list(members)
        while True:
            dead = [self.members[i].name for i in idx if not self.members[i].alive()]
            if dead:
                tails = {self.members[i].name: self.members[i].log_path.read_text()[-600:] for i in idx
                         if not self.members[i].alive()}
                raise RuntimeError(f"etcd members {dead} exited: {tails}")
            if all(self.members[i].healthy() for i in idx):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd cluster was not healthy within {timeout} s; logs under {self.work}")
            time.sleep(0.05)

    def leader(self) -> int:
        """The index of the member that leads the cluster now."""
        for m in self.members:
            if not m.alive():
                continue
            try:
                lead = m.status()["leader"]
            except (OSError, ValueError, KeyError):
                continue
            for i, other in enumerate(self.members):
                if other.alive() and other.status()["header"]["member_id"] == lead:
                    return i
        raise RuntimeError("no etcd member knows a leader")

    def move_leader(self, to: int, timeout: float = 10.0) -> None:
        """Hand the leadership to member ``to`` (etcd's MoveLeader, asked of the current leader), so a
        test can kill the leader on purpose."""
        deadline = time.monotonic() + timeout
        while (cur := self.leader()) != to:
            target = self.members[to].status()["header"]["member_id"]
            try:
                self.members[cur].call("/v3/maintenance/transfer-leadership", {"targetID": target})
            except (OSError, ValueError) as e:
                log.info("moving the etcd leader to e%d: %s", to, e)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd leadership did not move to e{to} within {timeout} s")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (its host failed)."""
        self.members[i].kill()

    def stop(self) -> None:
        for m in self.members:
            m.kill()
        if self._own_work:
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

