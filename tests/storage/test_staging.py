"""A failed publish leaves no staging behind (a full disk in write or in close), and a
new writer or the retention pass sweeps whatever staging no live writer holds."""

import os
import subprocess
import sys
from pathlib import Path

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


# A writer in another process, alive until its stdin closes: its staging is held.
_LIVE_WRITER = r"""
import sys
from storage import RunStore, StorageConfig

w = RunStore(StorageConfig(root=sys.argv[1]), "r").weights_writer(4, 4, 3)
with w.open("config.json") as f:
    f.write(b"{}")
print("writing", flush=True)
sys.stdin.read()
"""


def test_a_new_writer_sweeps_the_staging_no_live_writer_holds(tmp_path):
    """Left behind: a killed writer's staging, and one of a writer of this very process
    (a train actor lives on after its publish failed) whose caller never aborted it.
    Both go at the next publish, of any version; live writers' staging stays, in this
    process and in another."""
    root = str(tmp_path / "runs")
    store = RunStore(StorageConfig(root=root), "r")
    publish(store, 1)
    wdir = os.path.dirname(store.version_url(1))
    host = os.uname().nodename
    dead = f".tmp-v000002-{host}-{_dead_pid()}-aaaa"  # a writer killed mid-publish
    legacy = ".tmp-v000002-0123abcd"  # older naming
    mine = f".tmp-v000003-{host}-{os.getpid()}-bbbb"  # this process, no writer holds it
    for name in (dead, legacy, mine):
        os.makedirs(os.path.join(wdir, name))
        open(os.path.join(wdir, name, "model.safetensors"), "wb").write(b"x" * 100)
    here = store.weights_writer(5, 5, 4)  # live, in this process
    other = subprocess.Popen(
        [sys.executable, "-c", _LIVE_WRITER, root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    try:
        assert other.stdout.readline().strip() == "writing"
        live = sorted(
            n for n in _weights_entries(store) if n.startswith((".tmp-v000004", ".tmp-v000005"))
        )
        assert len(live) == 2
        publish(store, 2)
        assert _weights_entries(store) == sorted([*live, "v000001", "v000002"])
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    # The other process ended without committing: its staging is no writer's any more.
    with here.open("config.json") as f:
        f.write(b"{}")
    here.commit()
    publish(store, 6)
    assert _weights_entries(store) == ["v000001", "v000002", "v000005", "v000006"]


def test_a_file_whose_tail_meets_a_full_disk_at_close_removes_staging(tmp_path):
    """A real ENOSPC (/dev/full) when ``close`` writes the buffered tail of a small file,
    as a config.json or an index does on a full disk: the writer drops its staging."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    publish(store, 1)
    w = store.weights_writer(2, 2, 1)
    (stage,) = [n for n in _weights_entries(store) if n.startswith(".tmp-")]
    wdir = os.path.dirname(store.version_url(1))
    os.symlink("/dev/full", os.path.join(wdir, stage, "config.json"))
    with pytest.raises(OSError, match="No space left"):
        with w.open("config.json") as f:
            f.write(b'{"model_type": "llama"}')  # gathered: written at close
    assert _weights_entries(store) == ["v000001"]
    with pytest.raises(StorageError, match="config.json.*publish it again"):
        w.commit()


def test_retention_removes_staging_that_no_live_writer_holds(tmp_path):
    """Two failed attempts at v3 left their staging (the run gave up); the next
    retention pass removes both, and leaves the staging of a live writer."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    for v in (1, 2):
        publish(store, v)
    live = store.weights_writer(4, 4, 3)
    wdir = os.path.dirname(store.version_url(1))
    left = [f".tmp-v000003-{os.uname().nodename}-{os.getpid()}-{i}" for i in "ab"]
    for name in left:
        os.makedirs(os.path.join(wdir, name))
        open(os.path.join(wdir, name, "model.safetensors"), "wb").write(b"x" * 100)
    report = store.gc(keep_last=5)
    assert sorted(os.path.basename(p) for p in report.removed_debris) == left
    (staged,) = [n for n in _weights_entries(store) if n.startswith(".tmp-")]
    assert staged.startswith(".tmp-v000004")
    live.abort()
    assert _weights_entries(store) == ["v000001", "v000002"]


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
