import hashlib
import json
import os

import pytest
from store_helpers import default_files, publish

from storage import IntegrityError, ManifestError, StorageError, VersionConflictError, is_local
from storage.layout import MANIFEST


def _files_under(path) -> set[str]:
    out = set()
    for d, _, fs in os.walk(path):
        out |= {os.path.relpath(os.path.join(d, f), path) for f in fs}
    return out


def test_publish_and_pull_round_trip(store, tmp_path):
    files = default_files(1)
    files["big.bin"] = os.urandom(18 << 20 if not is_local(store.fs) else 3 << 20)  # > one S3 part
    m = publish(store, 1, files)
    assert m.version == 1 and m.run == "run1" and m.parent == 0 and m.format == "hf-safetensors"
    assert {f.name: (f.bytes, f.sha256) for f in m.files} == {
        n: (len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()
    }
    assert store.committed_versions() == [1] and store.latest_version() == 1
    assert store.read_manifest(1) == m
    cache = tmp_path / "cache"
    d = store.pull_version(1, str(cache), workers=4)
    assert d == str(cache / "v000001")
    for name, data in files.items():
        with open(os.path.join(d, name), "rb") as f:
            assert f.read() == data
    assert _files_under(cache) == {f"v000001/{n}" for n in files} | {"v000001/manifest.json"}
    # a verified complete cache is reused as is
    mtime = os.path.getmtime(os.path.join(d, MANIFEST))
    assert store.pull_version(1, str(cache)) == d
    assert os.path.getmtime(os.path.join(d, MANIFEST)) == mtime
    if is_local(store.fs):
        assert store.local_version_dir(1) == store.version_url(1)
        assert os.path.isfile(os.path.join(store.local_version_dir(1), "model.safetensors"))
    else:
        assert store.local_version_dir(1) is None
        assert store.version_url(1).startswith("s3://")


def test_no_manifest_means_not_a_version(store):
    publish(store, 0)
    # files of v1 present, manifest missing -> invisible
    vdir = store.version_url(1)
    store.fs.makedirs(vdir, exist_ok=True)
    store.fs.pipe_file(vdir + "/model.safetensors", b"x" * 10)
    assert store.committed_versions() == [0] and store.latest_version() == 0
    with pytest.raises(ManifestError, match="missing"):
        store.read_manifest(1)


def test_republish_identical_is_idempotent_and_different_conflicts(store):
    m = publish(store, 2)
    assert publish(store, 2) == m  # same bytes: returns the existing manifest
    files = default_files(2)
    files["model.safetensors"] = b"different"
    with pytest.raises(VersionConflictError, match="model.safetensors"):
        publish(store, 2, files)
    assert store.read_manifest(2) == m
    stored = store.fs.cat_file(store.version_url(2) + "/model.safetensors")
    assert stored == default_files(2)["model.safetensors"]  # committed bytes untouched


def test_failure_mid_publish_leaves_previous_latest(store):
    publish(store, 1)

    class Boom(Exception):
        pass

    w = store.weights_writer(2, 2, 1)
    with pytest.raises(Boom):
        with w:
            with w.open("model.safetensors") as f:
                f.write(b"a" * (6 << 20))
                raise Boom()
    assert store.committed_versions() == [1] and store.latest_version() == 1
    with pytest.raises(StorageError, match="failed while writing|already committed/aborted"):
        w.commit()
    if is_local(store.fs):
        assert os.listdir(os.path.dirname(store.version_url(1))) == ["v000001"]  # staging cleaned
    # a later publish of the same version works
    publish(store, 2)
    assert store.latest_version() == 2


def test_file_failing_midway_refuses_commit(store):
    w = store.weights_writer(3, 3, None)
    with pytest.raises(ValueError):
        with w.open("model.safetensors") as f:
            f.write(b"abc")
            raise ValueError("trainer died")
    with pytest.raises(StorageError, match="model.safetensors"):
        w.commit()
    assert store.committed_versions() == []


def test_endpoint_stopped_mid_publish():
    """The S3 endpoint dies between two files of v2; when it is back, v1 is still latest."""
    from s3_server import make_bucket, moto_s3

    from storage import RunStore, S3Options, StorageConfig

    with moto_s3() as url:
        make_bucket(url, "dying")
        opts = S3Options(endpoint_url=url, max_attempts=1)  # fail fast once the endpoint is gone
        store = RunStore(StorageConfig(root="s3://dying/p", s3=opts), "r")
        store.fs.retries = 1
        publish(store, 1)
        w = store.weights_writer(2, 2, 1)
        with w.open("model.safetensors") as f:
            f.write(b"a" * 1000)
    with pytest.raises(Exception):  # noqa: B017 - whatever the transport raises
        with w.open("config.json") as f:
            f.write(b"{}")
        w.commit()
    # moto keeps its state in-process, so a new server is the same endpoint coming back.
    with moto_s3() as url2:
        store2 = RunStore(StorageConfig(root="s3://dying/p", s3=S3Options(endpoint_url=url2)), "r")
        assert store2.committed_versions() == [1] and store2.latest_version() == 1
        with pytest.raises(ManifestError):
            store2.read_manifest(2)


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_shard_refused_at_pull(store, tmp_path, damage):
    publish(store, 1)
    path = store.version_url(1) + "/model.safetensors"
    data = store.fs.cat_file(path)
    bad = data[:100] + bytes([data[100] ^ 1]) + data[101:] if damage == "corrupt" else data[:-5]
    store.fs.pipe_file(path, bad)
    cache = tmp_path / "cache"
    with pytest.raises(IntegrityError, match="model.safetensors"):
        store.pull_version(1, str(cache), retries=1)
    assert not (cache / "v000001").exists()
    assert os.listdir(cache) == []  # staging removed, nothing half-complete left


def _write_manifest(store, version, raw: bytes):
    path = store.version_url(version) + "/" + MANIFEST
    store.fs.makedirs(store.version_url(version), exist_ok=True)
    store.fs.pipe_file(path, raw)


def _good_manifest(store, version) -> dict:
    m = publish(store, version)
    return json.loads(m.model_dump_json())


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "missing"),
        ("malformed", "not valid JSON"),
        ("duplicate", "listed twice"),
        ("dotdot", "escapes its folder"),
        ("absolute", "escapes its folder"),
        ("negative", "greater than or equal to 0"),
        ("wrong_size", "bytes"),
    ],
)
def test_bad_manifests(store, tmp_path, case, match):
    raw = _good_manifest(store, 1)
    if case == "missing":
        store.fs.rm_file(store.version_url(1) + "/" + MANIFEST)
    elif case == "malformed":
        _write_manifest(store, 1, b"{not json")
    else:
        f0 = raw["files"][0]
        if case == "duplicate":
            raw["files"].append(dict(f0))
        elif case == "dotdot":
            raw["files"].append({**f0, "name": "../../escape.bin"})
        elif case == "absolute":
            raw["files"].append({**f0, "name": "/tmp/escape.bin"})
        elif case == "negative":
            f0["bytes"] = -1
        elif case == "wrong_size":
            f0["bytes"] += 1
        _write_manifest(store, 1, json.dumps(raw).encode())
    cache = tmp_path / "cache"
    err = ManifestError if case != "wrong_size" else IntegrityError
    with pytest.raises(err, match=match):
        store.pull_version(1, str(cache), retries=0)
    if case != "wrong_size":
        assert store.committed_versions() == []
    leftovers = _files_under(tmp_path) - {
        p for p in _files_under(tmp_path) if p.startswith("runs/")
    }
    assert leftovers == set()  # nothing written outside the (absent) version folder
    assert not (tmp_path / "escape.bin").exists() and not os.path.exists("/tmp/escape.bin")


def test_bad_names_refused_at_write(store):
    w = store.weights_writer(1, 1, None)
    for bad in ["../x", "/abs", "a//b", "manifest.json", ""]:
        with pytest.raises(ManifestError):
            w.open(bad)
    with w.open("a.bin") as f:
        f.write(b"1")
    with pytest.raises(StorageError, match="already written"):
        w.open("a.bin")
    w.abort()


def test_transiently_bad_shard_is_refetched(store, tmp_path, monkeypatch):
    """The first download of a shard arrives corrupted (a fake flaky transfer);
    the pull re-fetches it and succeeds with the right bytes."""
    import storage.pull as pull_mod

    files = default_files(1)
    publish(store, 1, files)
    real = pull_mod._copy_checked
    calls = {"n": 0}

    def flaky(fs, src, dst, *a, **kw):
        why = real(fs, src, dst, *a, **kw)
        if src.endswith("model.safetensors") and calls["n"] == 0:
            calls["n"] += 1
            return "chunk 0 hashes to 000000000000..., a fake flaky transfer"
        return why

    monkeypatch.setattr(pull_mod, "_copy_checked", flaky)
    d = store.pull_version(1, str(tmp_path / "cache"), retries=2)
    assert calls["n"] == 1
    assert open(os.path.join(d, "model.safetensors"), "rb").read() == files["model.safetensors"]


def test_local_pull_links_and_refetch_never_writes_into_the_version(tmp_path, monkeypatch):
    """From a local root on the same filesystem a pull hard-links the committed files.
    A retry after a bad attempt must not write through that link: here the first
    attempt links and fails verification, the second copies (as across filesystems)."""
    import storage.pull as pull_mod
    from storage import RunStore, StorageConfig

    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    files = default_files(1)
    files["big.bin"] = os.urandom(3 << 20)
    publish(store, 1, files)
    src = os.path.join(store.local_version_dir(1), "big.bin")
    d = store.pull_version(1, str(tmp_path / "linked"))
    assert os.stat(os.path.join(d, "big.bin")).st_ino == os.stat(src).st_ino

    real_copy, real_link = pull_mod._copy_checked, pull_mod._try_link
    attempts: list[str] = []

    def first_attempt_bad(fs, s, dst, *a, **kw):
        why = real_copy(fs, s, dst, *a, **kw)
        if s.endswith("big.bin") and not attempts:
            attempts.append("linked, bad")
            return "chunk 0 hashes to 000000000000..., a fake bad read"
        return why

    def link_once(s, dst):
        return real_link(s, dst) if not attempts else False

    monkeypatch.setattr(pull_mod, "_copy_checked", first_attempt_bad)
    monkeypatch.setattr(pull_mod, "_try_link", link_once)
    d2 = store.pull_version(1, str(tmp_path / "copied"), retries=1)
    assert attempts == ["linked, bad"]
    assert os.stat(os.path.join(d2, "big.bin")).st_ino != os.stat(src).st_ino
    for name, data in files.items():  # the committed version and both caches are intact
        for folder in (store.local_version_dir(1), d, d2):
            with open(os.path.join(folder, name), "rb") as f:
                assert f.read() == data


def test_concurrent_pulls_of_a_version_copy_it_once(store, tmp_path):
    """Engines of one node reload at once: the version crosses the network once,
    the other pullers wait on its lock and reuse the verified copy."""
    from concurrent.futures import ThreadPoolExecutor

    publish(store, 1)
    cache = str(tmp_path / "node-cache")
    with ThreadPoolExecutor(4) as pool:
        pulls = list(pool.map(lambda _: store.pull(1, cache), range(4)))
    assert sorted(p.copied for p in pulls) == [False, False, False, True]
    assert {p.path for p in pulls} == {os.path.join(cache, "v000001")}
    assert all(p.bytes == sum(f.bytes for f in store.read_manifest(1).files) for p in pulls)
    assert store.pull(1, cache).copied is False  # and later ones, too
