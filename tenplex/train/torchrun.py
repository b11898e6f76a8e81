"""``python -m tenplex.train.torchrun``: torchrun with a rendezvous backend that rides out an etcd leader election.

torchrun's ``etcd-v2`` backend turns any failed etcd request into ``RendezvousConnectionError``, and the
agent exits on it. When the host of the etcd leader dies, the remaining members elect a new leader
(the cluster's election timeout, ``ELECTION_MS`` in ``tenplex.train.etcd``); a surviving agent that restarts its
workers at that moment (the dead host's workers took the others' collectives with them) writes the
rendezvous state during the election, fails, and exits, which closes the rendezvous for the other
survivors too (seen in ``tests/test_etcd_hosts.py``: both survivors exited 1). The backend registered
here as ``tenplex-etcd`` is torchrun's own ``etcd-v2`` backend with every state read and
compare-and-set retried on a connection error for up to ``retry_s`` seconds (``--rdzv-conf
retry_s=...``, default 15). A retried compare-and-set is safe: if the lost attempt was applied, the
retry's token is stale, etcd refuses it and the handler re-reads the state, as after any conflict.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousHandler
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler
from torch.distributed.run import main as torchrun

__all__ = ["BACKEND", "RetryingBackend", "main"]

log = logging.getLogger(__name__)

BACKEND = "tenplex-etcd"  # torchrun --rdzv-backend=tenplex-etcd (this module's entry point registers it)
RETRY_S = 15.0


class RetryingBackend(RendezvousBackend):
    """``backend``'s reads and compare-and-sets, each retried on ``RendezvousConnectionError`` with a
    growing pause (50 ms doubling to 1 s) until ``retry_s`` seconds have passed; then the error goes up."""

    def __init__(self, backend: RendezvousBackend, retry_s: float = RETRY_S) -> None:
        self.backend, self.retry_s = backend, retry_s

    @property
    def name(self) -> str:
        return BACKEND

    def _retried(self, what: str, call: Any, *args: Any) -> Any:
        deadline, pause, tries = time.monotonic() + self.retry_s, 0.05, 0
        while True:
            try:
                result = call(*args)
            except RendezvousConnectionError as e:
                tries += 1
                if time.monotonic() + pause > deadline:
                    raise RendezvousConnectionError(f"{what}: etcd unreachable for {self.retry_s:.0f} s "
                                                    f"({tries} tries): {e.__cause__ or e}") from e
                log.warning("rendezvous %s: %s (%s); retrying in %.2f s", what, e, e.__cause__, pause)
                time.sleep(pause)
                pause = min(1.0, 2 * pause)
                continue
            if tries:
                log.warning("rendezvous %s went through after %d retries", what, tries)
            return result

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._retried("get_state", self.backend.get_state)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        return self._retried("set_state", self.backend.set_state, state, token)


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend  # lazy: python-etcd

    retry_s = float(params.config.pop("retry_s", RETRY_S))
    backend, store = create_backend(params)
    return create_handler(store, RetryingBackend(backend, retry_s), params)


def main(argv: list[str] | None = None) -> None:
    """torchrun (``torch.distributed.run``) with the ``tenplex-etcd`` backend registered."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    torchrun(argv)


if __name__ == "__main__":
    main()
