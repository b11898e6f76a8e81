"""Cluster topology for transfer scheduling: GPUs, host memory, NICs and switches on networkx.

Nodes carry a ``kind`` (``gpu``, ``nvswitch``, ``host``, ``nic``, ``switch``, ``storage``) and,
where they belong to one, a ``host`` index; GPU nodes also carry their global ``device``
number (device d sits on host ``d // gpus_per_host``). Directed edges are links with a
``bandwidth`` (bytes/s) and ``latency`` (s). A preset (:meth:`Topology.from_spec`) is built
as::

    gpu d  <-> nvs{h}   NVLink (through the host's NVSwitch)       per GPU
    gpu d  <-> mem{h}   PCIe to host memory (the store-and-forward buffer)
    mem{h} <-> nic{h}   host memory to the NIC
    nic{h} <-> switch   the network
    storage <-> switch  persistent storage (checkpoints)

Pure logic except :func:`probe_bandwidth`, which measures a link with torch.distributed.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..layout.config import MAX_WORLD_SIZE

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["Link", "Topology", "parse_bandwidth", "parse_duration", "probe_bandwidth", "DEFAULT_SPEC"]

log = logging.getLogger(__name__)

DEFAULT_SPEC = "hosts=2,gpus=8,nvlink=300GB/s,pcie=32GB/s,nic=50GB/s"

_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*(?:/s)?\s*$")
_BW_MULT = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_BIN = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_TIME = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str | float | int) -> float:
    """Bytes/s in ``300GB/s``, ``32GiB/s``, ``400Gb/s`` (bits: lower-case b), ``5e9`` or a number."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ConfigError(f"a bandwidth must be positive, got {text}")
        return float(text)
    m = _NUM_UNIT.match(str(text))
    if not m:
        raise ConfigError(f"cannot parse bandwidth {text!r}: use e.g. 300GB/s, 32GiB/s, 400Gb/s or bytes/s")
    value, unit = float(m.group(1)), m.group(2)
    bits = unit.endswith("b") and not unit.endswith("B") or unit.lower().endswith("bit")
    core = unit.lower().removesuffix("bit").removesuffix("bps").removesuffix("b")
    if core in _BW_BIN:
        mult = float(_BW_BIN[core])
    elif core in _BW_MULT:
        mult = _BW_MULT[core]
    else:
        raise ConfigError(f"cannot parse bandwidth {text!r}: unknown unit {unit!r} "
                          "(use B/s, KB/s .. TB/s, GiB/s, Gb/s)")
    out = value * mult / (8 if bits else 1)
    if out <= 0:
        raise ConfigError(f"a bandwidth must be positive, got {text!r}")
    return out


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``2us``, ``1.5ms``, ``0.1s`` or a number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a latency cannot be negative, got {text}")
        return float(text)
    m = _NUM_UNIT.match(str(text))
    if not m or m.group(2).lower() not in _TIME:
        raise ConfigError(f"cannot parse duration {text!r}: use e.g. 2us, 1.5ms, 0.1s")
    return float(m.group(1)) * _TIME[m.group(2).lower()]


@dataclass(frozen=True, slots=True)
class Link:
    """One directed link: ``bandwidth`` bytes/s, ``latency`` seconds."""

    src: str
    dst: str
    bandwidth: float
    latency: float
    kind: str = ""


_SPEC_DEFAULTS: dict[str, str] = {
    "hosts": "2", "gpus": "8", "nvlink": "300GB/s", "pcie": "32GB/s", "nic": "50GB/s", "mem": "200GB/s",
    "storage": "10GB/s", "nvlink_lat": "2us", "pcie_lat": "5us", "mem_lat": "1us", "nic_lat": "5us",
    "storage_lat": "100us",
}


@dataclass(frozen=True, slots=True)
class Topology:
    """A directed network of GPUs, NVSwitches, host memories, NICs, switches and storage.

    Build one with :meth:`from_spec`, :meth:`from_json` or from your own ``networkx.DiGraph``
    (nodes need ``kind``; GPU nodes ``device``; edges ``bandwidth`` and ``latency``).
    """

    graph: nx.DiGraph
    gpus_per_host: int
    name: str = ""
    links: tuple[Link, ...] = field(init=False, repr=False, compare=False)
    link_index: dict[tuple[str, str], int] = field(init=False, repr=False, compare=False)
    bandwidth: np.ndarray = field(init=False, repr=False, compare=False)
    latency: np.ndarray = field(init=False, repr=False, compare=False)
    node_names: tuple[str, ...] = field(init=False, repr=False, compare=False)  # graph node order
    node_index: dict[str, int] = field(init=False, repr=False, compare=False)
    link_src: np.ndarray = field(init=False, repr=False, compare=False)  # node index of each link's tail
    link_dst: np.ndarray = field(init=False, repr=False, compare=False)  # and head
    _gpu: dict[int, str] = field(init=False, repr=False, compare=False)
    _sp_cache: dict[tuple[str, float], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise ConfigError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")
        links = []
        for u, v, d in self.graph.edges(data=True):
            for key in ("bandwidth", "latency"):
                if key not in d:
                    raise ConfigError(f"link {u}->{v} has no {key}")
            if not d["bandwidth"] > 0:
                raise ConfigError(f"link {u}->{v}: bandwidth must be positive, got {d['bandwidth']}")
            if d["latency"] < 0:
                raise ConfigError(f"link {u}->{v}: latency cannot be negative, got {d['latency']}")
            links.append(Link(str(u), str(v), float(d["bandwidth"]), float(d["latency"]), str(d.get("kind", ""))))
        gpu = {}
        for n, d in self.graph.nodes(data=True):
            if "kind" not in d:
                raise ConfigError(f"node {n!r} has no kind (gpu, nvswitch, host, nic, switch, storage)")
            if d["kind"] == "gpu":
                if "device" not in d:
                    raise ConfigError(f"GPU node {n!r} has no device number")
                gpu[int(d["device"])] = str(n)
        object.__setattr__(self, "links", tuple(links))
        object.__setattr__(self, "link_index", {(lk.src, lk.dst): i for i, lk in enumerate(links)})
        object.__setattr__(self, "bandwidth", np.array([lk.bandwidth for lk in links], dtype=np.float64))
        object.__setattr__(self, "latency", np.array([lk.latency for lk in links], dtype=np.float64))
        names = tuple(str(n) for n in self.graph.nodes)
        index = {n: i for i, n in enumerate(names)}
        object.__setattr__(self, "node_names", names)
        object.__setattr__(self, "node_index", index)
        object.__setattr__(self, "link_src", np.array([index[lk.src] for lk in links], dtype=np.int64))
        object.__setattr__(self, "link_dst", np.array([index[lk.dst] for lk in links], dtype=np.int64))
        object.__setattr__(self, "_gpu", gpu)
        object.__setattr__(self, "_sp_cache", {})

    def __repr__(self) -> str:
        return (f"Topology({self.name or 'custom'}: {len(self._gpu)} GPUs, {self.graph.number_of_nodes()} nodes, "
                f"{len(self.links)} links)")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: str = DEFAULT_SPEC) -> Topology:
        """A preset from ``hosts=4,gpus=8,nvlink=300GB/s,pcie=32GB/s,nic=50GB/s``.

        Optional keys: ``mem`` (host memory <-> NIC), ``storage`` (storage <-> switch) and
        latencies ``nvlink_lat``, ``pcie_lat``, ``mem_lat``, ``nic_lat``, ``storage_lat``.
        ``nvlink=0`` builds hosts without NVLink. ``nic`` is per host.
        """
        vals = dict(_SPEC_DEFAULTS)
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or key not in _SPEC_DEFAULTS:
                raise ConfigError(f"cannot parse topology spec item {part!r}: keys are {', '.join(_SPEC_DEFAULTS)}")
            vals[key] = value
        try:
            hosts, gpus = int(vals["hosts"]), int(vals["gpus"])
        except ValueError:
            raise ConfigError(f"hosts and gpus must be integers in {spec!r}") from None
        if hosts < 1 or gpus < 1:
            raise ConfigError(f"hosts={hosts} and gpus={gpus} must both be >= 1")
        if hosts * gpus > MAX_WORLD_SIZE:
            raise ConfigError(f"hosts*gpus = {hosts}*{gpus} = {hosts * gpus} GPUs, more than the {MAX_WORLD_SIZE} a "
                              "layout may have: check the topology spec")
        nvlink = 0.0 if vals["nvlink"] in ("0", "none") else parse_bandwidth(vals["nvlink"])
        bw = {k: parse_bandwidth(vals[k]) for k in ("pcie", "nic", "mem", "storage")}
        lat = {k: parse_duration(vals[f"{k}_lat"]) for k in ("nvlink", "pcie", "mem", "nic", "storage")}
        import networkx as nx  # lazy: 0.2-0.5 s that a checkpoint load or save (import tenplex) need not pay

        g = nx.DiGraph()

        def both(u: str, v: str, b: float, la: float, kind: str) -> None:
            g.add_edge(u, v, bandwidth=b, latency=la, kind=kind)
            g.add_edge(v, u, bandwidth=b, latency=la, kind=kind)

        g.add_node("switch", kind="switch", host=None)
        g.add_node("storage", kind="storage", host=None)
        both("storage", "switch", bw["storage"], lat["storage"], "storage")
        for h in range(hosts):
            mem, nic, nvs = f"mem{h}", f"nic{h}", f"nvs{h}"
            g.add_node(mem, kind="host", host=h)
            g.add_node(nic, kind="nic", host=h)
            both(mem, nic, bw["mem"], lat["mem"], "mem")
            both(nic, "switch", bw["nic"], lat["nic"], "nic")
            if nvlink:
                g.add_node(nvs, kind="nvswitch", host=h)
            for i in range(gpus):
                d = h * gpus + i
                node = f"gpu{d}"
                g.add_node(node, kind="gpu", host=h, device=d)
                both(node, mem, bw["pcie"], lat["pcie"], "pcie")
                if nvlink:
                    both(node, nvs, nvlink, lat["nvlink"], "nvlink")
        return cls(g, gpus, name=spec)

    @classmethod
    def from_json(cls, source: str | Path | Mapping[str, Any]) -> Topology:
        """Load ``{"spec": "..."}`` or ``{"gpus_per_host": N, "nodes": [...], "links": [...]}``.

        Nodes: ``{"id", "kind", "host", "device"}``; links: ``{"src", "dst", "bandwidth",
        "latency", "kind", "bidirectional"}`` with bandwidths and latencies as numbers or
        strings (``"50GB/s"``, ``"5us"``). A spec plus ``links`` overrides or adds links.
        """
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            try:
                data = json.loads(Path(source).read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"cannot read topology JSON {source}: {e}") from None
        if "spec" in data:
            base = cls.from_spec(str(data["spec"]))
            g, gph = base.graph.copy(), base.gpus_per_host
        else:
            if "gpus_per_host" not in data:
                raise ConfigError("topology JSON needs 'spec' or 'gpus_per_host' with 'nodes' and 'links'")
            import networkx as nx  # lazy: 0.2-0.5 s that a checkpoint load or save (import tenplex) need not pay

            g, gph = nx.DiGraph(), int(data["gpus_per_host"])
        for n in data.get("nodes", []):
            attrs = {k: v for k, v in n.items() if k != "id"}
            g.add_node(str(n["id"]), **attrs)
        for lk in data.get("links", []):
            b, la = parse_bandwidth(lk["bandwidth"]), parse_duration(lk.get("latency", 0.0))
            for u, v in ((lk["src"], lk["dst"]), (lk["dst"], lk["src"])) if lk.get("bidirectional", True) else (
                    (lk["src"], lk["dst"]),):
                if u not in g or v not in g:
                    raise ConfigError(f"link {u}->{v} names a node that is not declared")
                g.add_edge(str(u), str(v), bandwidth=b, latency=la, kind=lk.get("kind", ""))
        return cls(g, gph, name=str(data.get("name", data.get("spec", "json"))))

    def to_json(self) -> dict[str, Any]:
        """A JSON object that :meth:`from_json` reads back (links listed one direction each)."""
        nodes = [{"id": n, **{k: v for k, v in d.items()}} for n, d in self.graph.nodes(data=True)]
        links = [{"src": lk.src, "dst": lk.dst, "bandwidth": lk.bandwidth, "latency": lk.latency, "kind": lk.kind,
                  "bidirectional": False} for lk in self.links]
        return {"name": self.name, "gpus_per_host": self.gpus_per_host, "nodes": nodes, "links": links}

    # -- queries ------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return len(self._gpu)

    def gpu(self, device: int) -> str:
        """Node of GPU ``device``."""
        try:
            return self._gpu[int(device)]
        except KeyError:
            raise ConfigError(f"the topology has no GPU {device} (it has {self.num_gpus}: devices "
                              f"{min(self._gpu, default=0)}..{max(self._gpu, default=-1)}); use more hosts") from None

    def host_of(self, node: str) -> int | None:
        return self.graph.nodes[node].get("host")

    def storage(self) -> str:
        """The storage node (raises when the topology has none)."""
        for n, d in self.graph.nodes(data=True):
            if d["kind"] == "storage":
                return str(n)
        raise ConfigError("the plan reads from storage but the topology has no node of kind 'storage'")

    def shortest_paths(self, source: str, ref_bytes: float = 2**24) -> tuple[dict[str, float], _Paths]:
        """Fastest paths from ``source`` for a message of ``ref_bytes`` (weight: latency + bytes / bandwidth)."""
        key = (source, float(ref_bytes))
        hit = self._sp_cache.get(key)
        if hit is None:
            hit = self._sp_cache[key] = self._dijkstra(source, float(ref_bytes))
        return hit

    def _dijkstra(self, source: str, ref: float) -> tuple[dict[str, float], _Paths]:
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import dijkstra

        mkey = ("__all__", ref)
        hit = self._sp_cache.get(mkey)
        if hit is None:
            nodes, idx = list(self.node_names), self.node_index
            w = self.latency + ref / self.bandwidth
            mat = csr_matrix((w, (self.link_src, self.link_dst)), shape=(len(nodes), len(nodes)))
            dist, pred = dijkstra(mat, directed=True, return_predecessors=True)
            hit = self._sp_cache[mkey] = (nodes, idx, dist, pred)
        nodes, idx, dist, pred = hit
        i = idx[source]
        dists = {n: float(dist[i, j]) for j, n in enumerate(nodes) if np.isfinite(dist[i, j])}
        return dists, _Paths(nodes, idx, i, pred[i], dist[i])

    def path_links(self, path: list[str]) -> list[int]:
        """Link indices along a node path."""
        return [self.link_index[(u, v)] for u, v in zip(path, path[1:])]

    def cut_bandwidth(self, nodes: set[str], incoming: bool) -> float:
        """Total bandwidth of the links entering (or leaving) a node set."""
        total = 0.0
        for lk in self.links:
            if incoming and lk.dst in nodes and lk.src not in nodes:
                total += lk.bandwidth
            if not incoming and lk.src in nodes and lk.dst not in nodes:
                total += lk.bandwidth
        return total


class _Paths:
    """Shortest paths from one source, rebuilt from the predecessor row on first use."""

    __slots__ = ("_nodes", "_idx", "_src", "_pred", "_dist", "_memo")

    def __init__(self, nodes: list[str], idx: dict[str, int], src: int, pred: np.ndarray, dist: np.ndarray) -> None:
        self._nodes, self._idx, self._src, self._pred, self._dist = nodes, idx, src, pred, dist
        self._memo: dict[str, list[str]] = {}

    def __contains__(self, node: object) -> bool:
        j = self._idx.get(node) if isinstance(node, str) else None
        return j is not None and bool(np.isfinite(self._dist[j]))

    def __getitem__(self, node: str) -> list[str]:
        hit = self._memo.get(node)
        if hit is None:
            if node not in self:
                raise KeyError(node)
            path = [self._idx[node]]
            while path[-1] != self._src:
                path.append(int(self._pred[path[-1]]))
            hit = self._memo[node] = [self._nodes[i] for i in reversed(path)]
        return hit


def _probe_worker(rank: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
    dist.barrier()
    if rank == 1:
        out.put(repeats * nbytes / (time.perf_counter() - t0))
    dist.destroy_process_group()


def probe_bandwidth(nbytes: int = 2**24, repeats: int = 4, timeout: float = 60.0) -> float:
    """Measure loopback point-to-point bandwidth (bytes/s) between two spawned gloo processes.

    Optional and slow (process start-up): use it to fill a spec, e.g.
    ``Topology.from_spec(f"hosts=1,gpus=2,pcie={probe_bandwidth():.0f}")``.
    """
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_probe_worker, args=(r, port, nbytes, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        value = float(q.get(timeout=timeout))
    except Exception as e:  # queue.Empty or a dead worker
        raise ConfigError(f"bandwidth probe produced no result within {timeout:.0f}s: {e!r}") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    log.info("probed loopback bandwidth: %.2f GB/s", value / 1e9)
    return value
