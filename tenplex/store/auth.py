"""The host stores' shared token: where it comes from, where it is kept, how it is checked.

Every request to a store carries ``Authorization: Bearer <token>``, loopback included. The
stores of one job share one token; servers and clients find it the same way, first match wins:

1. an explicit value (``StoreServer(token=...)``, ``HostStore(token=...)``, ``--token-file``);
2. ``TENPLEX_STORE_TOKEN`` (the launcher hands it to store processes and workers this way);
3. ``TENPLEX_STORE_TOKEN_FILE``, a file holding the token;
4. the user's default token file, ``store.token`` under ``$TENPLEX_RUNTIME_DIR``, else
   ``$XDG_RUNTIME_DIR/tenplex``, else ``~/.tenplex``. A server that finds none generates a
   token there (``secrets.token_urlsafe``), readable by its user only, so every store and
   client of that user on a machine agrees without configuration.

Token files must be regular files owned by the user and not readable by group or others
(mode 0600); a file that is not is refused with the ``chmod`` that fixes it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "RUNTIME_DIR_ENV", "StoreToken", "default_token_file", "resolve_token",
           "store_token"]

log = logging.getLogger(__name__)

TOKEN_ENV = "TENPLEX_STORE_TOKEN"
TOKEN_FILE_ENV = "TENPLEX_STORE_TOKEN_FILE"
RUNTIME_DIR_ENV = "TENPLEX_RUNTIME_DIR"
_MAX_TOKEN = 1024


@dataclass(frozen=True, slots=True)
class StoreToken:
    """A token and where it came from (``source``: for messages; ``path``: its file, if any)."""

    value: str
    source: str
    path: str | None = None

    def __post_init__(self) -> None:
        check_token(self.value, self.source)

    def __repr__(self) -> str:  # never print the secret
        return f"StoreToken(source={self.source!r}, path={self.path!r})"


def check_token(value: str, where: str = "the token") -> str:
    """``value`` if it can travel in an HTTP header: 1 to 1024 visible ASCII characters."""
    if not value or len(value) > _MAX_TOKEN or not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise ConfigError(f"{where}: a store token must be 1 to {_MAX_TOKEN} visible ASCII characters without "
                          f"spaces (got {len(value)} characters); generate one with "
                          "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return value


def default_token_file() -> Path:
    """``store.token`` in the user's runtime directory (see the module docstring)."""
    base = os.environ.get(RUNTIME_DIR_ENV)
    if not base and os.environ.get("XDG_RUNTIME_DIR"):
        base = os.path.join(os.environ["XDG_RUNTIME_DIR"], "tenplex")
    return Path(base or Path.home() / ".tenplex") / "store.token"


def _check_private(st: os.stat_result, path: Path, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                          f"use a {what} of your own (set {TOKEN_FILE_ENV} or {RUNTIME_DIR_ENV})")
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        fix = "700" if stat.S_ISDIR(st.st_mode) else "600"
        raise ConfigError(f"{what} {path} is accessible by group or others (mode {mode:04o}); "
                          f"run `chmod {fix} {path}`")


def _read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path``: a regular file of this user, mode 0600, not a symlink."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"token file {p} does not exist: start a store once to generate it, or write one "
                          "(mode 0600)") from None
    except OSError as e:
        raise ConfigError(f"cannot open token file {p} ({e.strerror}); it must be a regular file, not a "
                          "symlink") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"token file {p} is not a regular file")
        _check_private(st, p, "token file")
        raw = os.read(fd, _MAX_TOKEN + 2)
    finally:
        os.close(fd)
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    return check_token(text, f"token file {p}")


def _write_token_file(path: str | os.PathLike[str], token: str) -> bool:
    """Write ``token`` to ``path`` (mode 0600, parent directory 0700) unless the file exists.

    Returns whether this call wrote it: two stores starting at once agree on the first one
    written (a hard link makes the whole file appear at once)."""
    p = Path(path)
    check_token(token, str(p))
    parent = p.parent
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the token directory {parent} ({e.strerror}); set {TOKEN_FILE_ENV} "
                          f"or {RUNTIME_DIR_ENV} to a directory you own") from None
    _check_private(os.lstat(parent), parent, "token directory")
    tmp = parent / f".{p.name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (token + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, p)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def resolve_token(token: str | None = None, *, token_file: str | os.PathLike[str] | None = None,
                  create: bool = False) -> StoreToken | None:
    """The token to use (see the module docstring for the order); None when there is none.

    ``create``: generate one into the default token file when nothing else gives one (servers)."""
    if token:
        return StoreToken(token, "the given token")
    if token_file:
        return StoreToken(_read_token_file(token_file), f"token file {token_file}", str(token_file))
    if os.environ.get(TOKEN_ENV):
        return StoreToken(os.environ[TOKEN_ENV], TOKEN_ENV)
    if os.environ.get(TOKEN_FILE_ENV):
        path = os.environ[TOKEN_FILE_ENV]
        return StoreToken(_read_token_file(path), f"token file {path} ({TOKEN_FILE_ENV})", path)
    path = default_token_file()
    if create and not os.path.lexists(path):
        if _write_token_file(path, secrets.token_urlsafe(32)):
            log.info("generated a store token into %s (mode 0600)", path)
            return StoreToken(_read_token_file(path), f"generated into {path}", str(path))
    if os.path.lexists(path):
        return StoreToken(_read_token_file(path), f"token file {path}", str(path))
    return None


def store_token(token: str | None = None) -> str | None:
    """The token a client sends: ``token`` if given, else the environment or the default token file."""
    found = resolve_token(token)
    return found.value if found else None
