"""How one resident ``tensor`` update reaches an engine: its socket, or Ray.

Owns ``EngineSignals``, the producer's per-engine choice. A handle that only
names a staging buffer the engine already holds open (``full=False``) is a few
bytes, and the engine's answer is one device copy: it goes as one line on the
engine's Unix socket (``wire.update_socket``), which costs tens of
microseconds where a Ray actor call costs a millisecond or more. Everything
else (a handle in full, one handle per rank of a multi-rank engine, an engine
without a socket such as an SGLang server) is an ``update_weights_from_tensor``
Ray call, the SGLang protocol. Never decides versions or what the buffer holds.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from wire.update_socket import UpdateClient

log = logging.getLogger(__name__)


class EngineSignals:
    """Sockets of the engines this producer updates, by engine key (a restarted
    engine is a new key, so a new socket is asked for)."""

    def __init__(self) -> None:
        self._clients: dict[str, UpdateClient | None] = {}

    def update(
        self, engine: Any, key: str, handles: list, flush_cache: bool, version: str
    ) -> tuple[dict[str, Any], str]:
        """Send one resident update; (the engine's reply, "socket" or "ray"). A socket
        that fails is dropped and the update goes over Ray: applying the same buffer
        and version again is harmless if the engine had applied it already."""
        cache = handles[0].get("cache") if len(handles) == 1 else None
        if cache is not None and all(p.get("metadata") is None for p in handles[0]["parts"]):
            client = self._client(engine, key)
            if client is not None:
                try:
                    reply = client.update(cache["channel"], cache["key"], flush_cache, version)
                    return reply, "socket"
                except (OSError, ValueError) as e:
                    log.warning("weight-update socket %s failed (%s): using Ray", client.path, e)
                    client.close()
                    self._clients[key] = None
        reply = ray.get(
            engine.update_weights_from_tensor.remote(
                handles, flush_cache=flush_cache, weight_version=version
            )
        )
        return reply, "ray"

    def _client(self, engine: Any, key: str) -> UpdateClient | None:
        """The engine's socket, asked for once; None when it has none (several ranks,
        an SGLang server) or it cannot be reached from this host."""
        if key not in self._clients:
            client = None
            try:
                address = ray.get(engine.update_socket.remote())
                if address is not None:
                    client = UpdateClient(address)
            except (AttributeError, OSError, ray.exceptions.RayError) as e:
                log.info("engine %s has no reachable update socket (%s): using Ray", key, e)
            self._clients[key] = client
        return self._clients[key]

    def close(self) -> None:
        for client in self._clients.values():
            if client is not None:
                client.close()
        self._clients.clear()
