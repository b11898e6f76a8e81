"""Token corpora for the reference trainer: fixed-length samples of token ids.

The default corpus needs no download: the Python standard library's own source files,
tokenised at byte level (ids 0-255), cut into samples of ``seq_len + 1`` tokens (inputs and
shifted targets). It is built once and cached as a flat uint16 file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
            raise ValueError(
                f"{self.path} holds {self._tokens().size} tokens, fewer than one sample of {self.seq_len + 1}"
            )

    def _tokens(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    @property
    def num_samples(self) -> int:
        return int(self._tokens().size // (self.seq_len + 1))

    def fingerprint(self) -> str:
        st = os.stat(self.path)
        return f"{os.path.basename(self.path)}:{st.st_size}"


def _cache_dir() -> Path:
    base = os.environ.get("TENPLEX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tenplex")
    path = Path(base) / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def stdlib_corpus(seq_len: int, *, max_bytes: int = 8 << 20) -> TokenCorpus:
    """Byte-level corpus of the standard library's ``.py`` files (sorted paths), cached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
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
