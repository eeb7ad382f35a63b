"""Hash trees in weight manifests (storage.tree): every file's entry carries its chunk
hashes and a root beside its sha256; readers check chunks on every core and name a
damaged chunk; a flipped byte in a file, a base, a rebuilt file or a manifest is
refused; a delta's unchanged chunks carry their hashes over from the base; versions
published before trees (``data/pre_tree``, written by the code of that time) still
pull and verify by their sha256."""

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import zstandard
from blake3 import blake3

from storage import IntegrityError, ManifestError, RunStore, StorageConfig, StorageError
from storage import tree as tree_mod
from storage.delta_format import FRAME, MAGICS, RAW
from storage.layout import MANIFEST
from storage.weights import verify_dir

C = tree_mod.CHUNK
PRE_TREE = Path(__file__).parent / "data" / "pre_tree"


def _publish(store: RunStore, v: int, files: dict, every: int | None = 5):
    w = store.weights_writer(v, v, v - 1 if v else None, full_every=every)
    for name, data in files.items():
        with w.open(name) as f:
            f.write(data)
    return w.commit()


def _flip(path: str, at: int) -> None:
    """Flip one bit in a file of its own (never through a hard link to a version)."""
    data = bytearray(open(path, "rb").read())
    data[at] ^= 1
    os.unlink(path)
    open(path, "wb").write(bytes(data))


def _edit_manifest(path: str, edit) -> None:
    raw = json.loads(open(path).read())
    edit(raw)
    os.unlink(path)
    open(path, "w").write(json.dumps(raw))


@pytest.fixture
def big() -> bytes:
    return np.random.default_rng(1).integers(0, 256, 2 * C + 12345, np.uint8).tobytes()


def test_each_file_records_its_chunk_hashes_and_a_root_beside_its_sha256(store, big):
    m = _publish(store, 1, {"big.bin": big, "config.json": b"{}"}, every=None)
    e = {f.name: f for f in m.files}["big.bin"]
    assert e.sha256 == hashlib.sha256(big).hexdigest()  # kept for tools that read it
    assert e.tree.algo == "blake3" and e.tree.chunk == C
    want = [blake3(big[i : i + C]).digest() for i in range(0, len(big), C)]
    assert [bytes.fromhex(h) for h in e.tree.hashes] == want and len(want) == 3
    assert e.tree.root == tree_mod.root_of(len(big), e.sha256, C, want)
    raw = json.loads(store.fs.cat_file(f"{store.version_url(1)}/{MANIFEST}"))
    assert set(raw["files"][0]) == {"name", "bytes", "sha256", "tree"}
    assert store.verify_version(1) == m


def test_a_flipped_byte_is_refused_and_its_chunk_named(store, big, tmp_path):
    _publish(store, 1, {"big.bin": big}, every=None)
    cache = store.pull_version(1, str(tmp_path / "cache"))
    _flip(os.path.join(cache, "big.bin"), C + 5)
    with pytest.raises(
        IntegrityError, match=rf"'big.bin' in .*: chunk 1 of 3 \(bytes {C}-{2 * C}\)"
    ):
        verify_dir(cache)
    path = f"{store.version_url(1)}/big.bin"
    data = bytearray(store.fs.cat_file(path))
    data[2 * C + 7] ^= 1
    store.fs.pipe_file(path, bytes(data))
    with pytest.raises(
        IntegrityError, match=r"'big.bin' of .*: chunk 2 of 3 .*republish version 1"
    ):
        store.verify_version(1)
    with pytest.raises(
        IntegrityError, match=r"big.bin of .* failed verification 1 times \(chunk 2"
    ):
        store.pull(1, str(tmp_path / "c2"), retries=0)
    assert not (tmp_path / "c2" / "v000001").exists()


@pytest.mark.parametrize(
    "edit, why",
    [
        (
            lambda f: f["tree"]["hashes"].__setitem__(1, "0" * 64),
            r"chunk 1 of 3 .* says 000000000000",
        ),
        (lambda f: f["tree"].__setitem__("root", "0" * 64), r"the manifest's root 000000000000"),
        (lambda f: f.__setitem__("sha256", "1" * 64), r"its chunks match, but the manifest's root"),
        (lambda f: f.__setitem__("bytes", f["bytes"] - 1), r"has \d+ bytes, the manifest says"),
    ],
    ids=["chunk-hash", "root", "sha256", "bytes"],
)
def test_a_flipped_manifest_field_is_refused(tmp_path, big, edit, why):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    _publish(store, 1, {"big.bin": big}, every=None)
    cache = store.pull_version(1, str(tmp_path / "cache"))
    _edit_manifest(os.path.join(cache, MANIFEST), lambda raw: edit(raw["files"][0]))
    with pytest.raises((IntegrityError, ManifestError), match=why):
        verify_dir(cache)


def test_bad_trees_and_a_missing_blake3_are_errors_that_name_the_fix(tmp_path, big, monkeypatch):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    _publish(store, 1, {"big.bin": big}, every=None)
    mpath = os.path.join(store.version_url(1), MANIFEST)
    good = open(mpath).read()
    _edit_manifest(mpath, lambda raw: raw["files"][0]["tree"]["hashes"].pop())
    with pytest.raises(ManifestError, match=r"lists 2 chunk hashes, but .* make 3.*republish"):
        store.read_manifest(1)
    open(mpath, "w").write(good)
    _edit_manifest(mpath, lambda raw: raw["files"][0]["tree"]["hashes"].__setitem__(0, "zz"))
    with pytest.raises(ManifestError, match=r"chunk hash 0 'zz' is not 64 lowercase hex"):
        store.read_manifest(1)
    open(mpath, "w").write(good)
    monkeypatch.setattr(tree_mod, "_blake3", None)
    with pytest.raises(StorageError, match="pip install blake3"):
        store.verify_version(1)


def test_unchanged_chunks_of_a_delta_carry_their_hashes_from_the_base(tmp_path, big, monkeypatch):
    """Only the chunk a step changed is hashed by the rebuild; the others are the
    base's chunks, and their hashes are its verified tree's."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    new = bytearray(big)
    new[C + 100] ^= 0x10  # chunk 1 only
    _publish(store, 0, {"big.bin": big})
    m1 = _publish(store, 1, {"big.bin": bytes(new)})
    assert m1.delta is not None
    cache = str(tmp_path / "cache")
    store.pull(0, cache)  # the engines hold the base, verified by this process
    hashed: list[int] = []
    real = tree_mod.digest

    def counting(data):
        hashed.append(memoryview(data).nbytes)
        return real(data)

    monkeypatch.setattr(tree_mod, "digest", counting)
    path = store.pull(1, cache).path
    assert open(os.path.join(path, "big.bin"), "rb").read() == bytes(new)
    assert hashed.count(C) == 1  # chunk 1; chunks 0 and 2 carried (and the small delta file)
    assert verify_dir(path).rebuilt() == m1.rebuilt()


class _CountingHasher:
    """A BLAKE3 hasher that records how many bytes it was fed (into ``fed``)."""

    def __init__(self, fed: list[int]):
        self._h, self._fed = blake3(), fed
        fed.append(0)
        self._i = len(fed) - 1

    def update(self, data) -> None:
        self._fed[self._i] += memoryview(data).nbytes
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _changed(big: bytes, how: str) -> bytes:
    new = bytearray(big)
    if how == "one chunk":
        new[C + 100] ^= 0x10
    elif how == "late in a chunk":  # the chunk's unchanged start is hashed from the base
        new[2 * C - 5] ^= 0x10
    elif how == "shorter":  # the last chunk spans fewer bytes than the base's
        del new[-100:]
    elif how == "longer":
        new += b"tail"
    return bytes(new)


@pytest.mark.parametrize(
    "how, hashed",
    [("one chunk", [C]), ("late in a chunk", [C]), ("shorter", [12245]), ("longer", [12349])],
)
def test_the_publisher_carries_the_hashes_of_chunks_a_delta_leaves_unchanged(
    tmp_path, big, monkeypatch, how, hashed
):
    """A delta's publisher hashes only the chunks that differ from the base's (the base
    checked first); the others take the base's hashes. Its tree is the one a fresh hash
    of the new bytes gives, and the version rebuilds to them."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    new = _changed(big, how)
    _publish(store, 0, {"big.bin": big})
    fed: list[int] = []
    monkeypatch.setattr(tree_mod, "new_hasher", lambda: _CountingHasher(fed))
    w = store.weights_writer(1, 1, 0, full_every=5)
    with w.open("big.bin") as f:  # in 5 MiB writes: a chunk's bytes come in pieces
        for i in range(0, len(new), 5 << 20):
            f.write(new[i : i + (5 << 20)])
    m1 = w.commit()
    monkeypatch.undo()
    assert m1.delta is not None
    # The small .xor.zst is hashed as it is written, and each root over a few hashes.
    delta_file = m1.files[0].bytes
    assert sorted(n for n in fed if n != delta_file and n > 1000) == hashed
    e = m1.delta.full[0]
    want = [blake3(new[i : i + C]).digest() for i in range(0, len(new), C)]
    assert [bytes.fromhex(h) for h in e.tree.hashes] == want
    assert e.tree == tree_mod.make(len(new), hashlib.sha256(new).hexdigest(), want)
    path = store.pull(1, str(tmp_path / "cache")).path
    assert open(os.path.join(path, "big.bin"), "rb").read() == new
    assert verify_dir(path) is not None


def test_rot_under_a_carried_chunk_is_refused_at_load_and_a_verified_pull_repairs_it(tmp_path, big):
    """A base this process verified is trusted while its inode, size and mtime stay:
    rot that keeps them reaches the rebuilt file through a carried chunk, and the
    engines' load check refuses it, naming the chunk; a pull with verify_cached
    pulls the base and the version again."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    new = bytearray(big)
    new[C + 100] ^= 0x10
    m0 = _publish(store, 0, {"big.bin": big})
    _publish(store, 1, {"big.bin": bytes(new)})
    cache = str(tmp_path / "cache")
    base = os.path.join(store.pull(0, cache).path, "big.bin")
    _flip(base, 0)
    _flip(base, 0)  # the same bytes in a file of its own (no link to the committed one)
    assert tree_mod.verified_once(base, m0.files[0]) is None  # checked by this process
    st = os.stat(base)  # then rot in place that keeps its inode and mtime
    with open(base, "r+b") as f:
        f.seek(2 * C + 3)
        b = f.read(1)
        f.seek(2 * C + 3)
        f.write(bytes([b[0] ^ 1]))
    os.utime(base, ns=(st.st_atime_ns, st.st_mtime_ns))
    path = store.pull(1, cache).path
    with pytest.raises(IntegrityError, match=r"'big.bin' in .*v000001: chunk 2 of 3"):
        verify_dir(path)
    path = store.pull(1, cache, verify_cached=True).path
    assert open(os.path.join(path, "big.bin"), "rb").read() == bytes(new)
    assert verify_dir(path) is not None


@pytest.mark.parametrize("field", ["chunk-hash", "sha256"])
def test_a_delta_whose_full_tree_was_flipped_is_refused_at_rebuild(tmp_path, big, field):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    new = bytearray(big)
    new[5] ^= 1
    _publish(store, 0, {"big.bin": big})
    _publish(store, 1, {"big.bin": bytes(new)})

    def edit(raw):
        full = raw["delta"]["full"][0]
        if field == "sha256":
            full["sha256"] = "2" * 64
        else:
            full["tree"]["hashes"][0] = "3" * 64

    _edit_manifest(os.path.join(store.version_url(1), MANIFEST), edit)
    why = "chunk 0 of 3" if field == "chunk-hash" else "its chunks match, but the manifest's root"
    with pytest.raises(
        IntegrityError, match=rf"v000001 \(a delta of v000000\): rebuilt 'big.bin': {why}"
    ):
        store.pull(1, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "v000001").exists()


# -- versions published before trees -------------------------------------------------


@pytest.fixture
def pre_tree(tmp_path) -> RunStore:
    """A copy of ``data/pre_tree``: v0 full and v1 a delta of it, both written (files
    and manifests) by storage as it was before hash trees."""
    shutil.copytree(PRE_TREE, tmp_path / "runs")
    return RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")


def test_versions_published_before_trees_pull_and_verify_by_their_sha256(pre_tree, tmp_path):
    store = pre_tree
    assert store.committed_versions() == [0, 1]
    m0, m1 = store.read_manifest(0), store.read_manifest(1)
    assert all(f.tree is None for f in m0.files + m1.files + m1.delta.full)
    raw = open(os.path.join(store.version_url(0), MANIFEST), "rb").read()
    assert b"tree" not in raw  # and as written then: re-serialized, the same JSON
    assert json.loads(raw) == m0.dump()
    assert store.verify_version(0) == m0 and store.verify_version(1) == m1
    cache = str(tmp_path / "cache")
    path = store.pull(1, cache).path
    for f in m1.delta.full:  # the rebuilt bytes are the ones hashed then
        data = open(os.path.join(path, f.name), "rb").read()
        assert hashlib.sha256(data).hexdigest() == f.sha256
    assert verify_dir(path).files == m1.delta.full
    from engines.embedded.weight_files import read_state_dict

    assert set(read_state_dict(path)) == {"a", "b"}
    # Republishing v0's bytes is a no-op, as before.
    files = {
        f.name: open(os.path.join(store.version_url(0), f.name), "rb").read() for f in m0.files
    }
    assert _publish(store, 0, files, every=None) == m0
    # A flipped byte: refused by the sha256, named.
    _flip(os.path.join(path, "model.safetensors"), 100)
    with pytest.raises(
        IntegrityError, match=r"'model.safetensors' in .*: sha256 .* the bytes changed"
    ):
        verify_dir(path)
    _flip(os.path.join(store.version_url(0), "model.safetensors"), 200)
    with pytest.raises(
        IntegrityError, match=r"'model.safetensors' of .*: sha256 .*republish version 0"
    ):
        store.verify_version(0)


def test_a_new_delta_of_a_base_published_before_trees_rebuilds(pre_tree, tmp_path):
    """v2 is a delta of the sha256-only v0: its own entries have trees, none carry."""
    store = pre_tree
    base = {
        f.name: open(os.path.join(store.version_url(0), f.name), "rb").read()
        for f in store.read_manifest(0).files
    }
    new = dict(base)
    st = bytearray(base["model.safetensors"])
    st[-10] ^= 4
    new["model.safetensors"] = bytes(st)
    m2 = _publish(store, 2, new)
    assert m2.delta is not None and m2.delta.base == 0
    assert all(f.tree is not None for f in m2.files)
    path = store.pull(2, str(tmp_path / "cache")).path
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == bytes(st)
    assert verify_dir(path) is not None


def test_a_delta_of_frames_of_any_size_from_before_trees_still_rebuilds(tmp_path):
    """Deltas written before trees cut frames where the writer's buffers ended (a 4 MiB
    gather, 8 MiB pieces of 16 MiB slices): their rebuild takes frames of any size
    and checks the file's sha256; a damaged one is refused by it."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    base = np.random.default_rng(2).integers(0, 256, 2 * FRAME + 999, np.uint8).tobytes()
    new = bytearray(base)
    new[:: 1 << 20] = bytes(len(new[:: 1 << 20]))
    m0 = _publish(store, 0, {"big.bin": base})
    vdir = Path(store.version_url(1))
    vdir.mkdir()
    with open(vdir / "big.bin.xor.zst", "wb") as f:  # xor-zstd, as that writer wrote it
        f.write(MAGICS["xor-zstd"] + RAW)
        xor = np.bitwise_xor(np.frombuffer(base, np.uint8), np.frombuffer(bytes(new), np.uint8))
        for lo, hi in ((0, 4 << 20), (4 << 20, 12 << 20), (12 << 20, len(new))):
            c = zstandard.ZstdCompressor(level=1).compress(xor[lo:hi])
            f.write(struct.pack("<I", len(c)) + c)
    stored = (vdir / "big.bin.xor.zst").read_bytes()
    manifest = {
        "version": 1,
        "run": "r",
        "iteration": 1,
        "parent": 0,
        "created_at": 1.0,
        "format": "hf-safetensors",
        "files": [
            {
                "name": "big.bin.xor.zst",
                "bytes": len(stored),
                "sha256": hashlib.sha256(stored).hexdigest(),
            }
        ],
        "delta": {
            "base": 0,
            "base_digest": m0.digest(),
            "codec": "xor-zstd",
            "full": [
                {"name": "big.bin", "bytes": len(new), "sha256": hashlib.sha256(new).hexdigest()}
            ],
        },
    }
    (vdir / MANIFEST).write_text(json.dumps(manifest))
    path = store.pull(1, str(tmp_path / "cache")).path
    assert open(os.path.join(path, "big.bin"), "rb").read() == bytes(new)
    manifest["delta"]["full"][0]["sha256"] = hashlib.sha256(base).hexdigest()
    (vdir / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=r"rebuilt 'big.bin': sha256 .* the manifest says"):
        store.pull(1, str(tmp_path / "c2"))
