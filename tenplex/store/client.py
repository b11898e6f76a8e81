"""What a worker uses: snapshot into its host's store, find live stores, build recovery tiers."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..checkpoint.format import part_files
from ..checkpoint.writer import SaveResult, save
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC
from .auth import TOKEN_ENV, store_token
from .tiers import Tier

__all__ = ["HostStore", "alive_stores", "recovery_tiers", "peer_storage_options", "PEER_TIMEOUT"]

log = logging.getLogger(__name__)

PEER_TIMEOUT = 5.0
"""Seconds a peer store may stay silent (connect: at most 2) before recovery moves to the next tier."""


def _request(url: str, *, data: bytes | None = None, method: str = "GET", token: str | None = None,
             timeout: float = 2.0) -> bytes:
    """One request to a store, with the token (``token``, else ``store_token()``)."""
    req = urllib.request.Request(url, data=data, method=method)
    token = store_token(token)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _alive(url: str, token: str | None, timeout: float) -> bool:
    try:
        return bool(json.loads(_request(f"{url}/health", token=token, timeout=timeout)).get("ok"))
    except urllib.error.HTTPError as e:
        hint = f" (wrong or missing token: set {TOKEN_ENV} or the token file)" if e.code == 401 else ""
        log.warning("store %s answers /health with HTTP %d%s", url, e.code, hint)
    except (OSError, ValueError) as e:
        log.info("store %s does not answer: %s", url, e)
    return False


def alive_stores(urls: Sequence[str], *, token: str | None = None, timeout: float = 2.0) -> list[str]:
    """The stores among ``urls`` whose ``/health`` says ok within ``timeout`` seconds (asked at once)."""
    urls = [u.rstrip("/") for u in urls]
    if not urls:
        return []
    token = store_token(token)
    with ThreadPoolExecutor(max_workers=min(16, len(urls)), thread_name_prefix="tenplex-health") as pool:
        ok = list(pool.map(lambda u: _alive(u, token, timeout), urls))
    return [u for u, good in zip(urls, ok) if good]


def peer_storage_options(token: str | None = None, timeout: float = PEER_TIMEOUT) -> dict[str, Any]:
    """fsspec HTTP storage options for reading a peer store: the token header and short timeouts
    (aiohttp's default would wait 300 s on a stalled peer)."""
    import aiohttp

    token = store_token(token)
    options: dict[str, Any] = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(
        total=None, sock_connect=min(2.0, timeout), sock_read=timeout)}}
    if token:
        options["headers"] = {"Authorization": f"Bearer {token}"}
    return options


@dataclass(frozen=True)
class HostStore:
    """This host's store: its root directory (written directly: a memory copy on tmpfs) and URL.

    ``token``: the stores' shared token; None finds it as ``tenplex.store.auth.store_token``
    does (``TENPLEX_STORE_TOKEN``, ``TENPLEX_STORE_TOKEN_FILE``, the user's token file)."""

    root: str
    url: str
    token: str | None = None

    @classmethod
    def from_env(cls) -> HostStore | None:
        """``TENPLEX_STORE_ROOT`` and ``TENPLEX_STORE_URL`` (set per host by the launcher), or None;
        the token from ``TENPLEX_STORE_TOKEN`` or a token file."""
        root, url = os.environ.get("TENPLEX_STORE_ROOT"), os.environ.get("TENPLEX_STORE_URL")
        if not root or not url:
            return None
        return cls(root, url, store_token())

    def snapshot(self, ptc: PTC, cfg: ParallelConfig, rank: int, shard: Mapping[str, Any], *, step: int,
                 replicate: bool = True, save_id: str | None = None) -> SaveResult:
        """Write this rank's shard into the host store, then ask the store to replicate it.
        ``save_id``: as for ``tenplex.save`` (default: ``default_save_id``)."""
        res = save(self.root, ptc, cfg, rank, shard, step=step, save_id=save_id)
        if replicate:
            body = json.dumps({"step_dir": os.path.basename(res.path), "files": part_files(rank)}).encode()
            try:
                _request(f"{self.url}/replicate", data=body, method="POST", token=self.token)
            except OSError as e:
                log.warning("could not ask %s to replicate step %d: %s", self.url, step, e)
        return res


def recovery_tiers(local: HostStore | None, store_urls: Sequence[str], persistent: str | None, *,
                   token: str | None = None, timeout: float = PEER_TIMEOUT) -> list[Tier]:
    """Tiers for ``load_tiered``: this host's store (read as local files), live peer stores over
    HTTP, then persistent storage.

    ``token``: default ``local.token``, else ``store_token()``. ``timeout``: a peer silent
    this long (``/health`` or a read) is given up, and the read falls back to the next tier."""
    tiers: list[Tier] = []
    if local is not None and os.path.isdir(local.root):
        tiers.append(Tier("local", local.root, "local"))
    others = [u for u in store_urls if local is None or u.rstrip("/") != local.url.rstrip("/")]
    token = store_token(token or (local.token if local is not None else None))
    options = peer_storage_options(token, timeout)
    # the whole timeout for /health too: a peer busy at start-up is no dead one (its steps would be missed)
    for url in alive_stores(others, token=token, timeout=timeout):
        tiers.append(Tier(f"peer:{url}", url, "peer", options))
    if persistent:
        tiers.append(Tier("storage", persistent, "storage"))
    return tiers
