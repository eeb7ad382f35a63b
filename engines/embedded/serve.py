"""``prefect-rl serve``: one embedded engine in this process, served over HTTP (no Ray).

The one place that builds an engine and a server together, so neither the engine
nor the server module imports the other at load.
"""

from __future__ import annotations

from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_base import ServerSettings
from engines.embedded.http_server import serve_forever
from engines.security import require_token


def serve_model(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    weight_version: str = "0",
    api_key: str | None = None,
    allowed_roots: tuple[str, ...] = (),
    gpu: bool = False,
) -> None:
    """Load ``model_path`` into an in-process embedded engine and serve it until stopped."""
    require_token(host, api_key)  # fail before the model loads
    cfg = EngineConfig(num_gpus_per_engine=1.0 if gpu else 0.0)
    engine = EmbeddedEngine(model_path, 0, cfg, weight_version=int(weight_version))
    roots = (*allowed_roots, model_path)
    serve_forever(engine, ServerSettings(host, port, api_key, roots))
