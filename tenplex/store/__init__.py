"""Per-host tensor stores, replication and tiered recovery."""

from .client import HostStore, alive_stores, recovery_tiers
from .recovery import Tier, TieredLoad, load_tiered, usable_steps
from .server import StoreServer, serve

__all__ = ["HostStore", "alive_stores", "recovery_tiers", "Tier", "TieredLoad", "load_tiered", "usable_steps",
           "StoreServer", "serve"]
