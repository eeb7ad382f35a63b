"""Delta versions (storage.delta): a real training step of the tiny model published
as a delta rebuilds bit-exact on local disk and S3; a damaged delta, a wrong base
and a missing base are refused with the version, base and file named; retention
keeps the bases kept deltas need; a crash mid-publish leaves no version."""

import hashlib
import os
import signal
import subprocess
import sys

import pytest
import torch

from storage import IntegrityError, RunStore, StorageConfig, StorageError, is_local
from storage.delta_format import DELTA_SUFFIX
from storage.retention import discard_version
from training.export import write_hf_weights


@pytest.fixture(scope="module")
def step_states(tiny_model_dir) -> tuple[str, dict, dict]:
    """(the tiny model's dir, its bf16 state before and after one real AdamW step)."""
    from transformers import AutoModelForCausalLM

    d = tiny_model_dir
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    before = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(
        0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0)
    )
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
    return d, before, after


def _publish(
    store: RunStore,
    v: int,
    state: dict,
    base_dir: str,
    every: int | None = 10,
    shard_size: int = 256 * 1024,
):
    w = store.weights_writer(v, v, v - 1 if v else None, full_every=every)
    write_hf_weights(w, state, shard_size, base_dir)
    return w.commit()


def _sha_dir(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name != "manifest.json":
            out[name] = hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
    return out


def test_a_training_step_published_as_a_delta_rebuilds_bit_exact(store, cfg, step_states, tmp_path):
    base_dir, before, after = step_states
    m0 = _publish(store, 0, before, base_dir)
    m1 = _publish(store, 1, after, base_dir)
    assert m0.delta is None and m1.delta is not None and m1.delta.base == 0
    assert any(f.name.endswith(DELTA_SUFFIX) for f in m1.files)
    # The same state published full elsewhere: the rebuilt files must be these bytes.
    full = RunStore(StorageConfig(root=str(tmp_path / "full")), "run1")
    f1 = _publish(full, 1, after, base_dir, every=None)
    assert m1.rebuilt().file_set() == f1.file_set()
    changed = sum((before[k] != after[k]).sum().item() for k in after)
    total = sum(t.numel() for t in after.values())
    assert 0 < changed < total  # a step changes some bf16 values, not all
    assert m1.total_bytes() < 0.5 * f1.total_bytes()

    pulled = store.pull(1, str(tmp_path / "cache"))
    assert pulled.base == 0 and pulled.bytes == f1.total_bytes()
    assert _sha_dir(pulled.path) == {f.name: f.sha256 for f in f1.files}
    # Engines load the rebuilt folder as any other; a raw delta folder is never loadable.
    from engines.embedded.weight_files import read_state_dict, verify_dir

    assert verify_dir(pulled.path).delta is None
    state = read_state_dict(pulled.path)
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert store.local_version_dir(1) is None  # engines pull (rebuild) it
    if is_local(store.fs):
        assert store.local_version_dir(0) == store.version_url(0)
        with pytest.raises(Exception, match="delta of v0"):
            verify_dir(store.version_url(1))
    # A second pull reuses the cache; materialize writes a full folder of its own bytes.
    assert store.pull(1, str(tmp_path / "cache")).copied is False
    out = store.materialize(1, str(tmp_path / "hf"))
    assert _sha_dir(out) == _sha_dir(pulled.path)
    assert all(os.stat(os.path.join(out, n)).st_nlink == 1 for n in os.listdir(out))


def test_damaged_delta_wrong_base_and_missing_base_are_refused(store, step_states, tmp_path):
    base_dir, before, after = step_states
    _publish(store, 0, before, base_dir)
    m1 = _publish(store, 1, after, base_dir)
    name = next(f.name for f in m1.files if f.name.endswith(DELTA_SUFFIX))
    path = f"{store.version_url(1)}/{name}"
    good = store.fs.cat_file(path)

    # Damaged delta (same size, one byte flipped): the pull's sha256 check refuses it.
    store.fs.pipe_file(path, good[:-5] + bytes([good[-5] ^ 1]) + good[-4:])
    with pytest.raises(IntegrityError, match=name):
        store.pull(1, str(tmp_path / "c1"), retries=0)
    assert not os.path.exists(tmp_path / "c1" / "v000001")
    store.fs.pipe_file(path, good)

    # A damaged base copy (its size intact): the base file is checked against its tree
    # before its chunk hashes stand for the rebuilt file's unchanged chunks.
    c2 = tmp_path / "c2"
    store.pull(0, str(c2))
    shard = name.removesuffix(DELTA_SUFFIX)
    b = c2 / "v000000" / shard
    data = bytearray(b.read_bytes())
    data[-3] ^= 0xFF
    os.unlink(b)  # the cache may be a hard link to the committed file
    b.write_bytes(bytes(data))
    with pytest.raises(
        IntegrityError,
        match=rf"v000001 \(a delta of v000000\): its base's '{shard}' .*: chunk 0 of 1 "
        r"\(bytes 0-\d+\) hashes to .*the cached base is damaged",
    ):
        store.pull(1, str(c2))
    assert not (c2 / "v000001").exists()

    # Wrong base: v0 republished with other bytes.
    discard_version(store.fs, os.path.dirname(store.version_url(0)), 0, lambda: None)
    assert store.version_state(1) == "damaged"  # its base is missing
    with pytest.raises(
        IntegrityError, match=r"v000001 \(a delta of v000000\): its base v000000 is missing"
    ):
        store.pull(1, str(tmp_path / "c3"))
    _publish(store, 0, after, base_dir)
    with pytest.raises(IntegrityError, match="is not the version it was made from"):
        store.pull(1, str(tmp_path / "c4"))


def _tiny_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16)}


def test_retention_keeps_the_base_of_every_kept_delta(tmp_path, tiny_model_dir):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    kinds = {}
    for v in range(7):  # full_every 3: 0 full, 1 2 deltas of 0, 3 full, 4 5 of 3, 6 full
        kinds[v] = _publish(store, v, _tiny_state(v), tiny_model_dir, every=3).delta
    assert [v for v, d in kinds.items() if d is None] == [0, 3, 6]
    report = store.gc(keep_last=3)  # keeps 4 5 6; 4 and 5 need 3
    assert report.kept_versions == [3, 4, 5, 6]
    assert report.protected == {3: "base of kept delta version 4"}
    assert report.deleted_versions == [0, 1, 2]
    for v in (4, 5):
        assert store.pull(v, str(tmp_path / "cache")).base == 3
    assert store.gc(keep_last=1).kept_versions == [6]


# Publishes v1 as a delta of v0 and stops mid-file until killed.
_KILLED_WRITER = r"""
import sys
from storage import RunStore, StorageConfig
w = RunStore(StorageConfig(root=sys.argv[1]), "r").weights_writer(1, 1, 0, full_every=10)
assert type(w).__name__ == "DeltaWriter"
f = w.open(sys.argv[3])
f.write(open(sys.argv[2], "rb").read())
print("writing", flush=True)
sys.stdin.read()
"""


def test_a_crash_during_a_delta_publish_leaves_no_version(cfg, step_states, tmp_path):
    store = RunStore(cfg, "r")
    base_dir, before, after = step_states
    m0 = _publish(store, 0, before, base_dir)
    shard = next(f.name for f in m0.files if f.name.endswith(".safetensors"))
    # An exception mid-file: nothing committed, nothing left behind.
    w = store.weights_writer(1, 1, 0, full_every=10)
    with pytest.raises(RuntimeError, match="boom"):
        with w:
            with w.open(shard) as f:
                f.write(b"\0" * 100)
                raise RuntimeError("boom")
    assert store.committed_versions() == [0] and store.version_state(1) == "absent"
    if not is_local(store.fs):
        return
    # SIGKILL mid-file: not a version; the next writer sweeps its staging.
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(10 << 20))  # more than one frame reaches the staging file
    p = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, cfg.root, str(big), shard],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdout.readline() == b"writing\n"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    wdir = os.path.dirname(store.version_url(0))
    assert store.committed_versions() == [0]
    assert any(n.startswith(".tmp-v000001") for n in os.listdir(wdir))
    m1 = _publish(store, 1, after, base_dir)
    assert m1.delta is not None and store.committed_versions() == [0, 1]
    assert not any(n.startswith(".tmp-") for n in os.listdir(wdir))


def test_a_delta_writer_refuses_a_base_that_changed_on_disk(tmp_path, step_states):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    base_dir, before, after = step_states
    m0 = _publish(store, 0, before, base_dir, every=None)  # another writer's base
    shard = next(f.name for f in m0.files if f.name.endswith(".safetensors"))
    p = os.path.join(store.version_url(0), shard)
    data = bytearray(open(p, "rb").read())
    data[-1] ^= 1
    open(p, "wb").write(bytes(data))  # bit rot under a committed version
    with pytest.raises(StorageError, match=rf"base v000000 of v000001: '{shard}'"):
        _publish(store, 1, after, base_dir)
    assert store.committed_versions() == [0]


def test_bit_rot_under_a_base_this_process_wrote_is_refused_at_pull(tmp_path, step_states):
    """The publisher trusts the hashes of a full version it committed itself (it hashed
    the bytes it wrote) while the file's inode, size and mtime stay; rot that keeps them
    makes a delta nobody can rebuild, and the pull refuses it (its base first) instead
    of serving it."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    base_dir, before, after = step_states
    m0 = _publish(store, 0, before, base_dir)
    shard = next(f.name for f in m0.files if f.name.endswith(".safetensors"))
    p = os.path.join(store.version_url(0), shard)
    st = os.stat(p)
    with open(p, "r+b") as f:  # in place: the same inode and size
        f.seek(st.st_size - 1)
        last = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([last[0] ^ 1]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # rot leaves mtime as it was
    assert _publish(store, 1, after, base_dir).delta is not None
    with pytest.raises(IntegrityError, match=r"v000000 failed verification"):
        store.pull(1, str(tmp_path / "c"))
    assert not (tmp_path / "c" / "v000001").exists()


def test_the_materialize_command_writes_any_version_as_a_full_folder(
    tmp_path, tiny_model_dir, capsys
):
    from flows.cli import main

    root = str(tmp_path / "runs")
    store = RunStore(StorageConfig(root=root), "r")
    _publish(store, 0, _tiny_state(0), tiny_model_dir)
    m1 = _publish(store, 1, _tiny_state(1), tiny_model_dir)
    assert m1.delta is not None
    assert main(["materialize", "r", "1", str(tmp_path / "hf1"), "--root", root]) == 0
    assert _sha_dir(str(tmp_path / "hf1")) == {f.name: f.sha256 for f in m1.delta.full}
    assert main(["materialize", "r", "7", str(tmp_path / "hf7"), "--root", root]) == 2
    assert "v000007" in capsys.readouterr().err and not (tmp_path / "hf7").exists()


def test_files_that_do_not_line_up_with_the_base_still_rebuild_exactly(tmp_path):
    """Raw (non-safetensors) files, sizes that differ from the base's, an empty file, a
    new file and an unchanged one: each rebuilds to its own bytes."""
    import numpy as np

    from storage.safetensors_io import TensorEntry, write_safetensors

    def st(n: int) -> bytes:
        import io

        a = np.arange(n, dtype=np.uint16)
        buf = io.BytesIO()
        write_safetensors(
            buf, [TensorEntry("a", "BF16", (n,), a.tobytes()), TensorEntry("b", "U8", (3,), b"xyz")]
        )
        return buf.getvalue()

    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    v0 = {
        "model.safetensors": st(1000),
        "raw.bin": os.urandom(5000),
        "same.json": b"{}",
        "gone.txt": b"x",
    }
    v1 = {
        "model.safetensors": st(1200),  # another header, tensor 'a' of another size
        "raw.bin": v0["raw.bin"][:3000] + b"tail",  # shorter than the base's
        "same.json": b"{}",
        "empty.bin": b"",
        "new.bin": os.urandom(100),
    }
    for v, files in ((0, v0), (1, v1)):
        w = store.weights_writer(v, v, None, full_every=5)
        for name, data in files.items():
            with w.open(name) as f:
                f.write(data)
        m = w.commit()
    assert m.delta is not None and {f.name: f.bytes for f in m.delta.full} == {
        n: len(b) for n, b in v1.items()
    }
    pulled = store.pull(1, str(tmp_path / "cache")).path
    assert {
        n: open(os.path.join(pulled, n), "rb").read()
        for n in os.listdir(pulled)
        if n != "manifest.json"
    } == v1


def test_a_file_of_many_frames_rebuilds_exactly_and_a_late_damage_is_refused(tmp_path):
    """A file several zstd frames long (decoded on every core): it rebuilds bit-exact;
    a base damaged inside its last frame is refused, its chunk named."""
    import numpy as np

    from storage.delta_format import FRAME

    n = 2 * FRAME + 12345  # three frames
    base = np.resize(np.arange(251, dtype=np.uint8), n)
    new = base.copy()
    new[::4093] ^= 0x5A  # a change in every frame
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    for v, data in ((0, base), (1, new)):
        w = store.weights_writer(v, v, None, full_every=5)
        with w.open("big.bin") as f:
            f.write(data)
        m = w.commit()
    assert m.delta is not None and m.files[0].bytes < n // 10
    pulled = store.pull(1, str(tmp_path / "c1")).path
    assert open(os.path.join(pulled, "big.bin"), "rb").read() == new.tobytes()

    c2 = tmp_path / "c2"
    b = os.path.join(store.pull(0, str(c2)).path, "big.bin")
    damaged = bytearray(base.tobytes())
    damaged[n - 7] ^= 1
    os.unlink(b)  # the cache may be a hard link to the committed file
    open(b, "wb").write(damaged)
    with pytest.raises(
        IntegrityError, match=r"v000001 \(a delta of v000000\): its base's 'big.bin' .*chunk 2 of 3"
    ):
        store.pull(1, str(c2))
    assert not (c2 / "v000001").exists()


def test_a_version_is_the_same_bytes_however_many_shards_are_written_at_once(
    step_states, tmp_path, monkeypatch
):
    # Shards are written one per core (2 to MAX_SHARD_WRITERS at once), and a delta's
    # files share the frames in flight: none of that may change a byte that is stored.
    # The fewest writers (2) against the most (8), on a pretended 8-core machine.
    from storage import safetensors_io, tree

    base_dir, before, after = step_states
    monkeypatch.setattr(tree, "workers", lambda: 8)
    published = []
    for at_once in (2, 8):
        monkeypatch.setattr(safetensors_io, "MAX_SHARD_WRITERS", at_once)
        store = RunStore(StorageConfig(root=str(tmp_path / f"at-once-{at_once}")), "run1")
        full = _publish(store, 0, before, base_dir, shard_size=12 * 1024)
        delta = _publish(store, 1, after, base_dir, shard_size=12 * 1024)
        published.append(
            (full, delta, _sha_dir(store.pull(1, str(tmp_path / f"pull-{at_once}")).path))
        )
    (full2, delta2, pulled2), (full8, delta8, pulled8) = published
    shards = [f for f in full8.files if f.name.endswith(".safetensors")]
    assert len(shards) > 8  # more shards than writers: each writer takes several
    assert full2.file_set() == full8.file_set()
    assert delta2.delta is not None and delta8.delta is not None
    assert delta2.file_set() == delta8.file_set()  # the stored delta files, byte for byte
    assert delta2.rebuilt().file_set() == delta8.rebuilt().file_set()
    assert pulled2 == pulled8
