"""Per-host tensor stores, replication and tiered recovery."""

from .auth import StoreToken, default_token_file, resolve_token, store_token
from .client import PEER_TIMEOUT, HostStore, alive_stores, peer_storage_options, recovery_tiers
from .recovery import TieredLoad, load_tiered
from .tiers import Tier, usable_steps
from .server import StoreOptions, StoreServer, serve, step_complete

__all__ = ["HostStore", "alive_stores", "recovery_tiers", "peer_storage_options", "PEER_TIMEOUT", "Tier",
           "TieredLoad", "load_tiered", "usable_steps", "StoreOptions", "StoreServer", "serve", "step_complete",
           "StoreToken", "default_token_file", "resolve_token", "store_token"]
