"""Topology presets, JSON round trips, unit parsing and the optional bandwidth probe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenplex import ConfigError
from tenplex.planning.topology import Topology, parse_bandwidth, parse_duration, probe_bandwidth


def test_parse_units() -> None:
    assert parse_bandwidth("300GB/s") == 300e9
    assert parse_bandwidth("400Gb/s") == 50e9
    assert parse_bandwidth("32GiB/s") == 32 * 2**30
    assert parse_bandwidth(5e9) == 5e9
    assert parse_duration("5us") == pytest.approx(5e-6)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    with pytest.raises(ConfigError, match="cannot parse bandwidth"):
        parse_bandwidth("fast")
    with pytest.raises(ConfigError, match="positive"):
        parse_bandwidth(0)


def test_spec_preset_shape() -> None:
    t = Topology.from_spec("hosts=4,gpus=8,nvlink=300GB/s,pcie=32GB/s,nic=50GB/s")
    assert t.num_gpus == 32 and t.gpus_per_host == 8
    assert t.gpu(9) == "gpu9" and t.host_of("gpu9") == 1
    # per host: 8 GPUs x (NVLink + PCIe) both ways, memory <-> NIC, NIC <-> switch; plus storage
    assert len(t.links) == 4 * (8 * 4 + 2 + 2) + 2
    _, paths = t.shortest_paths("gpu0")
    assert paths["gpu3"] == ["gpu0", "nvs0", "gpu3"]  # same host: NVLink
    assert paths["gpu9"] == ["gpu0", "mem0", "nic0", "switch", "nic1", "mem1", "gpu9"]  # through host memory
    assert t.link_index[("nic0", "switch")] >= 0
    assert t.bandwidth[t.link_index[("nic0", "switch")]] == 50e9
    # the host cut is the NIC
    host1 = {n for n in t.graph if t.host_of(n) == 1}
    assert t.cut_bandwidth(host1, incoming=True) == 50e9


def test_spec_without_nvlink_and_errors() -> None:
    t = Topology.from_spec("hosts=1,gpus=2,nvlink=0")
    _, paths = t.shortest_paths("gpu0")
    assert paths["gpu1"] == ["gpu0", "mem0", "gpu1"]
    with pytest.raises(ConfigError, match="keys are"):
        Topology.from_spec("hosts=2,warp=9")
    with pytest.raises(ConfigError, match="has no GPU 5"):
        t.gpu(5)


def test_json_round_trip_and_overrides(tmp_path: Path) -> None:
    t = Topology.from_spec("hosts=2,gpus=2")
    f = tmp_path / "t.json"
    f.write_text(json.dumps(t.to_json()))
    u = Topology.from_json(f)
    assert u.num_gpus == 2 * 2 and len(u.links) == len(t.links)
    assert list(u.bandwidth) == list(t.bandwidth)
    v = Topology.from_json({"spec": "hosts=2,gpus=2", "links": [{"src": "nic1", "dst": "switch",
                                                                  "bandwidth": "10GB/s", "latency": "1us"}]})
    assert v.bandwidth[v.link_index[("nic1", "switch")]] == 10e9
    assert v.bandwidth[v.link_index[("switch", "nic1")]] == 10e9
    with pytest.raises(ConfigError, match="not declared"):
        Topology.from_json({"spec": "hosts=1,gpus=1", "links": [{"src": "gpu0", "dst": "nowhere", "bandwidth": 1}]})
    custom = Topology.from_json({"gpus_per_host": 1, "nodes": [{"id": "g0", "kind": "gpu", "device": 0, "host": 0},
                                                             {"id": "g1", "kind": "gpu", "device": 1, "host": 1}],
                                 "links": [{"src": "g0", "dst": "g1", "bandwidth": "1GB/s"}]})
    assert custom.gpu(1) == "g1" and len(custom.links) == 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_probe_loopback_bandwidth() -> None:
    bw = probe_bandwidth(nbytes=2**20, repeats=2, timeout=60)
    assert bw > 1e6  # any working loopback moves more than 1 MB/s
