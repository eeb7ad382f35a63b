from store_helpers import publish


def _ckpt(store, k, wv):
    w = store.checkpoint_writer(k)
    with w.open("model.pt") as f:
        f.write(b"%d" % k)
    w.commit({"weights_version": wv})


def test_gc_keeps_last_served_and_referenced(store):
    for v in range(7):
        publish(store, v)
    for k in (1, 3, 5, 6):
        _ckpt(store, k, wv=k)
    store.record_serving(0, 2)  # an engine still serves v2
    # checkpoint 5 (kept with keep_last=2) references v5; 6 references v6
    report = store.gc(keep_last=2)
    assert store.committed_versions() == [2, 5, 6]
    assert store.committed_checkpoints() == [5, 6]
    assert report.deleted_versions == [0, 1, 3, 4]
    assert report.deleted_checkpoints == [1, 3]
    assert report.protected == {2: "served by engine 0"}
    assert not store.fs.exists(store.version_url(0))
    # referenced by a kept checkpoint although older than the last N
    _ckpt(store, 7, wv=2)
    store.record_serving(0, 6)
    publish(store, 7)
    report = store.gc(keep_last=1)
    assert store.committed_versions() == [2, 6, 7]
    assert report.protected == {6: "served by engine 0", 2: "referenced by kept checkpoint 7"}


def test_gc_removes_torn_old_versions_only(store):
    publish(store, 1)
    publish(store, 3)
    for v in (2, 4):  # torn: files without manifest
        store.fs.makedirs(store.version_url(v), exist_ok=True)
        store.fs.pipe_file(store.version_url(v) + "/model.safetensors", b"x")
    report = store.gc(keep_last=5)
    assert report.removed_debris == [store.version_url(2)]  # v4 may be a publish in progress
    assert store.committed_versions() == [1, 3]
