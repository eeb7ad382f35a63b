"""SGLang's in-memory update endpoints over HTTP on an in-process embedded engine:
/update_weights_from_tensor (shared-memory bucket handles) and
/init_weights_update_group + /update_weights_from_distributed (gloo broadcast).
Each leaves the engine bitwise equal to a disk reload of the same weights."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from safetensors.torch import load_file

from engines.client import EngineClient
from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import ServerSettings, serve_in_thread
from training.tiny_model import write_tiny_model
from training.weight_sender import ShmSegment
from wire import receiver as wr
from wire.flat_bucket import flatten, iter_buckets

TOKEN = "transport-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_tensor_and_distributed_updates_over_http(tmp_path, tiny_model_dir):
    other = str(write_tiny_model(tmp_path / "other", seed=1))
    target = load_file(f"{tiny_model_dir}/model.safetensors")
    engine = EmbeddedEngine(other, 0, EngineConfig(), weight_version=0)
    expected = EmbeddedEngine(tiny_model_dir, 1, EngineConfig()).state_sha256()
    start = engine.state_sha256()
    # Tensor handles over HTTP need a token (runs push them over Ray instead).
    thread = serve_in_thread(engine, ServerSettings(api_key=TOKEN))
    try:
        with EngineClient(thread.url, api_key=TOKEN, timeout_s=60, retries=0) as client:
            buckets = list(iter_buckets(sorted(target.items()), bucket_bytes=8 * 1024))
            for i, bucket in enumerate(buckets):
                seg = ShmSegment(flatten(bucket))
                try:
                    last = i == len(buckets) - 1
                    reply = client.update_weights_from_tensor(
                        [wr.encode_handle(seg.handle)], weight_version="1" if last else None
                    )
                finally:
                    seg.close()
                assert reply["success"], reply
            assert client.get_weight_version() == "1"
            assert engine.state_sha256() == expected != start

            back = engine.update_weights_from_disk(other, "0")  # back to the other weights
            assert back["success"] and engine.state_sha256() == start
            port = _free_port()
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(
                    client.init_weights_update_group, "127.0.0.1", port, 1, 2, "g", "gloo"
                )
                pg = wr.make_group("127.0.0.1", port, 0, 2, "g", "gloo")
                assert joined.result()["success"]
                for i, bucket in enumerate(buckets):
                    flats = flatten(bucket)
                    metas = [m for b in flats for m in b.metadata]
                    reply = pool.submit(
                        client.update_weights_from_distributed,
                        [m.name for m in metas],
                        [m.dtype for m in metas],
                        [list(m.shape) for m in metas],
                        "g",
                        "2" if i == len(buckets) - 1 else None,
                    )
                    for b in flats:
                        wr.broadcast(pg, b.flat)
                    assert reply.result()["success"]
            assert client.get_weight_version() == "2"
            assert engine.state_sha256() == expected
            assert client.destroy_weights_update_group("g")["success"]
    finally:
        thread.stop()
