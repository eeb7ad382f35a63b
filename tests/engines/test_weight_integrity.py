"""A reload loads only files inside the allowed roots, and
only bytes that match the version's manifest.json.

Versions are published with storage's real writer (``WeightsWriter``: shards,
then manifest.json last), then damaged the ways disks and attackers damage
them; reloads go over real HTTP to an embedded server.
"""

from __future__ import annotations

import json
import shutil

import fsspec
import pytest

from engines.client import EngineClient, EngineHTTPError
from engines.config import EngineConfig
from engines.embedded.engine import EmbeddedEngine
from engines.embedded.http_server import ServerSettings, serve_in_thread
from storage.weights import WeightsWriter
from wire.errors import WeightIntegrityError

PROMPT = [1, 5, 6, 7, 25, 8]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def publish(src, weights_dir, version: int = 1):
    """``src``'s files committed as ``weights_dir/v{version:06d}`` by storage."""
    w = WeightsWriter(fsspec.filesystem("file"), str(weights_dir), "t", version, version, 0)
    for f in sorted(src.iterdir()):
        w.add_file(f.name, str(f))
    w.commit()
    return weights_dir / f"v{version:06d}"


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_v1):
    """The allowed root, holding a committed (sharded) version v1."""
    base = tmp_path_factory.mktemp("root")
    publish(tiny_v1, base / "weights")
    return base


@pytest.fixture(scope="module")
def outside(tmp_path_factory, tiny_dir):
    """Weights outside every allowed root."""
    dst = tmp_path_factory.mktemp("outside")
    shutil.copy(tiny_dir / "model.safetensors", dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def client(tiny_dir, root):
    engine = EmbeddedEngine(str(tiny_dir), 0, EngineConfig(), weight_version=0)
    thread = serve_in_thread(engine, ServerSettings(allowed_roots=(str(root), str(tiny_dir))))
    with EngineClient(thread.url, timeout_s=60, retries=0) as c:
        yield c
    thread.stop()


def _copy(root, name: str):
    """A fresh copy of the committed v1 under the allowed root, to damage."""
    dst = root / name
    shutil.copytree(root / "weights" / "v000001", dst)
    return dst


def _refused(client, path, status: int) -> str:
    before = client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_disk(str(path), weight_version="9")
    assert e.value.status == status, e.value.message
    # The old weights keep serving.
    assert client.get_weight_version() == "0"
    assert client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"] == before
    return e.value.message


def _shard(d) -> str:
    return sorted(p.name for p in d.glob("model-*.safetensors"))[0]


def test_symlinked_shard_leading_outside_is_refused(client, root, outside, tiny_dir):
    d = root / "linked"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, d / f.name)
    (d / "model.safetensors").symlink_to(outside / "model.safetensors")
    msg = _refused(client, d, 403)
    assert "outside the allowed roots" in msg and "model.safetensors" in msg


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_index_naming_files_outside_is_refused(client, root, outside, how):
    d = _copy(root, f"index-{how}")
    (d / "manifest.json").unlink()  # a plain HF dir: no manifest to catch it
    index = json.loads((d / "model.safetensors.index.json").read_text())
    target = str(outside / "model.safetensors") if how == "absolute" else "../x.safetensors"
    index["weight_map"] = {k: target for k in index["weight_map"]}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _refused(client, d, 403)
    assert "plain file names" in msg


def test_flipped_byte_is_refused_by_its_chunk_hash(client, root):
    d = _copy(root, "flipped")
    shard = d / _shard(d)
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    shard.write_bytes(data)
    msg = _refused(client, d, 400)
    assert f"hash mismatch in {shard.name}: chunk 0 of 1" in msg and "republish or re-pull" in msg


def test_manifest_with_wrong_hashes_is_refused(client, root):
    d = _copy(root, "wrong-hashes")
    m = json.loads((d / "manifest.json").read_text())
    for f in m["files"]:
        f["sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    assert "hash mismatch" in _refused(client, d, 400)  # the tree's root binds the sha256


def test_truncated_shard_is_refused_with_a_message(client, root):
    d = _copy(root, "truncated")
    shard = d / _shard(d)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    msg = _refused(client, d, 400)
    assert f"size mismatch in {shard.name}" in msg and "republish or re-pull" in msg
    # Without a manifest the layout check catches it, still as a 400 naming the file.
    (d / "manifest.json").unlink()
    msg = _refused(client, d, 400)
    assert f"cannot read {shard.name}" in msg and "truncated" in msg


def test_intact_versions_and_plain_dirs_load(client, root, tiny_dir):
    res = client.update_weights_from_disk(str(root / "weights" / "v000001"), weight_version="1")
    assert res["success"] and client.get_weight_version() == "1"
    # The base model dir (no manifest) loads as HF would.
    assert client.update_weights_from_disk(str(tiny_dir), weight_version="0")["success"]


def test_engine_start_from_a_corrupt_version_is_refused(root):
    d = _copy(root, "corrupt-start")
    shard = d / _shard(d)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x80
    shard.write_bytes(data)
    with pytest.raises(WeightIntegrityError, match="hash mismatch"):
        EmbeddedEngine(str(d), 0, EngineConfig())
