"""The job secret that authenticates membership records and liveness links (issue 31, item 5).

The membership store (a c10d ``TCPStore``) and the members' liveness ports accept any connection:
whoever reaches them could register a joiner, flag a failure, write a decision, or open a link to a
member and drop it (which looks like a death). So every record a member writes to the store is
signed, and every liveness link starts with a challenge-response in both directions:

* the secret is the host stores' token (:func:`tenplex.store.auth.resolve_token`:
  ``TENPLEX_STORE_TOKEN``, ``TENPLEX_STORE_TOKEN_FILE``, the user's token file; the launcher hands
  one to every worker), and the key a job uses is derived from it and the job's scope (the
  membership prefix, which holds a fresh nonce per launch): records of another job or launch do
  not verify;
* a record is ``m1:<hex HMAC-SHA256>:<payload>``, the HMAC over the store key and the payload: a
  record copied to another key (another member's heartbeat, another round's decision) does not
  verify; heartbeats carry a sequence number, and an observer only counts one above the last it
  saw, so a replayed record is no news;
* no secret found: the records and handshakes still run, keyed by a public constant (they then
  reject junk and stale formats, not forgeries), with a one-time warning; with
  ``TENPLEX_MEMBERSHIP_STRICT=1`` the job refuses to start instead.

Pure apart from reading the secret (:meth:`JobSecret.resolve`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError
from ..store.auth import TOKEN_ENV, TOKEN_FILE_ENV, resolve_token

__all__ = ["JobSecret", "STRICT_ENV", "encode_beat", "decode_beat"]

log = logging.getLogger(__name__)

STRICT_ENV = "TENPLEX_MEMBERSHIP_STRICT"
"""``1``: refuse to run membership without a secret (instead of the unauthenticated mode)."""

_VERSION = "m1"
_MAC_HEX = 64
_OPEN_KEY = b"tenplex membership: no secret configured"  # public: integrity only, no authentication
_warned = False


@dataclass(frozen=True, slots=True)
class JobSecret:
    """A key that signs and checks membership records and link handshakes.

    ``key``: the HMAC key (derived; never the token itself); ``source``: where the secret came from
    (for messages); ``authenticated``: False in the unauthenticated mode (a public key)."""

    key: bytes
    source: str
    authenticated: bool = True

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ConfigError(f"a job secret key must have at least 16 bytes, got {len(self.key)}")

    def __repr__(self) -> str:  # never print the key
        return f"JobSecret(source={self.source!r}, authenticated={self.authenticated})"

    @classmethod
    def resolve(cls, secret: str | bytes | None = None, *, strict: bool | None = None) -> JobSecret:
        """The job's secret: ``secret`` if given, else the stores' token (see the module docstring).

        No secret: ConfigError when ``strict`` (default: ``$TENPLEX_MEMBERSHIP_STRICT`` is 1), else
        the unauthenticated mode, with one warning per process."""
        global _warned
        if secret:
            raw = secret.encode() if isinstance(secret, str) else bytes(secret)
            return cls(hashlib.sha256(b"tenplex job secret\0" + raw).digest(), "the given secret")
        found = resolve_token()
        if found is not None:
            return cls(hashlib.sha256(b"tenplex job secret\0" + found.value.encode()).digest(), found.source)
        if strict if strict is not None else os.environ.get(STRICT_ENV, "") == "1":
            raise ConfigError(f"{STRICT_ENV}=1 and no job secret: set {TOKEN_ENV} or {TOKEN_FILE_ENV} (the same in "
                              "every worker and joiner of the job)")
        if not _warned:
            _warned = True
            log.warning("no job secret (%s, %s or the user's token file): membership records and liveness links "
                        "are NOT authenticated; any process that reaches the membership store or a member's link "
                        "port can join the job or fake a failure. Set %s=1 to refuse this.", TOKEN_ENV,
                        TOKEN_FILE_ENV, STRICT_ENV)
        return cls.unauthenticated()

    @classmethod
    def unauthenticated(cls) -> JobSecret:
        """The public key of the unauthenticated mode (records and handshakes check integrity only)."""
        return cls(hashlib.sha256(_OPEN_KEY).digest(), "none (unauthenticated)", authenticated=False)

    def scoped(self, scope: str) -> JobSecret:
        """The key of one job (launch): records signed under another scope do not verify."""
        key = hmac.new(self.key, b"scope\0" + scope.encode(), hashlib.sha256).digest()
        return JobSecret(key, self.source, self.authenticated)

    def fingerprint(self) -> str:
        """A short value that tells whether two processes hold the same key (reveals nothing usable)."""
        return hmac.new(self.key, b"fingerprint", hashlib.sha256).hexdigest()[:16]

    # -- store records -------------------------------------------------------------------------
    def _mac(self, store_key: str, payload: str) -> str:
        return hmac.new(self.key, store_key.encode() + b"\0" + payload.encode(), hashlib.sha256).hexdigest()

    def sign(self, store_key: str, payload: str) -> str:
        """The record to store under ``store_key`` (bound to it: it verifies there only)."""
        return f"{_VERSION}:{self._mac(store_key, payload)}:{payload}"

    def open(self, store_key: str, raw: bytes | str | None) -> str | None:
        """The payload of the record ``raw`` read from ``store_key``; None when it does not verify."""
        if raw is None:
            return None
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            return None
        version, _, rest = text.partition(":")
        mac, _, payload = rest.partition(":")
        if version != _VERSION or len(mac) != _MAC_HEX:
            return None
        return payload if hmac.compare_digest(mac, self._mac(store_key, payload)) else None

    def entry(self, store_key: str, payload: str) -> str:
        """A signed entry to append to the list at ``store_key`` (separators on both sides: junk an
        outsider appended without one corrupts only itself)."""
        if "," in payload:
            raise ConfigError(f"a list entry cannot hold a comma: {payload!r}")
        return f",{self.sign(store_key, payload)},"

    def entries(self, store_key: str, raw: bytes | str) -> tuple[list[str], int]:
        """(the payloads of the valid entries of the list at ``store_key``, first occurrence of each, in
        order of arrival; the number of entries that did not verify)."""
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        good: list[str] = []
        bad = 0
        for part in text.split(","):
            if not part:
                continue
            payload = self.open(store_key, part)
            if payload is None:
                bad += 1
            elif payload not in good:
                good.append(payload)
        return good, bad

    # -- link handshake ------------------------------------------------------------------------
    def link_mac(self, label: bytes, *parts: bytes) -> bytes:
        """HMAC (32 bytes) over a handshake message: ``label`` names its direction (no reflection)."""
        h = hmac.new(self.key, b"link\0" + label, hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(2, "big") + p)
        return h.digest()


def encode_beat(seq: int, vouch: Iterable[int]) -> str:
    """A heartbeat's payload: its sequence number and the peers whose open links it vouches for."""
    return f"{int(seq)};{'.'.join(str(int(v)) for v in sorted(set(vouch)))}"


def decode_beat(payload: str) -> tuple[int, frozenset[int]] | None:
    """(sequence, vouched peers) of a heartbeat payload; None when it is not one."""
    seq, sep, vouch = payload.partition(";")
    if not sep:
        return None
    try:
        return int(seq), frozenset(int(v) for v in vouch.split(".") if v)
    except ValueError:
        return None
