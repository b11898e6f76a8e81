"""``start_hosts(HostsConfig(..., etcd=True))``: simulated hosts with a replicated store and no hand work
(issue 31 item 3).

Three hosts of one worker each (a user's own script, ``HostsConfig.program``): each host runs its etcd
member, its agent rendezvouses through it (torchrun's ``etcd-v2``) and its worker's membership store is
``etcd://`` with its own host's member first. The host of rank 0, whose etcd member is made the leader,
is killed (agent, worker, host store and etcd member): the two survivors still read what was written
before and write on through the two remaining members. Skipped only where etcd or python-etcd is missing.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tenplex.errors import ConfigError
from tenplex.train.etcd import etcd_binary
from tenplex.train.launch import HostsConfig, start_hosts, wait_for

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(etcd_binary() is None,
                                reason="etcd is not installed (Debian etcd-server; `make setup` installs it as root)")

# a user's own worker: env:// group, an all_reduce, then its record in the membership store; it waits for
# the test's "go" (written after a host is killed) and answers it
WORKER = textwrap.dedent("""
    import datetime, json, os, torch, torch.distributed as dist
    from tenplex.elastic.membership_runtime import membership_store
    open(os.path.join(os.environ["TENPLEX_PID_DIR"], f"{os.getpid()}.pid"), "w").write(str(os.getpid()))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, t = dist.get_rank(), torch.ones(1)
    dist.all_reduce(t)
    s = membership_store(timeout_s=40.0)
    s.set(f"hosts/up/{rank}", json.dumps({"pid": os.getpid(), "world": t.item(),
                                          "spec": os.environ["TENPLEX_MEMBERSHIP_STORE"]}))
    s.get("hosts/go")
    s.set(f"hosts/done/{rank}", "1")
""")


def test_etcd_hosts_config_needs_python_etcd(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without python-etcd (torchrun's etcd-v2 rendezvous) start_hosts says so before starting anything."""
    monkeypatch.setitem(sys.modules, "etcd", None)  # import etcd -> ImportError
    with pytest.raises(ConfigError, match="python-etcd"):
        start_hosts(HostsConfig(3, str(tmp_path), (), nproc=1, endpoint="", run_id="x", etcd=True))
    assert not (tmp_path / "etcd").exists()


@pytest.mark.timeout(150)
def test_start_hosts_with_etcd_survives_the_rank0_host_and_the_leader(tmp_path: Any) -> None:
    pytest.importorskip("etcd", reason="torchrun's etcd-v2 rendezvous needs python-etcd (the test extras)")
    from tenplex.elastic.etcd_store import EtcdStore

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    hosts = start_hosts(HostsConfig(3, str(tmp_path), (), nproc=1, endpoint="unused", run_id=f"h{os.getpid()}",
                                    env=env, program=(str(script),), etcd=True))
    cluster = hosts[0].etcd_cluster
    try:
        assert [h.etcd for h in hosts] == cluster.members and all(m.alive() for m in cluster.members)
        assert all("--rdzv-backend=etcd-v2" in h.agent.proc.args for h in hosts)
        client = EtcdStore(cluster.endpoints, namespace="tenplex/", timeout=datetime.timedelta(seconds=40),
                           request_timeout=1.0)
        up = [json.loads(v) for v in client.multi_get([f"hosts/up/{r}" for r in range(3)])]
        assert all(u["world"] == 3.0 for u in up)
        host_of_pid = {pid: i for i, h in enumerate(hosts) for pid in h.agent.worker_pids()}
        host_of_rank = [host_of_pid[u["pid"]] for u in up]
        for u, i in zip(up, host_of_rank):  # every worker's store: its own host's member first, then the others
            assert u["spec"] == cluster.spec_for(i), (u, i)
        dead = host_of_rank[0]
        cluster.move_leader(dead)
        t0 = time.monotonic()
        hosts[dead].kill()  # agent, rank 0's worker (and its env:// store), host store, the etcd leader
        assert not hosts[dead].etcd.alive() and hosts[dead].agent.proc.poll() is not None
        client.set("hosts/go", "1")
        survivors = [r for r in range(3) if r != 0]
        assert wait_for(lambda: client.check([f"hosts/done/{r}" for r in survivors]), 40), \
            [(tmp_path / f"host{i}.log").read_text()[-1500:] for i in range(3)]
        took = time.monotonic() - t0
        assert cluster.leader() != dead and client.get("hosts/up/0")  # written before the kill: still there
        print(f"\nhost {dead} (rank 0, the etcd leader) killed: survivors' writes through the 2 members after "
              f"{took:.2f} s")
    finally:
        for h in hosts:
            h.stop()
