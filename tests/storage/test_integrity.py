"""Integrity of weight versions: version_state, verify_version, verify_dir (what the
engines call on every folder they load), and the warning for damaged manifests."""

import json
import logging
import os

import pytest
from store_helpers import default_files, publish

from storage import IntegrityError, ManifestError, RunStore, StorageConfig, StorageError
from storage.layout import MANIFEST
from storage.weights import verify_dir


def _flip(store: RunStore, version: int, name: str) -> None:
    path = f"{store.version_url(version)}/{name}"
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 1
    store.fs.pipe_file(path, bytes(data))


def test_version_state_committed_absent_damaged(store, caplog):
    publish(store, 1)
    publish(store, 2)
    publish(store, 3)
    publish(store, 4)
    assert store.version_state(1) == "committed" and store.version_state(9) == "absent"
    vurl = store.version_url
    store.fs.pipe_file(f"{vurl(2)}/{MANIFEST}", b"{broken")  # manifest damaged
    store.fs.rm_file(f"{vurl(3)}/config.json")  # a listed file missing
    path = f"{vurl(4)}/model.safetensors"
    store.fs.pipe_file(path, store.fs.cat_file(path)[:-7])  # truncated
    store.fs.makedirs(vurl(5), exist_ok=True)
    store.fs.pipe_file(f"{vurl(5)}/model.safetensors", b"x")  # files but no manifest
    with caplog.at_level(logging.WARNING, logger="storage"):
        states = {v: store.version_state(v) for v in (2, 3, 4, 5)}
    assert states == {2: "damaged", 3: "damaged", 4: "damaged", 5: "damaged"}
    assert "config.json" in store.version_problem(3)
    assert "model.safetensors" in store.version_problem(4)
    assert (
        store.version_problem(1) is None and store.version_problem(9) == f"{vurl(9)} does not exist"
    )


def test_committed_versions_warns_about_a_damaged_manifest(store, caplog):
    publish(store, 1)
    publish(store, 2)
    store.fs.pipe_file(f"{store.version_url(2)}/{MANIFEST}", b"{broken")
    with caplog.at_level(logging.WARNING, logger="storage"):
        assert store.committed_versions() == [1]
    assert any("version 2 is damaged" in r.getMessage() for r in caplog.records)


def test_staging_of_a_version_reads_as_damaged(tmp_path):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    publish(store, 1)
    os.makedirs(os.path.join(os.path.dirname(store.version_url(1)), ".tmp-v000002-x"))
    assert store.version_state(2) == "damaged" and store.version_state(3) == "absent"


def test_a_version_cut_short_is_discarded_and_published_again(store):
    """A shard cut short under a manifest that reads: a writer keeps that manifest, so
    the holder discards the version (manifest first) and publishes it again."""
    publish(store, 1)
    committed = store.read_manifest(1).file_set()
    path = f"{store.version_url(1)}/model.safetensors"
    store.fs.pipe_file(path, store.fs.cat_file(path)[:1000])  # truncated
    assert store.version_state(1) == "damaged"
    publish(store, 1)  # identical content again: the damaged files stay as they are
    assert store.version_state(1) == "damaged"
    assert "model.safetensors" in store.discard_damaged_version(1)
    assert store.version_state(1) == "absent"
    publish(store, 1)
    assert store.version_state(1) == "committed" and store.read_manifest(1).file_set() == committed
    with pytest.raises(StorageError, match="is committed, not damaged: nothing was removed"):
        store.discard_damaged_version(1)
    assert store.verify_version(1).version == 1


def test_verify_version_hashes_every_byte(store):
    publish(store, 1)
    assert store.verify_version(1).version == 1
    _flip(store, 1, "model.safetensors")  # same size: only a full hash sees it
    assert store.version_state(1) == "committed"
    with pytest.raises(IntegrityError, match=r"model.safetensors.*republish version 1"):
        store.verify_version(1)
    with pytest.raises(ManifestError):
        store.verify_version(7)


@pytest.fixture
def pulled(tmp_path):
    """A local version dir and a pulled cache copy of it (the two things engines load)."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    files = default_files(1)
    files["big.bin"] = os.urandom(3 << 20)
    publish(store, 1, files)
    return store, store.pull_version(1, str(tmp_path / "cache"))


def test_verify_dir_accepts_committed_and_pulled_dirs(pulled, tmp_path):
    store, cache = pulled
    for d in (cache, store.local_version_dir(1)):
        m = verify_dir(d)
        assert m is not None and m.version == 1 and len(m.files) == 4
    assert verify_dir(str(tmp_path)) is None  # no manifest: not a committed copy


def _cached_copy(cache: str, name: str) -> str:
    """Break the hard link a local pull makes, so damaging the cache spares the version."""
    path = os.path.join(cache, name)
    data = open(path, "rb").read()
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_verify_dir_flipped_byte(pulled):
    _, cache = pulled
    path = _cached_copy(cache, "big.bin")
    data = bytearray(open(path, "rb").read())
    data[12345] ^= 0x40
    open(path, "wb").write(bytes(data))
    with pytest.raises(
        IntegrityError, match=r"'big.bin'.*: chunk 0 of 1 \(bytes 0-3145728\).*re-pull version 1"
    ):
        verify_dir(cache)


def test_verify_dir_truncated_shard(pulled):
    _, cache = pulled
    path = _cached_copy(cache, "model.safetensors")
    os.truncate(path, 1000)
    with pytest.raises(IntegrityError, match=r"'model.safetensors'.*1000 bytes.*re-pull version 1"):
        verify_dir(cache)


def test_verify_dir_wrong_sha256_list(pulled):
    _, cache = pulled
    mpath = os.path.join(cache, MANIFEST)
    raw = json.loads(open(mpath).read())
    raw["files"][0]["sha256"] = "0" * 64
    os.unlink(mpath)  # a hard link too, possibly
    open(mpath, "w").write(json.dumps(raw))
    with pytest.raises(IntegrityError, match=rf"'{raw['files'][0]['name']}'.*sha256"):
        verify_dir(cache)


def test_verify_dir_symlink_escape(pulled, tmp_path):
    """A symlink to an outside file with the very same bytes is still refused: the
    loader would read something nobody committed to this folder."""
    _, cache = pulled
    path = os.path.join(cache, "config.json")
    outside = tmp_path / "outside.json"
    outside.write_bytes(open(path, "rb").read())
    os.unlink(path)
    os.symlink(outside, path)
    with pytest.raises(StorageError, match=r"'config.json'.*outside the folder.*version 1"):
        verify_dir(cache)


def test_verify_dir_refuses_escaping_names(pulled):
    _, cache = pulled
    mpath = os.path.join(cache, MANIFEST)
    raw = json.loads(open(mpath).read())
    raw["files"].append({**raw["files"][0], "name": "../../etc/passwd"})
    os.unlink(mpath)
    open(mpath, "w").write(json.dumps(raw))
    with pytest.raises(ManifestError, match="escapes its folder"):
        verify_dir(cache)


def test_pull_with_verify_cached_replaces_a_damaged_cache(pulled):
    """The fix verify_dir names for a cache ("re-pull"): a plain pull reuses the cached
    copy (sizes match), verify_cached=True sees the flipped byte and pulls it again."""
    store, cache = pulled
    path = _cached_copy(cache, "big.bin")
    data = bytearray(open(path, "rb").read())
    data[7] ^= 1
    open(path, "wb").write(bytes(data))
    parent = os.path.dirname(cache)
    assert store.pull_version(1, parent) == cache
    with pytest.raises(IntegrityError):
        verify_dir(cache)
    assert store.pull_version(1, parent, verify_cached=True) == cache
    assert verify_dir(cache).version == 1
