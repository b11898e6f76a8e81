"""A FUSE view of a dataset partitioned across DP ranks, re-shardable in place (docs/vfs.md).

The tree (:mod:`tenplex.vfs.tree`) is pure and tested without mounting; :mod:`tenplex.vfs.fuse`
is the thin mfusepy adapter; :mod:`tenplex.vfs.control` serves and sends re-shard requests.
Importing this package does not load libfuse (:mod:`tenplex.vfs.fuse` imports mfusepy when a
mount starts).
"""

from .control import mount_status, remount, socket_path
from .fuse import mount, unmount
from .tree import DatasetTree, DataView, Generation, Node, VfsError, gen_name, rank_name

__all__ = ["DatasetTree", "Generation", "DataView", "Node", "VfsError", "gen_name", "rank_name", "remount",
           "mount_status", "socket_path", "mount", "unmount"]
