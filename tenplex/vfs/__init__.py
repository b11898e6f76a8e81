"""A FUSE view of a dataset partitioned across DP ranks, re-shardable in place (docs/vfs.md).

The tree (:mod:`tenplex.vfs.tree`) is pure and tested without mounting; :mod:`tenplex.vfs.fuse`
is the thin mfusepy adapter; :mod:`tenplex.vfs.control` serves and sends re-shard requests.
Importing this package does not load libfuse.
"""

from .control import mount_status, remount, socket_path
from .tree import DatasetTree, Generation, Layout, Node, VfsError, gen_name, rank_name

__all__ = ["DatasetTree", "Generation", "Layout", "Node", "VfsError", "gen_name", "rank_name", "remount",
           "mount_status", "socket_path", "mount", "unmount"]


def mount(*args, **kwargs):  # type: ignore[no-untyped-def]
    """See :func:`tenplex.vfs.fuse.mount` (imported lazily: it loads libfuse)."""
    from .fuse import mount as _mount

    return _mount(*args, **kwargs)


def unmount(*args, **kwargs):  # type: ignore[no-untyped-def]
    """See :func:`tenplex.vfs.fuse.unmount`."""
    from .fuse import unmount as _unmount

    return _unmount(*args, **kwargs)
