"""A failed publish leaves no staging behind, and a new writer of the same version
sweeps what a dead writer left."""

import os
import subprocess
import sys
import time

import pytest
from store_helpers import payload, publish

from storage import RunStore, StorageConfig, StorageError


class DiskFull(OSError):
    pass


def _source(chunks: int):
    """A file source that fails mid-copy, as a full disk or a dying trainer does."""
    for i in range(chunks):
        yield payload(i, 5 << 20)
    raise DiskFull(28, "No space left on device")


def _weights_entries(store: RunStore) -> list[str]:
    return sorted(os.listdir(os.path.dirname(store.version_url(0))))


def test_writer_failing_mid_copy_removes_its_staging(store):
    """No ``with writer:`` around it, as a publish task that simply raises: the failed
    file alone must take the staging (local) or the partial objects (S3) away."""
    publish(store, 1)
    w = store.weights_writer(2, 2, 1)
    with w.open("config.json") as f:
        f.write(b"{}")
    with pytest.raises(DiskFull):
        with w.open("model.safetensors") as f:
            for chunk in _source(2):
                f.write(chunk)
    assert store.version_state(2) == "absent"  # neither staging nor partial objects
    if store.local_version_dir(1):
        assert _weights_entries(store) == ["v000001"]
    else:
        assert not store.fs.exists(store.version_url(2))
    with pytest.raises(StorageError, match="model.safetensors.*publish it again"):
        w.commit()
    publish(store, 2)  # the retry publishes normally
    assert store.committed_versions() == [1, 2]


def test_add_file_from_a_failing_source_removes_staging(tmp_path):
    """add_file of a local file whose read fails (EIO) after the copy started."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    publish(store, 1)
    w = store.weights_writer(2, 2, 1)
    with pytest.raises(OSError):
        w.add_file("model.safetensors", "/proc/self/mem")  # opens fine, reading offset 0 fails
    assert _weights_entries(store) == ["v000001"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_new_writer_sweeps_stale_staging_of_its_version(tmp_path):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    publish(store, 1)
    wdir = os.path.dirname(store.version_url(1))
    host = os.uname().nodename
    dead = f".tmp-v000002-{host}-{_dead_pid()}-aaaa"  # a writer killed mid-publish
    legacy = ".tmp-v000002-0123abcd"  # older naming, two hours old
    live = f".tmp-v000002-{host}-{os.getpid()}-bbbb"  # a writer of this process: alive
    other = f".tmp-v000003-{host}-{_dead_pid()}-cccc"  # another version: not ours to judge
    for name in (dead, legacy, live, other):
        os.makedirs(os.path.join(wdir, name))
        open(os.path.join(wdir, name, "model.safetensors"), "wb").write(b"x" * 100)
    two_hours_ago = time.time() - 7200
    os.utime(os.path.join(wdir, legacy), (two_hours_ago, two_hours_ago))
    publish(store, 2)
    assert _weights_entries(store) == sorted([live, other, "v000001", "v000002"])


def test_disk_full_inside_write_removes_staging(tmp_path):
    """A real ENOSPC from the kernel (/dev/full) inside ``write``, with no context
    manager anywhere: the file aborts itself and the writer drops its staging."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    publish(store, 1)
    w = store.weights_writer(2, 2, 1)
    (stage,) = [n for n in _weights_entries(store) if n.startswith(".tmp-")]
    wdir = os.path.dirname(store.version_url(1))
    os.symlink("/dev/full", os.path.join(wdir, stage, "model.safetensors"))
    f = w.open("model.safetensors")
    with pytest.raises(OSError, match="No space left"):
        f.write(payload(0, 6 << 20))
    assert _weights_entries(store) == ["v000001"]
    with pytest.raises(StorageError, match="model.safetensors.*publish it again"):
        w.open("config.json")
    with pytest.raises(StorageError, match="model.safetensors"):
        w.commit()
    assert store.committed_versions() == [1]
