"""Thin FUSE adapter (mfusepy over libfuse3) around :class:`~tenplex.vfs.tree.DatasetTree`.

The mount is read-only, multithreaded and uses the kernel page cache (``kernel_cache``):
safe because every generation's files are immutable. Reads that hit a missing or shrunk
source return EIO (logged) and the mount stays up. SIGTERM / SIGINT end libfuse's loop,
which unmounts; the control socket is removed on the way out.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..data.index import DataIndexError, SourceReadError, load_index
from .control import ControlServer, check_not_stale, socket_path
from .tree import DIR, FILE, DataView, DatasetTree, VfsError

__all__ = ["mount", "spawn_mount", "check_fuse", "check_mountpoint", "unmount", "FUSE_LIBRARY", "FuseOps", "fuse_class",
           "mfusepy"]

log = logging.getLogger(__name__)
FUSE_LIBRARY = "fuse3"


def mfusepy() -> Any:
    """The mfusepy module, imported bound to libfuse3 (it reads FUSE_LIBRARY_NAME at import);
    :class:`VfsError` with a fix when FUSE is not installed."""
    os.environ.setdefault("FUSE_LIBRARY_NAME", FUSE_LIBRARY)
    try:
        import mfusepy as module
    except (OSError, ImportError) as e:
        raise VfsError(f"FUSE is not available ({e}): install libfuse3 (Debian: apt-get install fuse3, or run "
                       "scripts/setup_system.sh) and the Python package mfusepy") from None
    return module


def check_fuse() -> None:
    """Raise :class:`VfsError` with a fix when this machine cannot mount FUSE file systems."""
    if not os.path.exists("/dev/fuse"):
        raise VfsError("/dev/fuse does not exist: load the fuse kernel module (modprobe fuse) or, in a container, "
                       "run with --device /dev/fuse --cap-add SYS_ADMIN")
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise VfsError("fusermount3 is not installed: install the Debian package fuse3 (scripts/setup_system.sh)")
    mfusepy()


def check_mountpoint(mountpoint: str) -> str:
    """The mountpoint's absolute path, after checking that a mount can go there."""
    path = os.path.abspath(mountpoint)
    check_not_stale(path)
    if not os.path.exists(path):
        raise VfsError(f"mountpoint {path} does not exist: create it first (mkdir -p {path})")
    if not os.path.isdir(path):
        raise VfsError(f"mountpoint {path} is not a directory: pass an empty directory")
    if os.path.ismount(path):
        raise VfsError(f"{path} is already a mount point: unmount it first (fusermount3 -u {path})")
    return path


class FuseOps:
    """mfusepy operations: translate calls into :class:`DatasetTree` calls and errnos."""

    use_ns = True

    def __init__(self, tree: DatasetTree, mfusepy: Any) -> None:
        self.tree = tree
        self._err = mfusepy.FuseOSError
        self.started = False

    def init(self, path: str) -> None:
        """libfuse is serving: a later non-zero exit status means a signal ended the loop, not a failure."""
        self.started = True

    def _node(self, path: str) -> Any:
        node = self.tree.lookup(path)
        if node is None:
            raise self._err(errno.ENOENT)
        return node

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        return self._node(path).attrs()

    def readdir_with_offset(self, path: str, offset: int, fh: int) -> Iterator[tuple[str, None, int]]:
        """Entries from position ``offset`` on, each with the offset of the next one.

        libfuse stops taking entries when the kernel's buffer is full and asks again from the
        last offset, so a root with a million ranks is listed page by page without building
        the list (``Names`` computes a name from its position).
        """
        node = self._node(path)
        if node.kind != DIR:
            raise self._err(errno.ENOTDIR)
        return self._entries(node.entries, offset)

    @staticmethod
    def _entries(names: Sequence[str], offset: int) -> Iterator[tuple[str, None, int]]:
        for k in range(max(offset, 0), len(names) + 2):
            yield ("." if k == 0 else ".." if k == 1 else names[k - 2]), None, k + 1

    def readlink(self, path: str) -> str:
        node = self._node(path)
        if node.kind != "link":
            raise self._err(errno.EINVAL)
        return node.target

    def open(self, path: str, flags: int) -> int:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise self._err(errno.EROFS)
        node = self._node(path)
        if node.kind != FILE:
            raise self._err(errno.EISDIR)
        try:
            return self.tree.open(path)
        except FileNotFoundError:
            raise self._err(errno.ENOENT) from None

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        """Plain mfusepy read (its presence makes mfusepy wire the callback; ZeroCopyFUSE bypasses it)."""
        buf = bytearray(size)
        n = self.read_into(fh, offset, memoryview(buf))
        return bytes(buf[:n])

    def read_into(self, fh: int, offset: int, buf: memoryview) -> int:
        """Fill libfuse's reply buffer directly (see :func:`fuse_class`)."""
        try:
            return self.tree.read_handle_into(fh, offset, buf)
        except SourceReadError as e:
            log.error("read of handle %d [%d, +%d): %s -> EIO", fh, offset, len(buf), e.strerror)
            raise self._err(errno.EIO) from None
        except FileNotFoundError:
            raise self._err(errno.EBADF) from None

    def source_pieces(self, fh: int, offset: int, size: int) -> Any:
        """(descriptors, positions, lengths) for libfuse to read, or None (see :func:`fuse_class`)."""
        try:
            return self.tree.source_pieces(fh, offset, size)
        except SourceReadError as e:
            log.error("read of handle %d [%d, +%d): %s -> EIO", fh, offset, size, e.strerror)
            raise self._err(errno.EIO) from None
        except FileNotFoundError:
            raise self._err(errno.EBADF) from None

    def release(self, path: str, fh: int) -> int:
        self.tree.release(fh)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0, "f_bavail": 0, "f_namemax": 255}

    def access(self, path: str, amode: int) -> int:
        self._node(path)
        if amode & os.W_OK:
            raise self._err(errno.EROFS)
        return 0


# struct fuse_bufvec {size_t count, idx, off; struct fuse_buf buf[count];} with, in libfuse 3.0-3.16,
# struct fuse_buf {size_t size; enum flags; void *mem; int fd; off_t pos;} (40 bytes on 64-bit Linux)
_BUF_DTYPE = np.dtype([("size", "<u8"), ("flags", "<i4"), ("_p1", "<i4"), ("mem", "<u8"), ("fd", "<i4"),
                       ("_p2", "<i4"), ("pos", "<i8")])
_BUFVEC_HEADER = 24
_FUSE_BUF_IS_FD_SEEK = (1 << 1) | (1 << 2)  # FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK


def _read_buf_supported(mfusepy: Any) -> bool:
    """Whether the fuse_buf layout above is this libfuse's (64-bit Linux, libfuse 3.0-3.16)."""
    major, minor = getattr(mfusepy, "fuse_version_major", 0), getattr(mfusepy, "fuse_version_minor", 0)
    return (sys.platform.startswith("linux") and ctypes.sizeof(ctypes.c_void_p) == 8 and major == 3 and minor < 17
            and _BUF_DTYPE.itemsize == 40)


def _keep_reply_buffers() -> None:
    """Best effort (glibc): keep freed memory instead of returning it to the kernel.

    libfuse allocates a fresh reply buffer per read (1 MiB with the raised read-ahead); with
    glibc's defaults these are mmapped or trimmed on free, so every request page-faults and
    zeroes a megabyte, which after a few generations cost more than the reads themselves.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 64 << 20)
    mallopt(m_trim_threshold, 256 << 20)


def _served_by_fuse_class(*args: Any) -> int:
    raise NotImplementedError("read_buf is handled by the FUSE class (fuse_class)")


def fuse_class(mfusepy: Any) -> Any:
    """mfusepy.FUSE (of the module ``mfusepy``) with fast reads.

    ``samples.bin`` reads go through libfuse's ``read_buf``: the callback only describes the
    request as (descriptor, position, length) pieces of the source files, built with numpy,
    and libfuse reads them in C into its reply buffer, so the cost in Python is per request,
    not per sample. Other files (and remote sources) are read by ``read_into`` straight into a
    buffer that libfuse frees. Without a known ``fuse_buf`` layout the plain ``read`` callback
    fills libfuse's buffer in place.
    """
    libc = ctypes.CDLL(None)
    malloc = libc.malloc
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]

    class FastReadFUSE(mfusepy.FUSE):  # type: ignore[misc, name-defined]
        def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
            addr = ctypes.cast(buf, ctypes.c_void_p).value
            view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
            return self.operations.read_into(fip.contents.fh, offset, view)

        def read_buf(self, path: bytes | None, bufpp: Any, size: int, offset: int, fip: Any) -> int:
            fh = fip.contents.fh
            pieces = self.operations.source_pieces(fh, offset, size)
            if pieces is None:  # generated text, remote source: read here into memory libfuse frees
                mem = malloc(max(size, 1))
                if not mem:
                    return -errno.ENOMEM
                view = memoryview((ctypes.c_char * size).from_address(mem)).cast("B")
                try:
                    n = self.operations.read_into(fh, offset, view)
                except BaseException:
                    libc.free(ctypes.c_void_p(mem))
                    raise
                vec = np.zeros(1, _BUF_DTYPE)
                vec["size"], vec["mem"] = n, mem
            else:
                fds, pos, lens = pieces
                vec = np.zeros(len(fds), _BUF_DTYPE)
                vec["size"], vec["flags"], vec["fd"], vec["pos"] = lens, _FUSE_BUF_IS_FD_SEEK, fds, pos
            head = np.array([len(vec), 0, 0], "<u8")
            nbytes = _BUFVEC_HEADER + max(len(vec), 1) * _BUF_DTYPE.itemsize
            out = malloc(nbytes)
            if not out:
                return -errno.ENOMEM
            ctypes.memmove(out, head.ctypes.data, _BUFVEC_HEADER)
            if len(vec):
                ctypes.memmove(out + _BUFVEC_HEADER, vec.ctypes.data, vec.nbytes)
            bufpp[0] = ctypes.cast(out, type(bufpp[0]))
            return 0

    if not _read_buf_supported(mfusepy):
        del FastReadFUSE.read_buf
    return FastReadFUSE


def _raise_readahead(mountpoint: str, kib: int, timeout: float = 30.0) -> None:
    """Best effort: let the kernel send reads of up to ``kib`` KiB (the FUSE bdi's read_ahead_kb; needs root).

    libfuse caps read-ahead at 128 KiB, so sequential readers would otherwise cost one
    callback per 128 KiB; the kernel still limits a request to the mount's max_pages (1 MiB).
    """
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mountpoint):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
        log.info("read-ahead of %s: %d KiB", mountpoint, kib)
    except OSError as e:
        log.info("could not raise the read-ahead of %s (%s); reads stay at 128 KiB", mountpoint, e)


def mount(index_url: str, mountpoint: str, layout: DataView, *, keep: int = 4, debug: bool = False,
          read_ahead_kib: int = 1024) -> None:
    """Mount ``index_url`` at ``mountpoint`` in the foreground until unmounted or signalled."""
    mp = check_mountpoint(mountpoint)
    check_fuse()
    fuse_mod = mfusepy()
    try:
        index = load_index(index_url)
    except DataIndexError as e:
        raise VfsError(str(e)) from None
    ctl_path = socket_path(mp)
    tree = DatasetTree(index, layout, keep=keep, extra={"index": index_url, "control": ctl_path})
    control = ControlServer(tree, ctl_path).start()
    # the mount's own `mfusepy` class needs the Operations base for its introspection
    # read_buf is served by the FUSE class itself; the operations only need the name for mfusepy to wire it
    fast = {"read_buf": _served_by_fuse_class} if _read_buf_supported(fuse_mod) else {}
    ops = type("TenplexFS", (FuseOps, fuse_mod.Operations), fast)(tree, fuse_mod)
    log.info("mounting %s at %s: %d samples, dp=%d, progress=%d", index_url, mp, index.num_samples, layout.dp,
             layout.progress)
    _keep_reply_buffers()
    if read_ahead_kib:
        threading.Thread(target=_raise_readahead, args=(mp, read_ahead_kib), daemon=True).start()
    try:
        fuse_class(fuse_mod)(ops, mp, foreground=True, nothreads=False, ro=True, kernel_cache=True, fsname="tenplex",
                             subtype="tenplex", debug=debug)
    except RuntimeError as e:
        if ops.started:  # libfuse reports a loop ended by SIGTERM/SIGINT as status 8, after unmounting
            log.info("stopped by a signal (libfuse status %s)", e)
            return
        raise VfsError(f"could not mount at {mp} (libfuse error {e}): see the messages above; is /dev/fuse usable "
                       "and are you root or is fusermount3 installed?") from None
    finally:
        control.close()
        tree.reader.close()
        log.info("unmounted %s", mp)


def unmount(mountpoint: str, *, lazy: bool = True, timeout: float = 10.0) -> None:
    """Unmount with ``fusermount3 -u [-z]``."""
    cmd = ["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode and os.path.ismount(mountpoint):
        raise VfsError(f"could not unmount {mountpoint}: {res.stderr.strip()}")


def spawn_mount(argv: Sequence[str], mountpoint: str, *, timeout: float = 60.0, log_path: str | None = None) -> int:
    """Run ``tenplex mount ... --foreground`` detached; wait until mounted. Returns the child's pid."""
    log_path = log_path or socket_path(mountpoint)[: -len(".sock")] + ".log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "tenplex", *argv, "--foreground"], stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=logf, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(mountpoint) and os.path.exists(socket_path(mountpoint)):
            return proc.pid
        rc = proc.poll()
        if rc is not None:
            with open(log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f.read()[-4000:].splitlines() if ln.strip()]
            errors = [ln.split("error: ", 1)[1] for ln in lines if "error: " in ln]
            why = errors[-1] if errors else (lines[-1] if lines else "no output")
            raise VfsError(f"the mount process exited with status {rc}: {why} (log: {log_path})")
        time.sleep(0.05)
    proc.terminate()
    raise VfsError(f"{mountpoint} was not mounted within {timeout:.0f} s; see {log_path}")
