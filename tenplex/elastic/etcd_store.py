"""A c10d ``Store`` over a replicated etcd cluster (issue 31 item 3): the membership and rendezvous
store with no single point of failure.

The job's ``TCPStore`` is one process: the host running it takes the job down. etcd keeps every key
on a majority of its members (Raft), so with three members, one per host, any one host can die.
:class:`EtcdStore` speaks etcd's v3 JSON API (the gRPC gateway every ``etcd`` 3.4+ serves on its
client URL; no client library) and implements the c10d operations tenplex uses: ``set``, ``get``,
``add``, ``append``, ``compare_set``, ``check``, ``wait``, ``multi_get``, ``multi_set``,
``delete_key``, ``num_keys``, ``clone``; and ``peek`` (values or None in one request: the
membership's polls). It subclasses ``torch.distributed.Store``, so ``PrefixStore`` and
``init_process_group(store=...)`` (gloo's rendezvous) take it as they take a ``TCPStore``.

Fail-over: the client talks to one endpoint (the first given: put the co-located member first) and
moves to the next on a refused connection, a request that takes too long (a member cut off, or a
proposal forwarded to a leader that just died) or a 5xx answer, cycling through all of them until
the operation's deadline (the store's ``timeout``). Every request asks for a leader (etcd's
``hasleader`` metadata): a member that knows the cluster has none answers "no leader" at once
instead of holding the request. A request may take 0.05 s, twice as long once every member had its
try at that wait, up to ``request_timeout``: a write that hung on a dead leader is retried within
about 0.05 s of the election, where a fixed 0.5 s wait cost the job's recovery a second when its
host's member was the leader. A member that answers "no leader" is a candidate of the election,
the first to know its winner: it is asked again after 20 ms (up to 3 times, then the next: a
member cut off from the majority says it for good), where the next member, still holding the dead
leader, would hang the request. Healthy answers take far less: beside 8 CPU burners on 2 cores a
write's p99 7.6-9.3 ms, a read's worst 13.4 ms, no time-out in 600 requests
(``scripts/bench_etcd.py --burn 8``, ``request_ms``). Reads are linearizable (etcd's default): a
value read from any member is the latest the majority agreed on.

TLS (:class:`EtcdTLS`): with a CA, a certificate and its key the client speaks ``https`` to every
endpoint, checks each member's certificate against the CA (and its address against the
certificate's) and presents its own; members started with ``--client-cert-auth`` (``EtcdCluster(tls=...)``)
refuse every client whose certificate the CA did not sign, so a process without the job's
certificates can neither read nor write membership. :func:`membership_store` takes the files from
``TENPLEX_ETCD_CA_FILE``, ``TENPLEX_ETCD_CERT_FILE``, ``TENPLEX_ETCD_KEY_FILE`` (:meth:`EtcdTLS.from_env`).

Atomicity: ``add`` and ``append`` are read-modify-write loops closed by a transaction comparing the
key's ``mod_revision`` (no lost update between concurrent writers). A transaction whose answer was
lost (the endpoint died, or answered slower than ``request_timeout``, after committing it) is
retried on another member; it then applies once, not twice: the same transaction records the
operation's sequence number and result under a key of this client, and the retry finds it.
``compare_set`` retried reads its own value back and returns it, as the first try would have.
"""

from __future__ import annotations

import base64
import datetime
import http.client
import json
import logging
import os
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist

from ..errors import ConfigError, EtcdStoreError, StoreInterrupted

__all__ = ["EtcdStore", "EtcdTLS", "ETCD_SCHEME", "parse_etcd_spec", "TLS_ENV"]

log = logging.getLogger(__name__)

ETCD_SCHEME = "etcd://"
_FIRST_TRY_S = 0.05  # a request may take this long until every member had its try; then twice as long, and so on
_AGAIN_S = 0.02  # every endpoint failed once (no leader yet): pause before the next cycle
_STAY = 3  # "no leader" answers in a row from one member before the next is asked (a minority member keeps saying it)
# gRPC metadata through etcd's gateway: fail at once ("no leader", 503) where the member knows of no leader
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
_POLL_S = 0.01  # wait / get on a missing key: how often to look again
_OPS = "\x00tenplex-etcdstore-ops/"  # each client's op record: outside every namespace's key range


#: The environment variables naming :class:`EtcdTLS`'s files (CA, certificate, key), in its field order.
TLS_ENV = ("TENPLEX_ETCD_CA_FILE", "TENPLEX_ETCD_CERT_FILE", "TENPLEX_ETCD_KEY_FILE")


@dataclass(frozen=True)
class EtcdTLS:
    """PEM files for TLS with etcd: ``ca`` the certificate authority that signs every member's and
    client's certificate, ``cert`` / ``key`` this party's certificate and private key (a member's
    serve its client and peer URLs; a client's prove it belongs to the job)."""

    ca: str
    cert: str
    key: str

    def __post_init__(self) -> None:
        missing = [f"{name}={path!r}" for name, path in (("ca", self.ca), ("cert", self.cert), ("key", self.key))
                   if not path or not os.path.isfile(path)]
        if missing:
            raise ConfigError(f"etcd TLS needs a CA, a certificate and a key (PEM files); not found: {missing}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdTLS | None:
        """The files ``TLS_ENV`` name, None when none is set; ConfigError when only some are."""
        env = os.environ if env is None else env
        paths = [env.get(k, "") for k in TLS_ENV]
        if not any(paths):
            return None
        if not all(paths):
            raise ConfigError(f"etcd TLS needs all of {', '.join(TLS_ENV)}; set: "
                              f"{[k for k, p in zip(TLS_ENV, paths) if p]}")
        return cls(*paths)

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a worker (:meth:`from_env`)."""
        return dict(zip(TLS_ENV, (self.ca, self.cert, self.key)))

    def client_context(self) -> ssl.SSLContext:
        """Verify the member against ``ca`` (its address against its certificate), present ``cert``."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def parse_etcd_spec(spec: str) -> tuple[str, ...]:
    """``etcd://host:port,host:port,...`` -> the client URLs ``http://host:port`` (at least one)."""
    if not spec.startswith(ETCD_SCHEME):
        raise ConfigError(f"an etcd store is named {ETCD_SCHEME}host:port[,host:port...], got {spec!r}")
    urls = []
    for part in spec[len(ETCD_SCHEME):].split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"etcd endpoint {part!r} of {spec!r} is not host:port")
        urls.append(f"http://{host}:{port}")
    return tuple(urls)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _bytes(value: Any) -> bytes:
    """A c10d value (str, bytes, or a list of ints from a C++ caller) as bytes."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class _Retry(Exception):
    """This endpoint failed in a way the next one may not (connection, timeout, 5xx); ``timed_out``:
    it did not answer in time (the next attempt may take longer); ``no_leader``: it is in an
    election (a candidate: it learns the winner first, or wins)."""

    def __init__(self, message: str, *, timed_out: bool = False, no_leader: bool = False) -> None:
        super().__init__(message)
        self.timed_out, self.no_leader = timed_out, no_leader


class EtcdStore(dist.Store):
    """A c10d store over the etcd cluster at ``endpoints`` (client URLs ``http://host:port``; the
    co-located member first), keys under ``namespace``. ``timeout``: the deadline of one operation,
    fail-overs and waits for missing keys included; ``request_timeout``: how long one HTTP request
    may take before the client moves to the next endpoint. Thread-safe (one lock per instance);
    :meth:`clone` gives another connection for another thread. ``interrupt``: when set, asked between
    a call's tries; True gives the call up (StoreInterrupted): a caller that no longer needs the answer
    does not wait out an election."""

    def __init__(self, endpoints: Sequence[str], *, namespace: str = "tenplex/",
                 timeout: datetime.timedelta = datetime.timedelta(seconds=30), request_timeout: float = 0.5,
                 tls: EtcdTLS | None = None) -> None:
        super().__init__()
        if not endpoints:
            raise ConfigError("an EtcdStore needs at least one endpoint (http://host:port)")
        if request_timeout <= 0:
            raise ConfigError(f"request_timeout must be > 0 s, got {request_timeout}")
        self.tls = tls
        self._ssl = tls.client_context() if tls is not None else None
        # with TLS every endpoint is https (an http:// one given is the same member's address)
        self.endpoints = tuple(endpoints) if tls is None else tuple(
            "https://" + e.split("://", 1)[-1] for e in endpoints)
        self.namespace = namespace
        self.request_timeout = request_timeout
        self.set_timeout(timeout)
        self.host = urlsplit(self.endpoints[0]).hostname  # where peers' links look for this host's interface
        self._current = 0
        self._conns: dict[int, http.client.HTTPConnection] = {}
        self._lock = threading.RLock()
        self._op_key = _b64(f"{_OPS}{uuid.uuid4().hex}")  # this client's last add / append (outside namespace)
        self._seq = 0
        self.failovers = 0  # how often a request moved to another endpoint (for tests and logs)
        self.interrupt: Callable[[], bool] | None = None

    @classmethod
    def from_spec(cls, spec: str, **kwargs: Any) -> EtcdStore:
        """The store named ``etcd://host:port,...`` (:func:`parse_etcd_spec`)."""
        return cls(parse_etcd_spec(spec), **kwargs)

    # -- transport -----------------------------------------------------------------------------
    def _deadline(self) -> float:
        return time.monotonic() + self.timeout.total_seconds()

    def _post_once(self, i: int, path: str, body: bytes, timeout: float) -> dict[str, Any]:
        conn = self._conns.get(i)
        if conn is None:
            u = urlsplit(self.endpoints[i])
            if u.scheme == "https":
                conn = http.client.HTTPSConnection(u.hostname, u.port, timeout=timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
            self._conns[i] = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            conn.request("POST", path, body, _HEADERS)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, closed mid-answer
            conn.close()
            del self._conns[i]
            raise _Retry(f"{self.endpoints[i]}: {type(e).__name__}: {e}", timed_out=isinstance(e, TimeoutError)) from e
        if resp.status >= 500:  # no leader, request timed out, member stopping: another member may answer
            raise _Retry(f"{self.endpoints[i]}: HTTP {resp.status}: {data[:200]!r}", no_leader=b"no leader" in data)
        if resp.status != 200:
            raise EtcdStoreError(f"etcd {self.endpoints[i]}{path} refused the request: HTTP {resp.status}: "
                                 f"{data[:300]!r}")
        return json.loads(data)

    def _post(self, path: str, payload: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """POST ``payload`` to the current endpoint, failing over to the others until ``deadline``."""
        body = json.dumps(payload).encode()
        deadline = self._deadline() if deadline is None else deadline
        errors: list[str] = []
        n = len(self.endpoints)
        timeouts = 0  # of this operation's requests
        waited = 0  # "no leader" answers in a row from the current endpoint
        with self._lock:
            while True:
                for _ in range(n):
                    i = self._current
                    # a member that hung is left for the next; the wait doubles once each had its try
                    wait = min(self.request_timeout, _FIRST_TRY_S * 2 ** (timeouts // max(2, n)))
                    try:
                        return self._post_once(i, path, body, wait)
                    except _Retry as e:
                        if self.interrupt is not None and self.interrupt():
                            raise StoreInterrupted(f"{path} given up after {e}: its caller no longer needs it") from e
                        timeouts += e.timed_out
                        errors = [*errors, str(e)][-n:]  # the last cycle's
                        waited = waited + 1 if e.no_leader else 0
                        if 0 < waited <= _STAY:  # an election: this candidate learns the winner first (a
                            break  # follower still holding the dead leader would hang the request)
                        waited = 0
                        self._current = (i + 1) % n
                        self.failovers += 1
                        log.info("etcd store: %s; trying %s", e, self.endpoints[self._current])
                    if time.monotonic() > deadline:
                        break
                if time.monotonic() > deadline:
                    raise EtcdStoreError(f"no etcd endpoint of {list(self.endpoints)} answered {path} within "
                                         f"{self.timeout.total_seconds():.1f} s (a majority down?): {errors}")
                time.sleep(_AGAIN_S)  # every endpoint failed once, or one is electing: elections take ~0.1 s

    def _k(self, key: str) -> str:
        return _b64(self.namespace + key)

    def _range(self, keys: Sequence[str], *, keys_only: bool = False,
               deadline: float | None = None) -> list[tuple[bytes, int] | None]:
        """(value, mod_revision) of each key, None where missing: one read-only transaction."""
        ops = [{"request_range": {"key": self._k(k), **({"keys_only": True} if keys_only else {})}} for k in keys]
        resp = self._post("/v3/kv/txn", {"success": ops}, deadline)
        out: list[tuple[bytes, int] | None] = []
        for r in resp.get("responses", []):
            kvs = r.get("response_range", {}).get("kvs", [])
            out.append((_unb64(kvs[0].get("value")), int(kvs[0].get("mod_revision", 0))) if kvs else None)
        if len(out) != len(keys):
            raise EtcdStoreError(f"etcd answered {len(out)} ranges for {len(keys)} keys: {resp}")
        return out

    def _update(self, key: str, change: Any) -> bytes:
        """Set ``key`` to ``change(old value or None)`` atomically (compare the revision read); the new value.

        The same transaction records ``{seq}:{new}`` under this client's op key: a retry whose first
        try committed (its answer lost with the endpoint) finds its own record and returns that value
        instead of applying the change twice."""
        deadline = self._deadline()
        self._seq += 1
        mark = f"{self._seq}:".encode()
        got = self._range([key], deadline=deadline)[0]
        while True:
            old, rev = got if got is not None else (None, 0)
            new = change(old)
            resp = self._post("/v3/kv/txn", {
                "compare": [{"key": self._k(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(rev)}],
                "success": [{"request_put": {"key": self._k(key), "value": _b64(new)}},
                            {"request_put": {"key": self._op_key, "value": _b64(mark + new)}}],
                "failure": [{"request_range": {"key": self._k(key)}}, {"request_range": {"key": self._op_key}}]},
                deadline)
            if resp.get("succeeded"):
                return new
            ours = resp["responses"][1].get("response_range", {}).get("kvs", [])
            if ours and _unb64(ours[0].get("value")).startswith(mark):  # an earlier try of this op committed
                return _unb64(ours[0].get("value"))[len(mark):]
            kvs = resp["responses"][0].get("response_range", {}).get("kvs", [])
            got = (_unb64(kvs[0].get("value")), int(kvs[0].get("mod_revision", 0))) if kvs else None

    def _wait_for(self, keys: Sequence[str], timeout: datetime.timedelta | None, what: str) -> list[bytes]:
        """The values of ``keys`` once all exist; EtcdStoreError after ``timeout`` (default the store's)."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            got = self._range(keys, deadline=max(deadline, time.monotonic() + self.request_timeout))
            if all(g is not None for g in got):
                return [g[0] for g in got if g is not None]
            if time.monotonic() > deadline:
                missing = [k for k, g in zip(keys, got) if g is None]
                raise EtcdStoreError(f"{what}: keys {missing} did not appear within {limit:.1f} s")
            time.sleep(_POLL_S)

    # -- the c10d Store operations -------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._post("/v3/kv/put", {"key": self._k(key), "value": _b64(_bytes(value))})

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None, "get")[0]

    def add(self, key: str, value: int) -> int:
        if int(value) == 0:  # a read (Membership polls counters with add(k, 0)): no write unless the key is new
            got = self._range([key])[0]
            if got is not None:
                return int(got[0] or b"0")
        return int(self._update(key, lambda old: str(int(old or b"0") + int(value)).encode()))

    def append(self, key: str, value: Any) -> None:
        self._update(key, lambda old: (old or b"") + _bytes(value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """c10d's rule: a missing key is set when ``expected`` is empty; a key holding ``expected`` is
        set; either way ``desired`` is returned. Otherwise the current value (``expected`` for a
        missing key)."""
        exp, want = _bytes(expected), _bytes(desired)
        cmp = ({"target": "CREATE", "create_revision": "0"} if not exp else {"target": "VALUE", "value": _b64(exp)})
        resp = self._post("/v3/kv/txn", {
            "compare": [{"key": self._k(key), "result": "EQUAL", **cmp}],
            "success": [{"request_put": {"key": self._k(key), "value": _b64(want)}}],
            "failure": [{"request_range": {"key": self._k(key)}}]})
        if resp.get("succeeded"):
            return want
        kvs = resp["responses"][0].get("response_range", {}).get("kvs", [])
        return _unb64(kvs[0].get("value")) if kvs else exp

    def check(self, keys: list[str]) -> bool:
        return all(g is not None for g in self._range(keys, keys_only=True))

    def peek(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys``, None where missing, at once (no wait): one read, where c10d's
        ``check`` and ``get`` take a request each."""
        return [g[0] if g is not None else None for g in self._range(keys)]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(keys, timeout, "wait")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_for(keys, None, "multi_get")

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        ops = [{"request_put": {"key": self._k(k), "value": _b64(_bytes(v))}} for k, v in zip(keys, values)]
        self._post("/v3/kv/txn", {"success": ops})

    def delete_key(self, key: str) -> bool:
        return int(self._post("/v3/kv/deleterange", {"key": self._k(key)}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        start = self.namespace.encode()
        end = start[:-1] + bytes([start[-1] + 1]) if start else b"\0"
        resp = self._post("/v3/kv/range", {"key": _b64(start), "range_end": _b64(end), "count_only": True})
        return int(resp.get("count", 0))

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set

    def clone(self) -> EtcdStore:
        """Another client of the same cluster and namespace (its own connections), current endpoint first."""
        order = self.endpoints[self._current:] + self.endpoints[:self._current]
        return EtcdStore(order, namespace=self.namespace, timeout=self.timeout, request_timeout=self.request_timeout,
                         tls=self.tls)

    def close(self) -> None:
        """Drop this client's op record and its connections."""
        if self._seq:
            try:
                self._post("/v3/kv/deleterange", {"key": self._op_key}, time.monotonic() + self.request_timeout)
            except EtcdStoreError as e:
                log.debug("etcd store: op record not removed: %s", e)
        with self._lock:
            for c in self._conns.values():
                c.close()
            self._conns.clear()
