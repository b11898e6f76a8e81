"""Simulated multi-node elastic jobs on one machine: a standalone rendezvous store and torchrun agents.

Each agent is one "node". The rendezvous store runs in its own process so that killing any
agent (a node failure) leaves it alive; agents connect to it with ``is_host=false``. Workers
write their pid to ``pid_dir`` so a node failure can kill its workers too (they are not in the
agent's process group).

Every process takes a ``HostNet`` (``netns.py``): by default the root namespace's loopback
(distinct ports per host); with a ``HostNetwork`` each host runs in its own network namespace
at its own address and the rendezvous store on the bridge, so the rendezvous, gloo and the
store traffic cross a real network stack, and a host can also fail by losing its link.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..elastic.etcd_store import EtcdTLS
from .etcd import EtcdCluster
from .netns import LOOPBACK, HostNet, HostNetwork, free_port
from .torchrun import BACKEND

__all__ = ["free_port", "RendezvousStore", "Agent", "StoreProcess", "SimulatedHost", "HostsConfig", "start_hosts", "read_train_log",
           "wait_for", "kill_alive"]

log = logging.getLogger(__name__)


class RendezvousStore:
    """A TCPStore server in a child process, outliving the agents that use it."""

    def __init__(self, port: int | None = None, *, net: HostNet = LOOPBACK) -> None:
        self.port = port or free_port()
        self.net = net
        code = (
            "import sys, time, torch.distributed as d\n"
            f"s = d.TCPStore({net.address!r}, {self.port}, is_master=True, wait_for_workers=False)\n"
            "print('ready', flush=True)\n"
            "while True: time.sleep(3600)\n"
        )
        # in a namespace the server's reverse lookups of its clients find no resolver (there is no
        # route out): quiet that warning rather than print it for every agent
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"} if net.netns else None
        self.proc = subprocess.Popen(net.command([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"the rendezvous store on {net.address}:{self.port} did not start")

    @property
    def endpoint(self) -> str:
        return f"{self.net.address}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class Agent:
    """``torchrun`` for one simulated node: ``nproc`` workers running ``program`` (default
    ``-m tenplex.train``; a script path runs a user's own training script).

    ``rdzv_backend``: ``c10d`` (``endpoint`` the standalone ``RendezvousStore``) or ``etcd-v2``
    (``endpoint`` this host's member of an etcd cluster started with ``v2=True``, torchrun's etcd
    rendezvous through ``python-etcd``; pass the cluster's ``etcd://`` spec as
    ``TENPLEX_MEMBERSHIP_STORE`` in ``env`` for the workers' membership)."""

    def __init__(self, name: str, endpoint: str, train_args: Sequence[str], *, nproc: int, min_nodes: int,
                 max_nodes: int, pid_dir: str, log_path: str, max_restarts: int = 3, run_id: str = "tenplex",
                 env: dict[str, str] | None = None, net: HostNet = LOOPBACK,
                 program: Sequence[str] = ("-m", "tenplex.train"), rdzv_backend: str = "c10d",
                 rdzv_tls: EtcdTLS | None = None) -> None:
        if rdzv_backend not in ("c10d", "etcd-v2"):
            raise ConfigError(f"rdzv_backend must be c10d or etcd-v2, got {rdzv_backend!r}")
        if rdzv_tls is not None and rdzv_backend != "etcd-v2":
            raise ConfigError("rdzv_tls is for torchrun's etcd-v2 rendezvous (rdzv_backend='etcd-v2')")
        self.name, self.pid_dir, self.net = name, Path(pid_dir) / name, net
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        conf = "last_call_timeout=3,join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=3"
        if rdzv_tls is not None:  # torchrun's etcd rendezvous over https, with this client certificate
            conf += f",protocol=https,ca_cert={rdzv_tls.ca},ssl_cert={rdzv_tls.cert},ssl_cert_key={rdzv_tls.key}"
        # etcd-v2: torchrun's own backend with its requests retried through an etcd leader election
        # (tenplex.train.torchrun: torchrun's agent exits on the first failed request otherwise)
        runner, backend = ("torch.distributed.run", "c10d") if rdzv_backend == "c10d" else ("tenplex.train.torchrun", BACKEND)
        cmd = [sys.executable, "-m", runner, f"--nnodes={min_nodes}:{max_nodes}",
               f"--nproc-per-node={nproc}", f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
               f"--rdzv-id={run_id}", f"--rdzv-conf={'is_host=false,' if rdzv_backend == 'c10d' else ''}{conf}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
               # in a namespace the hostname resolves to no address of this host: name the node by
               # its address (workers' MASTER_ADDR comes from the rank-0 node's)
               *([f"--local-addr={net.address}"] if net.netns else []), *program, "--", *train_args]
        # Workers bootstrap from a per-round prefix of the rendezvous store rather than a TCP
        # store shared across rounds by the rank-0 agent: after a node failure, keys left by
        # the previous round's workers would otherwise send gloo to dead peers until timeout.
        # --in-process workers keep their membership in the rendezvous store: it outlives every node
        full_env = {**os.environ, "TENPLEX_MEMBERSHIP_STORE": endpoint, **(env or {}), **net.env(),
                    "TENPLEX_PID_DIR": str(self.pid_dir),
                    "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        self.log_file = open(log_path, "w")  # noqa: SIM115 - closed in wait/kill
        self.proc = subprocess.Popen(net.command(cmd), stdout=self.log_file, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def worker_pids(self) -> list[int]:
        pids = []
        for f in self.pid_dir.glob("*.pid"):
            try:
                pids.append(int(f.read_text()))
            except (OSError, ValueError):
                continue
        return pids

    def kill(self) -> None:
        """A node failure: SIGKILL the agent and every worker it started."""
        targets = [self.proc.pid, *self.worker_pids()]
        for pid in targets:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=30)
        self.log_file.close()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is not None:
                self.log_file.close()

    def stop(self) -> None:
        """Kill whatever is left (clean-up on any exit path)."""
        if self.proc.poll() is None:
            self.kill()
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def read_train_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """The trainer's ``--log`` file: (per-step records, start records), in file order."""
    steps: list[dict] = []
    starts: list[dict] = []
    p = Path(path)
    if p.exists():
        for line in p.read_text().splitlines():
            obj = json.loads(line)
            (steps if "loss" in obj else starts).append(obj)
    return steps, starts


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:  # noqa: ANN001
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def kill_alive(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL and reap every process of ``procs`` still running (a run's clean-up, whatever ended it)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


class StoreProcess:
    """``tenplex store serve`` for one simulated host, on its own port of the host's address
    (loopback, or its namespace's address). ``token``: the job's store token, handed over in
    the environment (never on the command line, where ``ps`` shows it)."""

    def __init__(self, root: str, port: int, peers: Sequence[str], *, replicas: int = 1, keep_last: int = 2,
                 log_path: str | None = None, net: HostNet = LOOPBACK, token: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.root, self.port, self.net = root, port, net
        self.url = f"http://{net.address}:{port}"
        self.token = token  # shared by the job's stores and workers, through the environment (not argv)
        self.log_file = open(log_path or os.devnull, "w")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            net.command([sys.executable, "-m", "tenplex", "store", "serve", "--root", root, "--listen",
                         f"{net.address}:{port}", "--peers", ",".join(peers), "--replicas", str(replicas),
                         "--keep-last", str(keep_last)]),
            stdout=subprocess.PIPE, stderr=self.log_file, text=True, start_new_session=True,
            env={**os.environ, **(env or {}), **({"TENPLEX_STORE_TOKEN": token} if token else {})})
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "serving" not in line:
            self.stop()
            raise RuntimeError(f"the store on {net.address}:{port} did not start")

    def env(self, all_urls: Sequence[str]) -> dict[str, str]:
        """What a worker on this host needs to snapshot and recover."""
        env = {"TENPLEX_STORE_ROOT": self.root, "TENPLEX_STORE_URL": self.url, "TENPLEX_STORES": ",".join(all_urls)}
        return {**env, "TENPLEX_STORE_TOKEN": self.token} if self.token else env

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log_file.close()


class SimulatedHost:
    """A host: its store process, a torchrun agent whose workers snapshot into that store and, with
    ``HostsConfig(etcd=True)``, its member ``etcd`` (an ``EtcdMember``) of the job's ``etcd_cluster``."""

    def __init__(self, name: str, store: StoreProcess, agent: Agent, network: HostNetwork | None = None,
                 etcd_cluster: EtcdCluster | None = None, etcd_index: int = 0) -> None:
        self.name, self.store, self.agent, self.network = name, store, agent, network
        self.etcd_cluster = etcd_cluster
        self.etcd = etcd_cluster.members[etcd_index] if etcd_cluster is not None else None

    def kill(self) -> None:
        """A host failure: its workers, its agent, its store and its etcd member die at once."""
        self.agent.kill()
        if self.etcd is not None:
            self.etcd.kill()
        self.store.stop()

    def fail(self, how: str = "kill") -> None:
        """A host failure, as ``kill`` (processes SIGKILLed: peers' connections are reset at once)
        or ``network`` (its link to the switch goes down: processes keep running, cut off, and
        peers learn of it only when their packets go unanswered; namespaced hosts only)."""
        if how == "kill":
            self.kill()
        elif how == "network":
            if self.network is None:
                raise ConfigError(f"{self.name} runs on loopback: a network failure needs hosts in network "
                                  "namespaces (start_hosts(HostsConfig(..., network=HostNetwork.create(n))))")
            self.network.set_link(self.agent.net, up=False)
        else:
            raise ConfigError(f"unknown failure {how!r}: use 'kill' or 'network'")

    def stop(self) -> None:
        self.agent.stop()
        self.store.stop()
        if self.etcd is not None:
            self.etcd.kill()


@dataclass(frozen=True)
class HostsConfig:
    """The simulated hosts of one job (:func:`start_hosts`): ``n`` hosts of ``nproc`` workers each
    running ``python -m tenplex.train`` with ``train_args``, sharing the rendezvous at ``endpoint``
    under ``run_id``; logs and pid files under ``work``. Store roots go under ``store_dir`` (e.g. a
    tmpfs such as /dev/shm), default ``work``; each store keeps ``keep_last`` steps and ``replicas``
    copies of each snapshot. With ``network`` host ``i`` runs in ``network.hosts[i]`` (its store
    beyond loopback, so with a generated token unless ``env`` has one); ``endpoint`` must then be
    reachable from the namespaces (a ``RendezvousStore(net=network.switch)``). ``program``: what each
    worker runs (default ``-m tenplex.train``; a script path and its options run a user's own loop).

    ``etcd``: no single point of failure. Host ``i`` also runs member ``i`` of an etcd cluster of ``n``
    (``tenplex.train.etcd.EtcdCluster``, on the host's address; data under ``store_dir`` or ``work``);
    its agent rendezvouses through that member (torchrun's ``etcd-v2`` backend, which needs
    ``python-etcd``) and its workers get ``TENPLEX_MEMBERSHIP_STORE=etcd://...`` with their own host's
    member first. ``endpoint`` is then not used, and killing a host kills its member too. Needs
    ``n >= 3`` for a host's loss to leave a majority (with 2, one loss stops the store). ``etcd_tls``
    (with ``etcd``): the members serve https with its certificate (which must name every host's
    address and allow server and client use) and take only clients and peers that its CA signed;
    agents and workers present the same certificate (``TENPLEX_ETCD_*_FILE``)."""

    n: int
    work: str
    train_args: tuple[str, ...]
    nproc: int
    endpoint: str
    run_id: str
    replicas: int = 1
    env: Mapping[str, str] = field(default_factory=dict)
    store_dir: str | None = None
    keep_last: int = 2
    network: HostNetwork | None = None
    program: tuple[str, ...] = ("-m", "tenplex.train")
    etcd: bool = False
    etcd_tls: EtcdTLS | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_args", tuple(self.train_args))
        object.__setattr__(self, "program", tuple(self.program))
        object.__setattr__(self, "env", dict(self.env))
        for name in ("n", "nproc", "replicas", "keep_last"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.etcd_tls is not None and not self.etcd:
            raise ConfigError("etcd_tls secures the hosts' etcd cluster: set etcd=True too")
        if self.network is not None and len(self.network.hosts) < self.n:
            raise ConfigError(f"{self.n} hosts need a network of at least {self.n} host namespaces, it has "
                              f"{len(self.network.hosts)} ({self.n} > {len(self.network.hosts)})")


def _start_etcd(config: HostsConfig, nets: Sequence[HostNet]) -> EtcdCluster | None:
    """``config.etcd``'s cluster, one member per host on its address (None without ``etcd``);
    ConfigError when etcd or python-etcd (torchrun's etcd-v2 rendezvous) is missing."""
    if not config.etcd:
        return None
    try:
        import etcd  # noqa: F401  # lazy: python-etcd is optional (torchrun's etcd-v2 rendezvous imports it)
    except ImportError as e:
        raise ConfigError("HostsConfig(etcd=True) runs torchrun's etcd-v2 rendezvous, which needs python-etcd "
                          "(pip install python-etcd; in the test extras)") from e
    return EtcdCluster(config.n, nets=nets, work=os.path.join(config.store_dir or config.work, "etcd"), v2=True,
                       tls=config.etcd_tls)


def start_hosts(config: HostsConfig) -> list[SimulatedHost]:
    """The hosts ``config`` describes, sharing one rendezvous: with ``etcd`` the cluster first, then
    stores (they know each other; started concurrently), then agents."""
    c = config
    n, work = c.n, c.work
    nets = c.network.hosts[:n] if c.network is not None else [LOOPBACK] * n
    env = dict(c.env)
    token = env.pop("TENPLEX_STORE_TOKEN", None) or secrets.token_urlsafe(32)  # one for the job's stores and workers
    ports = [free_port() for _ in range(n)]
    urls = [f"http://{net.address}:{p}" for net, p in zip(nets, ports)]

    def start_store(i: int) -> StoreProcess:
        root = os.path.join(c.store_dir or work, f"host{i}", "store")
        os.makedirs(root, mode=0o700, exist_ok=True)
        return StoreProcess(root, ports[i], urls, replicas=c.replicas, keep_last=c.keep_last,
                            log_path=os.path.join(work, f"store{i}.log"), net=nets[i], token=token, env=env)

    cluster = _start_etcd(c, nets)
    # the stores start at once (each takes a second or two to import and listen), then the agents one
    # right after the other, so they reach the rendezvous together
    with ThreadPoolExecutor(max_workers=n) as pool:
        started = [pool.submit(start_store, i) for i in range(n)]
    failed = [f.exception() for f in started if f.exception() is not None]
    if failed:
        for f in started:
            if f.exception() is None:
                f.result().stop()
        if cluster is not None:
            cluster.stop()
        raise failed[0]
    hosts = []
    for i, store in enumerate(f.result() for f in started):
        member = cluster.members[i] if cluster is not None else None
        endpoint = c.endpoint if member is None else member.client_url.split("://", 1)[1]
        own = {} if cluster is None else {"TENPLEX_MEMBERSHIP_STORE": cluster.spec_for(i),
                                          **(c.etcd_tls.env() if c.etcd_tls is not None else {})}
        agent = Agent(f"host{i}", endpoint, c.train_args, nproc=c.nproc, min_nodes=1, max_nodes=n,
                      pid_dir=os.path.join(work, "pids"), log_path=os.path.join(work, f"host{i}.log"),
                      run_id=c.run_id, env={**env, **store.env(urls), **own}, net=nets[i], program=c.program,
                      rdzv_backend="c10d" if member is None else "etcd-v2", rdzv_tls=c.etcd_tls)
        hosts.append(SimulatedHost(f"host{i}", store, agent, c.network, cluster, i))
    return hosts
