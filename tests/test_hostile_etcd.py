"""The membership store over TLS (issue 31 items 3 and 5): an etcd cluster started with
``EtcdCluster(tls=...)`` serves only https and only to clients whose certificate the job's CA signed.

Certificates are made here with ``openssl`` (a CA, a member certificate for 127.0.0.1, a worker's
client certificate, and a second CA with its own client certificate). The job's worker, through
``membership_store()`` and the ``TENPLEX_ETCD_*_FILE`` variables, reads and writes; a client that
speaks plain http, one that trusts the CA but has no certificate, one with a certificate of another
CA, and one that does not have the CA (and so cannot check the members) can neither read nor write.
"""

from __future__ import annotations

import base64
import datetime
import shutil
import ssl
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tenplex.elastic.etcd_store import TLS_ENV, EtcdStore, EtcdTLS
from tenplex.errors import ConfigError, EtcdStoreError
from tenplex.train.etcd import EtcdCluster, etcd_binary

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (Debian etcd-server; `make setup`)"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="the test makes its certificates with openssl"),
]

SHORT = datetime.timedelta(seconds=2)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=d)


def _signed(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)


def job_certs(d: Path) -> dict[str, EtcdTLS]:
    """Under ``d``: the job's CA, a member certificate for 127.0.0.1 (server and client use), a worker's
    client certificate, and another CA with a client certificate of its own."""
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _signed(d, "member", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    _signed(d, "worker", "ca", "extendedKeyUsage=clientAuth\n")
    _signed(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")

    def tls(ca: str, name: str) -> EtcdTLS:
        return EtcdTLS(str(d / f"{ca}.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))

    return {"member": tls("ca", "member"), "worker": tls("ca", "worker"), "rogue": tls("rogue-ca", "rogue"),
            "rogue_trusting_ca": tls("ca", "rogue")}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EtcdTLS]:
    return job_certs(tmp_path_factory.mktemp("certs"))


def _raw(url: str, ctx: ssl.SSLContext | None, path: str, payload: bytes) -> Any:
    req = urllib.request.Request(url + path, payload, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5, context=ctx) as r:  # noqa: S310 - the test's own etcd
        return r.read()


def test_tls_files_are_all_or_none(tmp_path: Path) -> None:
    assert EtcdTLS.from_env({}) is None
    with pytest.raises(ConfigError, match="needs all of"):
        EtcdTLS.from_env({TLS_ENV[0]: "/x"})
    with pytest.raises(ConfigError, match="not found"):
        EtcdTLS(str(tmp_path / "ca.pem"), str(tmp_path / "c.pem"), str(tmp_path / "c.key"))


@pytest.mark.timeout(90)
def test_only_clients_with_the_jobs_certificates_read_or_write_membership(certs: dict[str, EtcdTLS],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tenplex.elastic.membership_runtime import MEMBERSHIP_STORE_ENV, membership_store

    with EtcdCluster(3, tls=certs["member"]) as cluster:
        assert all(u.startswith("https://127.0.0.1:") for u in cluster.endpoints)
        # the job's worker: its files from the environment, as membership_store() finds them
        monkeypatch.setenv(MEMBERSHIP_STORE_ENV, cluster.spec_for(1))
        for k, v in certs["worker"].env().items():
            monkeypatch.setenv(k, v)
        s = membership_store(timeout_s=10.0)
        assert isinstance(s, EtcdStore) and s.tls == certs["worker"] and s.endpoints[0].startswith("https://")
        s.set("job/members", "0,1,2")
        assert s.add("job/round", 1) == 1 and s.get("job/members") == b"0,1,2"
        assert s.clone().compare_set("job/decision", "", "r1") == b"r1"

        # plain http to a TLS member: no answer the client understands
        plain = EtcdStore([u.replace("https://", "http://") for u in cluster.endpoints], namespace="tenplex/",
                          timeout=SHORT, request_timeout=0.5)
        # a client with another CA's certificate (it trusts our CA, so the failure is the member's refusal)
        rogue = EtcdStore(cluster.endpoints, namespace="tenplex/", timeout=SHORT, request_timeout=0.5,
                          tls=certs["rogue_trusting_ca"])
        # a client without the CA: it cannot check the members, so it refuses to talk (and sends nothing)
        blind = EtcdStore(cluster.endpoints, namespace="tenplex/", timeout=SHORT, request_timeout=0.5,
                          tls=certs["rogue"])
        for c, why in ((plain, "Remote|reset|closed|BadStatus"), (rogue, "SSL|alert|reset|closed"),
                       (blind, "CERTIFICATE_VERIFY_FAILED")):
            for op in (lambda: c.get("job/members"), lambda: c.set("job/members", "intruder"),
                       lambda: c.add("job/round", 1)):
                with pytest.raises(EtcdStoreError, match=f"no etcd endpoint.*({why})"):
                    op()
        # trusting the CA but presenting no certificate: the member refuses (--client-cert-auth)
        no_cert = ssl.create_default_context(cafile=certs["worker"].ca)

        body = b'{"key": "' + base64.b64encode(b"tenplex/job/members") + b'"}'
        for path in ("/v3/kv/range", "/v3/kv/put"):
            with pytest.raises(OSError):
                _raw(cluster.endpoints[0], no_cert, path, body)
        # nothing changed: the job's own client reads what it wrote
        assert s.get("job/members") == b"0,1,2" and s.add("job/round", 0) == 1
        s.close()
