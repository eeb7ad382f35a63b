import pytest

from storage import IntegrityError, ManifestError, StorageError, VersionConflictError


def _save(store, k, files, meta=None):
    w = store.checkpoint_writer(k)
    for name, data in files.items():
        with w.open(name) as f:
            f.write(data)
    w.commit(meta or {"weights_version": k})


def test_commit_rule_files_then_commit(store):
    w = store.checkpoint_writer(4)
    with w.open("model.pt") as f:
        f.write(b"m" * 1000)
    with w.open("optim/rank0.pt") as f:
        f.write(b"o" * 500)
    assert store.committed_checkpoints() == []  # files alone are not a checkpoint
    with pytest.raises(ManifestError, match="never committed"):
        store.read_checkpoint_meta(4)
    w.commit({"weights_version": 4, "cursor": 7})
    assert store.committed_checkpoints() == [4]
    assert store.read_checkpoint_meta(4) == {"weights_version": 4, "cursor": 7}
    with store.open_checkpoint_file(4, "optim/rank0.pt") as f:
        assert f.read() == b"o" * 500
    store.verify_checkpoint(4)


def test_checkpoints_sorted_and_uncommitted_skipped(store):
    for k in (10, 2, 5):
        _save(store, k, {"model.pt": b"%d" % k})
    w = store.checkpoint_writer(11)
    with w.open("model.pt") as f:
        f.write(b"partial")
    assert store.committed_checkpoints() == [2, 5, 10]


def test_committed_checkpoint_is_not_rewritten(store):
    _save(store, 3, {"model.pt": b"abc"})
    _save(store, 3, {"model.pt": b"abc"})  # identical: no-op
    with pytest.raises(VersionConflictError, match="already committed"):
        _save(store, 3, {"model.pt": b"xyz"})
    with store.open_checkpoint_file(3, "model.pt") as f:
        assert f.read() == b"abc"


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "missing"])
def test_damaged_checkpoint_detected(store, damage):
    _save(store, 1, {"model.pt": b"a" * 100, "rng.pt": b"r" * 10})
    path = store.checkpoint_url(1) + "/model.pt"
    if damage == "corrupt":
        store.fs.pipe_file(path, b"b" + b"a" * 99)
    elif damage == "truncate":
        store.fs.pipe_file(path, b"a" * 50)
    else:
        store.fs.rm_file(path)
    with pytest.raises(IntegrityError, match="model.pt"):
        store.verify_checkpoint(1)
    with pytest.raises((IntegrityError, FileNotFoundError)):
        with store.open_checkpoint_file(1, "model.pt") as f:
            f.read()


def test_failed_file_blocks_commit(store):
    w = store.checkpoint_writer(1)
    with pytest.raises(RuntimeError):
        with w.open("model.pt") as f:
            f.write(b"x")
            raise RuntimeError("actor died")
    with pytest.raises(StorageError, match="model.pt"):
        w.commit({})
    assert store.committed_checkpoints() == []
