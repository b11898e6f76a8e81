"""``start_hosts(HostsConfig(..., etcd=True))``: simulated hosts with a replicated store and no hand work
(issue 31 item 3), and the restart fallback with no single point of failure.

Three hosts of one worker each (``examples/train_native.py``, given as ``HostsConfig.program``): each host
runs its etcd member, its agent rendezvouses through it (torchrun's ``etcd-v2``) and its worker's
membership store is ``etcd://`` with its own host's member first. The host of rank 0 (its worker serves
the job's env:// store), whose etcd member is made the leader, is killed mid-run with everything on it.
The in-process path of the same failure under torchrun is tests/test_etcd_store.py's. Skipped only where
etcd or python-etcd is missing.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from tenplex.elastic.etcd_store import EtcdStore
from tenplex.errors import ConfigError, EtcdStoreError
from tenplex.train.etcd import etcd_binary
from tenplex.train.launch import HostsConfig, start_hosts, wait_for
from tenplex.train.torchrun import BACKEND, RetryingBackend

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(etcd_binary() is None,
                                reason="etcd is not installed (Debian etcd-server; `make setup` installs it as root)")


def test_etcd_hosts_config_needs_python_etcd(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without python-etcd (torchrun's etcd-v2 rendezvous) start_hosts says so before starting anything."""
    monkeypatch.setitem(sys.modules, "etcd", None)  # import etcd -> ImportError
    with pytest.raises(ConfigError, match="python-etcd"):
        start_hosts(HostsConfig(3, str(tmp_path), (), nproc=1, endpoint="", run_id="x", etcd=True))
    assert not (tmp_path / "etcd").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restart_fallback_on_etcd_survives_the_rank0_host_and_the_leader(tmp_path: Any) -> None:
    """The restart path with nothing on one host alone: ``examples/train_native.py`` (no ``--in-process``)
    on 3 hosts of ``start_hosts(etcd=True)``; the host of rank 0 (agent, worker, the env:// store its worker
    serves, and the etcd leader) is killed after 3 steps. The survivors' agents restart their workers,
    rendezvous again through the 2 remaining etcd members (torchrun's etcd-v2, once the dead node's
    rendezvous heartbeats are overdue), the new rank 0 serves a new env:// store, and the job resumes from its
    checkpoint on 2 workers with the losses and samples of an uninterrupted run. With ``openssl`` the
    cluster runs over TLS (``etcd_tls``: certificates made as tests/test_hostile_etcd.py makes them), so
    torchrun's rendezvous goes over https with the job's client certificate, and plain http is refused."""
    pytest.importorskip("etcd", reason="torchrun's etcd-v2 rendezvous needs python-etcd (the test extras)")
    from test_hostile_etcd import job_certs
    from test_native_inprocess import BATCH, EVERY, SCRIPT, STEPS, check_native_run, native_reference

    from tenplex.train.launch import read_train_log

    log = tmp_path / "log.jsonl"
    n_steps = 2 * STEPS  # the kill comes after 3 steps and a leader move: at 8 steps a loaded run had finished by then
    args = ("--steps", str(n_steps), "--ckpt-every", str(EVERY), "--global-batch", str(BATCH), "--ckpt",
            str(tmp_path / "ckpt"), "--log", str(log))
    env = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    tls = job_certs(tmp_path / "certs")["member"] if shutil.which("openssl") else None
    hosts = start_hosts(HostsConfig(3, str(tmp_path), args, nproc=1, endpoint="unused", run_id=f"r{os.getpid()}",
                                    env=env, program=(SCRIPT,), etcd=True, etcd_tls=tls))
    cluster = hosts[0].etcd_cluster
    try:
        if tls is not None:  # the job's etcd over TLS: torchrun's rendezvous and the workers' membership
            assert all(u.startswith("https://") for u in cluster.endpoints)
            assert all("protocol=https" in " ".join(h.agent.proc.args) for h in hosts)
            outsider = EtcdStore([u.replace("https://", "http://") for u in cluster.endpoints],
                                 timeout=datetime.timedelta(seconds=1), request_timeout=0.3)
            with pytest.raises(EtcdStoreError, match="no etcd endpoint"):
                outsider.set("intruder", "1")
        reference = native_reference(n_steps)
        assert wait_for(lambda: sum(1 for r in read_train_log(log)[0] if r["world_size"] == 3) >= 3, 150), \
            (tmp_path / "host0.log").read_text()[-3000:]
        assert [h.etcd for h in hosts] == cluster.members and all(m.alive() for m in cluster.members)
        for i, h in enumerate(hosts):  # torchrun's rendezvous on its own member; its worker's store: that first
            assert f"--rdzv-endpoint={h.etcd.client_url.split('://', 1)[1]}" in h.agent.proc.args
            assert f"--rdzv-backend={BACKEND}" in h.agent.proc.args  # torchrun's etcd-v2, retried through elections
            assert [_environ(p).get(b"TENPLEX_MEMBERSHIP_STORE") for p in h.agent.worker_pids()] == \
                [cluster.spec_for(i).encode()]
            if tls is not None:
                assert [_environ(p).get(b"TENPLEX_ETCD_CA_FILE") for p in h.agent.worker_pids()] == [tls.ca.encode()]
        dead = next(i for i, h in enumerate(hosts) if any(_environ(p).get(b"RANK") == b"0"
                                                          for p in h.agent.worker_pids()))
        cluster.move_leader(dead)
        t_kill = time.time()
        hosts[dead].kill()
        survivors = [h for i, h in enumerate(hosts) if i != dead]
        codes = [h.agent.wait(timeout=180) for h in survivors]
        assert cluster.leader() != dead and not hosts[dead].etcd.alive()
    finally:
        for h in hosts:
            h.stop()
    assert codes == [0, 0], [(tmp_path / f"host{i}.log").read_text()[-3000:] for i in range(3)]
    steps, starts = read_train_log(log)
    assert [(s["world_size"], s["fresh"]) for s in starts if s.get("start")] == [(3, True), (2, False)], starts
    # every step's losses and samples; no in-process recovery
    assert check_native_run(tmp_path, log, reference, steps=n_steps) == []
    first = min(r["wall"] for r in steps if r["wall"] > t_kill)
    print(f"\nkill -> first step after the restart: {first - t_kill:.1f} s")


def _environ(pid: int) -> dict[bytes, bytes]:
    """The environment of process ``pid`` (empty when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)


class _Flaky(RendezvousBackend):
    """A backend whose first ``fails`` calls fail as etcd does during a leader election."""

    def __init__(self, fails: int) -> None:
        self.fails, self.calls = fails, 0

    @property
    def name(self) -> str:
        return "flaky"

    def _call(self, value: Any) -> Any:
        self.calls += 1
        if self.calls <= self.fails:
            raise RendezvousConnectionError("The connection to etcd has failed.")
        return value

    def get_state(self) -> Any:
        return self._call((b"state", 7))

    def set_state(self, state: bytes, token: Any = None) -> Any:
        return self._call((state, token, True))


def test_rendezvous_requests_ride_out_an_election_and_then_give_up() -> None:
    """``tenplex.train.torchrun``'s backend retries a read or compare-and-set that failed with a connection
    error (the agent would exit on it) and gives the error up once ``retry_s`` has passed."""
    flaky = _Flaky(fails=3)
    assert RetryingBackend(flaky, retry_s=5).set_state(b"s", 3) == (b"s", 3, True) and flaky.calls == 4
    flaky = _Flaky(fails=2)
    assert RetryingBackend(flaky, retry_s=5).get_state() == (b"state", 7) and flaky.calls == 3
    with pytest.raises(RendezvousConnectionError, match="unreachable"):
        RetryingBackend(_Flaky(fails=10**6), retry_s=0.3).get_state()
