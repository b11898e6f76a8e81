"""Token corpora for the reference trainer: fixed-length samples of token ids.

The default corpus needs no download: the Python standard library's own source files,
tokenised at byte level (ids 0-255), cut into samples of ``seq_len + 1`` tokens (inputs and
shifted targets). It is built once and cached as a flat uint16 file.

A corpus is identified by the SHA-256 of its bytes (``TokenCorpus.fingerprint``), which a
checkpoint's data state records, so a resume notices other data under the same name and size.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataIndexError

__all__ = ["TokenCorpus", "stdlib_corpus", "BYTE_VOCAB"]

log = logging.getLogger(__name__)
BYTE_VOCAB = 256


@dataclass(frozen=True)
class TokenCorpus:
    """A flat token file viewed as samples of ``seq_len + 1`` tokens."""

    path: str
    seq_len: int
    dtype: str = "uint16"

    def __post_init__(self) -> None:
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"token file {self.path} does not exist")
        if self.num_samples < 1:
            raise DataIndexError(
                f"{self.path} holds {self._tokens().size} tokens, fewer than one sample of {self.seq_len + 1}"
            )

    def _tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    @property
    def num_samples(self) -> int:
        return int(self._tokens().size // (self.seq_len + 1))

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the token file's bytes: names the content, not the file, so other
        tokens under the same name and size differ (see :func:`_file_sha256` for the cache)."""
        return f"sha256:{_file_sha256(self.path)}"


SIDECAR_SUFFIX = ".sha256"
_STAT_KEY = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino")


def _stat_key(st: os.stat_result) -> dict[str, int]:
    return {k: int(getattr(st, k)) for k in _STAT_KEY}


def _cached_digest(sidecar: str, key: dict[str, int]) -> str | None:
    try:
        with open(sidecar) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    digest = obj.get("sha256")
    if obj.get("stat") != key or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    return digest


def _file_sha256(path: str) -> str:
    """SHA-256 (hex) of a file's bytes, cached in the sidecar ``<path>.sha256``.

    The sidecar is trusted only while the file's size, mtime, ctime and inode are the ones it
    records: any write (even one that restores the mtime, which cannot restore the ctime) or a
    replacement makes the next call hash again. A large corpus is thus hashed once per version
    (about 1-2 GB/s), not at every start. Processes starting together on one host hash it once:
    the hashing holds an exclusive ``flock`` on the file and the others then read the sidecar.
    Where the sidecar cannot be written (a read-only directory) every call hashes.
    """
    sidecar = path + SIDECAR_SUFFIX
    digest = _cached_digest(sidecar, _stat_key(os.stat(path)))
    if digest is not None:
        return digest
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock: hash without the lock
            pass
        key = _stat_key(os.fstat(f.fileno()))
        digest = _cached_digest(sidecar, key)  # another process may have hashed it meanwhile
        if digest is not None:
            return digest
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if _stat_key(os.fstat(f.fileno())) != key:  # changed while hashing: do not cache a digest of a mix
            log.warning("%s changed while it was hashed; its fingerprint is not cached", path)
            return digest
        tmp = f"{sidecar}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as out:
                json.dump({"sha256": digest, "stat": key}, out)
            os.replace(tmp, sidecar)
        except OSError as e:
            log.info("cannot cache the fingerprint of %s in %s (%s): it is hashed at every start", path, sidecar, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
    log.info("hashed %s: sha256 %s", path, digest)
    return digest


def _cache_dir() -> Path:
    base = os.environ.get("TENPLEX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tenplex")
    path = Path(base) / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _stdlib_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside ``site-packages`` and ``test`` directories; those
    directories are pruned, not walked (a venv's site-packages made every start-up walk 2 s)."""
    out: list[Path] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "test")]
        out.extend(Path(d) / n for n in names if n.endswith(".py"))
    return out


def stdlib_corpus(seq_len: int, *, max_bytes: int = 8 << 20) -> TokenCorpus:
    """Byte-level corpus of the standard library's ``.py`` files (sorted paths), cached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_stdlib_files(root))
    key = hashlib.sha256(f"{root}|{len(files)}|{max_bytes}".encode()).hexdigest()[:12]
    path = _cache_dir() / f"stdlib-{key}.u16"
    if not path.exists():
        buf = bytearray()
        for f in files:
            try:
                buf += f.read_bytes()
            except OSError:
                continue
            if len(buf) >= max_bytes:
                break
        tokens = np.frombuffer(bytes(buf[:max_bytes]), dtype=np.uint8).astype(np.uint16)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tokens.tofile(tmp)
        os.replace(tmp, path)
        log.info("built the stdlib corpus: %d tokens from %d files -> %s", tokens.size, len(files), path)
    return TokenCorpus(str(path), seq_len)
