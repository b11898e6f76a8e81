"""What a worker uses: snapshot into its host's store, find live stores, build recovery tiers."""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint import SaveResult, save
from ..config import ParallelConfig
from ..ptc import PTC
from .recovery import Tier

__all__ = ["HostStore", "alive_stores", "recovery_tiers"]

log = logging.getLogger(__name__)


def _request(url: str, *, data: bytes | None = None, method: str = "GET", token: str | None = None,
             timeout: float = 2.0) -> bytes:
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def alive_stores(urls: Sequence[str], *, token: str | None = None, timeout: float = 3.0) -> list[str]:
    """The stores among ``urls`` that answer ``/health``."""
    out = []
    for url in urls:
        try:
            if json.loads(_request(f"{url.rstrip('/')}/health", token=token, timeout=timeout)).get("ok"):
                out.append(url.rstrip("/"))
        except (OSError, ValueError):
            log.info("store %s does not answer", url)
    return out


@dataclass(frozen=True)
class HostStore:
    """This host's store: its root directory (written directly: a memory copy on tmpfs) and URL."""

    root: str
    url: str
    token: str | None = None

    @classmethod
    def from_env(cls) -> HostStore | None:
        """``TENPLEX_STORE_ROOT`` and ``TENPLEX_STORE_URL`` (set per host by the launcher), or None."""
        root, url = os.environ.get("TENPLEX_STORE_ROOT"), os.environ.get("TENPLEX_STORE_URL")
        if not root or not url:
            return None
        return cls(root, url, os.environ.get("TENPLEX_STORE_TOKEN"))

    def snapshot(self, ptc: PTC, cfg: ParallelConfig, rank: int, shard: Mapping[str, Any], *, step: int,
                 replicate: bool = True) -> SaveResult:
        """Write this rank's shard into the host store, then ask the store to replicate it."""
        res = save(self.root, ptc, cfg, rank, shard, step=step)
        if replicate:
            files = [f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"]
            if rank == 0:
                files = ["manifest.json", "objects.pt", *files]
            body = json.dumps({"step_dir": os.path.basename(res.path), "files": files}).encode()
            try:
                _request(f"{self.url}/replicate", data=body, method="POST", token=self.token)
            except OSError as e:
                log.warning("could not ask %s to replicate step %d: %s", self.url, step, e)
        return res


def recovery_tiers(local: HostStore | None, store_urls: Sequence[str], persistent: str | None, *,
                   token: str | None = None) -> list[Tier]:
    """Tiers for ``load_tiered``: this host's store (read as local files), live peer stores over
    HTTP, then persistent storage."""
    tiers: list[Tier] = []
    if local is not None and os.path.isdir(local.root):
        tiers.append(Tier("local", local.root, "local"))
    others = [u for u in store_urls if local is None or u.rstrip("/") != local.url.rstrip("/")]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for url in alive_stores(others, token=token):
        tiers.append(Tier(f"peer:{url}", url, "peer", {"headers": headers} if headers else None))
    if persistent:
        tiers.append(Tier("storage", persistent, "storage"))
    return tiers
