"""Simulated hosts in their own Linux network namespaces, joined by a private bridge.

``HostNetwork.create(n)`` builds one "switch" namespace holding a bridge and ``n`` host
namespaces, each wired to the bridge by a veth pair, so the processes of different simulated
hosts reach each other only through a real network stack (ARP, TCP over the bridge) and never
over a shared loopback. Nothing is added to the root namespace: the bridge, the veths and the
addresses all live in namespaces this module creates, and deleting them removes everything.
The switch namespace also has an address on the bridge, where a job-wide service (the c10d
rendezvous store) can run.

Planning (names, subnet, addresses: ``NetnsPlan``, ``HostNet``) is pure; the ``ip`` calls are
in ``HostNetwork``. Where namespaces are impossible (not root, no ``ip``, creation refused)
``create`` raises ``NetnsUnavailableError`` with the reason and callers fall back to loopback.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError, NetnsUnavailableError

__all__ = ["free_port", "NetnsPlan", "HostNet", "LOOPBACK", "HostNetwork", "try_create", "unavailable_reason",
           "reap_stale", "our_namespaces", "NAME_PREFIX"]

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on loopback now (the kernel's pick; another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

NAME_PREFIX = "tenplex-"
SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")  # one /24 of it per network
HOST_IFNAME = "eth0"  # the host's end of its veth, inside its namespace
BRIDGE = "br0"  # inside the switch namespace
# Kernel settings of every namespace: IPv4 only (gloo binds to the interface's first address),
# and an unacknowledged TCP connection fails after ~3 s instead of Linux's ~15 min, so a host
# cut off the network breaks its peers' gloo connections as soon as they send to it.
DEFAULT_SYSCTLS = (("net.ipv6.conf.all.disable_ipv6", "1"), ("net.ipv6.conf.default.disable_ipv6", "1"),
                   ("net.ipv4.tcp_retries2", "3"), ("net.ipv4.tcp_syn_retries", "2"))
_NAME = re.compile(rf"^{re.escape(NAME_PREFIX)}(\d+)-(\d+)-(sw|h\d+)$")


@dataclass(frozen=True, slots=True)
class HostNet:
    """Where one simulated host's processes run: a network namespace and its address.

    The default (no namespace) is the root namespace's loopback, the fallback."""

    address: str = "127.0.0.1"
    netns: str | None = None  # namespace name; None: the root namespace
    ifname: str | None = None  # the interface carrying ``address`` (GLOO_SOCKET_IFNAME)
    switch: str | None = None  # the switch namespace and this host's port on its bridge
    port: str | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` replaces itself with it,
        so the child's pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)

    def env(self) -> dict[str, str]:
        """Environment that makes gloo, TensorPipe and NCCL use this host's interface."""
        if not self.ifname:
            return {}
        return {"GLOO_SOCKET_IFNAME": self.ifname, "TP_SOCKET_IFNAME": self.ifname,
                "NCCL_SOCKET_IFNAME": self.ifname}


LOOPBACK = HostNet()


@dataclass(frozen=True, slots=True)
class NetnsPlan:
    """Names and addresses of one network: switch ``tenplex-<owner>-<seq>-sw`` with bridge
    address ``10.231.<third>.1``, hosts ``...-h<i>`` at ``10.231.<third>.<i + 2>``.

    The owner pid in the names lets a later run remove what a killed run left behind; the
    switch namespace isolates each network, so equal subnets of two runs never meet (the third
    octet still differs between concurrent runs, which keeps captures and logs readable)."""

    owner: int
    seq: int
    hosts: int

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 252:
            raise ConfigError(f"a /24 holds the bridge and at most 252 hosts (.2 .. .253), got hosts={self.hosts}")
        if self.owner < 0 or self.seq < 0:
            raise ConfigError(f"owner pid and sequence number must be >= 0, got {self.owner}, {self.seq}")

    @property
    def third_octet(self) -> int:
        return (self.owner + self.seq) % 254 + 1

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{SUBNETS.network_address + (self.third_octet << 8)}/24")

    @property
    def base(self) -> str:
        return f"{NAME_PREFIX}{self.owner}-{self.seq}"

    @property
    def switch(self) -> HostNet:
        """The switch namespace, addressed on its bridge (where the rendezvous store can run)."""
        return HostNet(str(self.subnet.network_address + 1), f"{self.base}-sw", BRIDGE, f"{self.base}-sw", None)

    def host(self, i: int) -> HostNet:
        if not 0 <= i < self.hosts:
            raise IndexError(f"host {i} of a network of {self.hosts} hosts (0..{self.hosts - 1})")
        return HostNet(str(self.subnet.network_address + 2 + i), f"{self.base}-h{i}", HOST_IFNAME,
                       f"{self.base}-sw", f"v{i}")

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the network, switch first."""
        return [f"{self.base}-sw", *(f"{self.base}-h{i}" for i in range(self.hosts))]

    def setup_commands(self, sysctls: Sequence[tuple[str, str]] = DEFAULT_SYSCTLS) -> list[list[str]]:
        """The ``ip`` (and ``sh`` for sysctls) commands that build the network, in order."""
        sw = self.switch
        pfx = self.subnet.prefixlen
        cmds = [["ip", "netns", "add", ns] for ns in self.namespaces]
        for ns in self.namespaces:
            cmds.append(["ip", "-n", ns, "link", "set", "lo", "up"])
            if sysctls:
                script = "; ".join(f"echo {v} > /proc/sys/{k.replace('.', '/')}" for k, v in sysctls)
                cmds.append(["ip", "netns", "exec", ns, "sh", "-ec", script])
        cmds += [["ip", "-n", sw.netns, "link", "add", BRIDGE, "type", "bridge"],
                 ["ip", "-n", sw.netns, "addr", "add", f"{sw.address}/{pfx}", "dev", BRIDGE],
                 ["ip", "-n", sw.netns, "link", "set", BRIDGE, "up"]]
        for i in range(self.hosts):
            h = self.host(i)
            # created inside the switch namespace with its peer straight in the host's: no name
            # ever appears in the root namespace
            cmds += [["ip", "-n", sw.netns, "link", "add", h.port, "type", "veth", "peer", "name", h.ifname, "netns",
                      h.netns],
                     ["ip", "-n", sw.netns, "link", "set", h.port, "master", BRIDGE, "up"],
                     ["ip", "-n", h.netns, "addr", "add", f"{h.address}/{pfx}", "dev", h.ifname],
                     ["ip", "-n", h.netns, "link", "set", h.ifname, "up"]]
        return cmds


def parse_name(name: str) -> tuple[int, int] | None:
    """(owner pid, sequence number) of a namespace this module names, else None."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def unavailable_reason() -> str | None:
    """Why namespaces certainly cannot be made here, or None when it is worth trying."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); run as root"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    return None


def _ip(args: Sequence[str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)


def our_namespaces() -> list[str]:
    """Names of the network namespaces this module created that exist now (any owner)."""
    res = _ip(["ip", "netns", "list"]) if shutil.which("ip") else None
    if res is None or res.returncode != 0:
        return []
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if parse_name(n)]


def _pids_in(ns: str) -> list[int]:
    res = _ip(["ip", "netns", "pids", ns])
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale() -> list[str]:
    """Delete namespaces left by runs that died without tearing down (owner pid gone, no
    process inside); returns their names."""
    removed = []
    for ns in our_namespaces():
        owner, _ = parse_name(ns)  # type: ignore[misc]
        if _alive(owner) or _pids_in(ns):
            continue
        if _ip(["ip", "netns", "del", ns]).returncode == 0:
            removed.append(ns)
    if removed:
        log.warning("removed %d network namespaces left by dead runs: %s", len(removed), ", ".join(removed))
    return removed


class HostNetwork:
    """A live network of host namespaces (see the module docstring). Use as a context manager,
    or call ``close()``; it is also closed at interpreter exit."""

    _seq = 0

    def __init__(self, plan: NetnsPlan) -> None:
        self.plan = plan
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def create(cls, hosts: int, *, sysctls: Sequence[tuple[str, str]] = DEFAULT_SYSCTLS) -> HostNetwork:
        """Build a network of ``hosts`` host namespaces; ``NetnsUnavailableError`` says why not."""
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailableError(reason)
        reap_stale()
        existing = set(our_namespaces())
        while True:
            plan = NetnsPlan(os.getpid(), cls._seq, hosts)
            cls._seq += 1
            if not existing & set(plan.namespaces):
                break
        net = cls(plan)
        try:
            for cmd in plan.setup_commands(sysctls):
                res = _ip(cmd)
                if res.returncode != 0:
                    raise NetnsUnavailableError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.returncode}")
        except BaseException:
            net.close()
            raise
        log.info("network %s: switch %s on %s, hosts %s", plan.base, plan.switch.netns, plan.subnet,
                 ", ".join(f"{h.netns}={h.address}" for h in net.hosts))
        return net

    @property
    def hosts(self) -> list[HostNet]:
        return [self.plan.host(i) for i in range(self.plan.hosts)]

    @property
    def switch(self) -> HostNet:
        return self.plan.switch

    def set_link(self, host: HostNet, up: bool) -> None:
        """Bring ``host``'s port on the bridge down (a cut cable: its peers' packets to it are
        dropped silently, no reset reaches anyone) or back up."""
        if not host.switch or not host.port:
            raise ConfigError(f"{host} is not a host of a namespace network; only those have a link to cut")
        res = _ip(["ip", "-n", host.switch, "link", "set", host.port, "up" if up else "down"])
        if res.returncode != 0:
            raise RuntimeError(f"could not set {host.port} in {host.switch} {'up' if up else 'down'}: {res.stderr}")
        log.info("link of %s (%s) %s", host.netns, host.address, "up" if up else "down")

    def traffic(self, host: HostNet) -> tuple[int, int]:
        """Bytes (to the host, from the host) that crossed ``host``'s port on the bridge so far."""
        res = _ip(["ip", "-n", host.switch or "", "-s", "-j", "link", "show", host.port or ""])
        if res.returncode != 0:
            raise RuntimeError(f"no statistics for {host.port} in {host.switch}: {res.stderr.strip()}")
        stats = json.loads(res.stdout)[0]["stats64"]
        # the switch port transmits what the host receives and receives what it sends
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def close(self) -> None:
        """Kill what still runs inside the namespaces (processes this network's users started)
        and delete every namespace, which removes the bridge, veths and addresses with them.
        Idempotent; safe on partly built networks."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        for ns in reversed(self.plan.namespaces):
            for pid in _pids_in(ns):
                if pid == os.getpid():
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        failed = []
        for ns in reversed(self.plan.namespaces):
            res = _ip(["ip", "netns", "del", ns])
            if res.returncode != 0 and "No such file" not in res.stderr:
                failed.append(f"{ns}: {res.stderr.strip()}")
        if failed:
            log.error("could not delete network namespaces (delete them with `ip netns del NAME`): %s",
                      "; ".join(failed))

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_fallback_logged = False


def try_create(hosts: int) -> tuple[HostNetwork | None, str | None]:
    """``(network, None)``, or ``(None, why not)`` where namespaces are impossible here; the first
    reason is logged once per process, and callers run their hosts on loopback instead."""
    global _fallback_logged
    try:
        return HostNetwork.create(hosts), None
    except NetnsUnavailableError as e:
        if not _fallback_logged:
            _fallback_logged = True
            log.warning("simulated hosts run on loopback: %s", e)
        return None, str(e)
