"""The delta codecs (storage.delta_format): ``xor-words`` (written now) round-trips real
safetensors and raw files bit-exact, through every shape of frame (unchanged and
changed chunks, a length that is no multiple of 8, the header-bearing first frame);
its frames hold the nonzero words as byte planes; a publisher encodes a file's frames
on a pool into the same bytes whatever its threads and frames in flight, and an
encode that fails leaves no version; a damaged frame, a file whose magic disagrees
with its manifest's codec and a malformed frame are each an IntegrityError naming
the file; and a run store written by the ``xor-zstd`` writer (``data/xor_zstd``,
generated once by the code of e9e718b: v0 full, v1 a delta of it) still pulls to
the very bytes it was made from."""

import hashlib
import io
import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import zstandard

from storage import IntegrityError, RunStore, StorageConfig, is_local
from storage import delta as delta_mod
from storage import tree as tree_mod
from storage.delta_format import (
    CODECS,
    DELTA_SUFFIX,
    FRAME,
    MAGICS,
    RAW,
    TENSORS,
    FrameWriter,
    XorWords,
    encode,
    read_mode,
)
from storage.layout import MANIFEST
from storage.safetensors_io import TensorEntry, write_safetensors
from storage.weights import verify_dir

XOR_ZSTD = Path(__file__).parent / "data" / "xor_zstd"


def _st(tensors: dict[str, tuple[str, bytes]]) -> bytes:
    size = {"BF16": 2, "U8": 1, "F32": 4}
    buf = io.BytesIO()
    write_safetensors(
        buf, [TensorEntry(n, d, (len(b) // size[d],), b) for n, (d, b) in tensors.items()]
    )
    return buf.getvalue()


def _publish(store: RunStore, v: int, files: dict[str, bytes]):
    w = store.weights_writer(v, v, v - 1 if v else None, full_every=5)
    for name, data in files.items():
        with w.open(name) as f:
            f.write(data)
    return w.commit()


def _read_back(path: str) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path) if n != MANIFEST}


def _versions() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """v0 and v1: a three-chunk bf16 tensor whose middle chunk alone changes, a new
    tensor, a file of a length no multiple of 8, a raw file and a new one."""
    rng = np.random.default_rng(3)
    big = rng.integers(0, 1 << 16, (2 * FRAME + 4321) // 2, dtype=np.uint16)
    moved = big.copy()
    moved[FRAME // 2 + 7 : FRAME - 4096 : 997] ^= 1  # low mantissa bits, in chunk 1 only
    odd = rng.integers(0, 256, 13, dtype=np.uint8).tobytes()
    raw = rng.integers(0, 256, 20_003, dtype=np.uint8).tobytes()
    v0 = {
        "model.safetensors": _st({"w": ("BF16", big.tobytes()), "b": ("U8", odd)}),
        "raw.bin": raw,
    }
    v1 = {
        "model.safetensors": _st({"w": ("BF16", moved.tobytes()), "b": ("U8", odd)}),
        "small.safetensors": _st({"b": ("U8", odd[::-1]), "new": ("BF16", b"\1\2\3\4")}),
        "raw.bin": raw[:9_000] + bytes([raw[9_000] ^ 0x80]) + raw[9_001:] + b"tail",
    }
    v0["small.safetensors"] = _st({"b": ("U8", odd)})
    return v0, v1


def test_xor_words_round_trips_every_kind_of_frame(store, tmp_path):
    v0, v1 = _versions()
    assert len(v1["model.safetensors"]) % 8 and len(v1["raw.bin"]) % 8
    m0 = _publish(store, 0, v0)
    m1 = _publish(store, 1, v1)
    assert m1.delta is not None and m1.delta.codec == "xor-words"
    assert {f.name for f in m1.files} == {n + DELTA_SUFFIX for n in v1}
    heads = {n: store.fs.cat_file(f"{store.version_url(1)}/{n}{DELTA_SUFFIX}")[:7] for n in v1}
    word = MAGICS["xor-words"]
    assert heads == {
        "model.safetensors": word + TENSORS,
        "small.safetensors": word + TENSORS,  # a new tensor: its bytes stored as they are
        "raw.bin": word + RAW,
    }
    # Chunks 0 and 2 of the big file are the base's: their hashes are the base's.
    full = {f.name: f for f in m1.delta.full}["model.safetensors"].tree
    base = {f.name: f for f in m0.files}["model.safetensors"].tree
    assert full.hashes[0] == base.hashes[0] and full.hashes[2] == base.hashes[2]
    assert full.hashes[1] != base.hashes[1]
    # Only the changed words are stored: far less than the 16 MiB of the file.
    assert m1.total_bytes() < 100_000

    pulled = store.pull(1, str(tmp_path / "cache")).path
    assert _read_back(pulled) == v1
    assert verify_dir(pulled).files == m1.delta.full


def test_the_words_codec_decodes_what_it_encodes(tmp_path):
    """Frames of every length class: empty words, all words, a tail only, zeros."""
    rng = np.random.default_rng(5)
    cases = [np.zeros(64, np.uint8), rng.integers(1, 256, 64, dtype=np.uint8)]
    cases += [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 7, 8, 9, 1001)]
    sparse = np.zeros(4099, np.uint8)
    sparse[[0, 15, 16, 800, 4095, 4098]] = 1
    cases.append(sparse)
    buf = io.BytesIO()
    w = FrameWriter(buf, RAW)
    for x in cases:
        w.add(len(x), encode(x))
    buf.seek(0)
    assert read_mode(buf, "xor-words", "f") == RAW
    frames = list(XorWords().frames(buf, "f", FRAME))
    assert [n for _, n in frames] == [len(x) for x in cases]
    for (c, n), x in zip(frames, cases):
        image = rng.integers(0, 256, n, dtype=np.uint8)
        want = image ^ x
        changes = XorWords().apply(c, image, np.empty(n, np.uint8), "f")
        assert np.array_equal(image, want)
        for lo, hi in ((0, n), (0, n // 2 // 8 * 8), (n - n % 8, n)):  # word-aligned: exact
            assert changes.zero(lo, hi) == (not x[lo:hi].any())
        for lo, hi in ((1, n // 2), (n // 2, n)):  # never zero while a byte of it is not
            assert not (changes.zero(lo, hi) and x[lo:hi].any())
        out = np.empty(n, np.uint8)
        XorWords().xor(c, out, np.empty(n, np.uint8), "f")
        assert np.array_equal(out, x)


def test_a_words_frame_holds_the_bitmap_the_byte_planes_and_the_tail():
    x = np.zeros(27, np.uint8)  # words 0 and 2 nonzero, then 3 bytes of tail
    x[0:8] = np.arange(1, 9)
    x[16:24] = np.arange(11, 19)
    x[24:] = (7, 0, 9)
    planes = bytes(b for j in range(8) for b in (1 + j, 11 + j))
    assert zstandard.decompress(encode(x)) == b"\5" + planes + b"\7\0\11"


def _many_frames() -> tuple[dict[str, bytes], dict[str, bytes]]:
    """v0 and v1 of a file five frames long and a safetensors file of three, changed
    all over (every frame has changed words)."""
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, 4 * FRAME + 999, dtype=np.uint8)
    raw1 = raw.copy()
    raw1[::4097] ^= rng.integers(1, 256, len(raw1[::4097]), dtype=np.uint8)
    w = rng.integers(0, 1 << 16, (2 * FRAME + 100) // 2, dtype=np.uint16)
    w1 = w.copy()
    w1[::37] ^= 3
    v0 = {"big.bin": raw.tobytes(), "m.safetensors": _st({"w": ("BF16", w.tobytes())})}
    v1 = {"big.bin": raw1.tobytes(), "m.safetensors": _st({"w": ("BF16", w1.tobytes())})}
    return v0, v1


def test_the_encoded_bytes_do_not_depend_on_threads_or_frames_in_flight(monkeypatch, tmp_path):
    v0, v1 = _many_frames()
    stored = []
    for threads, ahead in ((1, 1), (4, 8)):
        with ThreadPoolExecutor(threads) as pool:
            monkeypatch.setattr(tree_mod, "pool", lambda pool=pool: pool)
            monkeypatch.setattr(delta_mod, "AHEAD", ahead)
            store = RunStore(StorageConfig(root=str(tmp_path / f"runs{threads}")), "r")
            _publish(store, 0, v0)
            m1 = _publish(store, 1, v1)
            vdir = Path(store.version_url(1))
            stored.append({f.name: (vdir / f.name).read_bytes() for f in m1.files})
            assert _read_back(store.pull(1, str(tmp_path / f"c{threads}")).path) == v1
    assert stored[0] == stored[1] and set(stored[0]) == {n + DELTA_SUFFIX for n in v1}


def test_an_encode_that_fails_aborts_the_publish_and_leaves_no_version(cfg, monkeypatch):
    store = RunStore(cfg, "r")
    v0, v1 = _many_frames()
    _publish(store, 0, v0)
    calls = []

    def failing(x: np.ndarray) -> bytes:
        calls.append(len(x))
        if len(calls) == 3:
            raise MemoryError("encode")
        return encode(x)

    monkeypatch.setattr(delta_mod, "encode", failing)
    with pytest.raises(MemoryError, match="encode"):
        with store.weights_writer(1, 1, 0, full_every=5) as w:
            for name, data in v1.items():
                with w.open(name) as f:
                    f.write(data)
            w.commit()
    assert store.committed_versions() == [0] and store.version_state(1) == "absent"
    if is_local(store.fs):
        wdir = os.path.dirname(store.version_url(0))
        assert not any(n.startswith(".tmp-") for n in os.listdir(wdir))
    monkeypatch.setattr(delta_mod, "encode", encode)
    assert _publish(store, 1, v1).delta is not None


def _frame(n: int, payload: bytes, size: int | None = None) -> bytes:
    c = zstandard.ZstdCompressor(level=1).compress(payload)
    return struct.pack("<II", n, len(c) if size is None else size) + c


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (_frame(FRAME + 1, b""), rf"a frame claims {FRAME + 1} bytes \(limit {FRAME}\)"),
        (_frame(0, b""), r"a frame claims 0 bytes"),
        (_frame(16, b"\1")[:-3], r"ends inside a frame \("),
        (_frame(16, b"\1")[:5], r"ends inside a frame's head"),
        (_frame(16, b"", size=4) + b"junk", r"does not decompress"),
        (_frame(16, b""), r"ends inside its bitmap"),
        (_frame(16, b"\4" + bytes(8)), r"bitmap marks words past its end"),
        (
            _frame(16, b"\3" + bytes(8)),
            r"holds 9 bytes, but its bitmap and the 2 words it marks make 17",
        ),
        (
            _frame(17, b"\1" + bytes(8)),
            r"holds 9 bytes, but its bitmap and the 1 words it marks make 10",
        ),
        (_frame(16, b"\1" + bytes(8)) + b"", None),
        (_frame(16, b"\1" + bytes(8)) + b"\0\0", r"ends inside a frame's head"),
    ],
    ids=[
        "too long",
        "empty",
        "cut short",
        "head cut short",
        "not zstd",
        "no bitmap",
        "bits past the words",
        "fewer words",
        "no tail",
        "well formed",
        "a head after the last",
    ],
)
def test_a_malformed_words_frame_is_refused_and_the_file_named(frame, why):
    def decode() -> None:
        f = io.BytesIO(frame)
        for c, n in XorWords().frames(f, "'x.bin.xor.zst'", FRAME):
            XorWords().apply(c, np.zeros(n, np.uint8), np.empty(n, np.uint8), "'x.bin.xor.zst'")

    if why is None:
        decode()
        return
    with pytest.raises(IntegrityError, match=rf"'x.bin.xor.zst'.*{why}"):
        decode()


def test_bytes_after_a_words_frame_inside_it_are_refused():
    c = zstandard.ZstdCompressor(level=1).compress(b"\1" + bytes(8))
    for extra, why in ((b"junk", "does not decompress"), (c, "holds more than its bitmap")):
        f = io.BytesIO(struct.pack("<II", 16, len(c + extra)) + c + extra)
        with pytest.raises(IntegrityError, match=rf"'x'.*{why}"):
            for c2, n in XorWords().frames(f, "'x'", FRAME):
                XorWords().apply(c2, np.zeros(n, np.uint8), np.empty(n, np.uint8), "'x'")


def _resign(vdir: Path, name: str) -> None:
    """Make the manifest's entry of stored file ``name`` match its bytes as they are now
    (as a writer that encoded them wrong would have), so only the rebuild can tell."""
    data = (vdir / name).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    digests = [tree_mod.digest(data[i : i + FRAME]) for i in range(0, len(data), FRAME)]
    raw = json.loads((vdir / MANIFEST).read_text())
    for f in raw["files"]:
        if f["name"] == name:
            f["sha256"] = sha
            f["bytes"] = len(data)
            f["tree"] = tree_mod.make(len(data), sha, digests).model_dump()
    (vdir / MANIFEST).write_text(json.dumps(raw))


def test_a_damaged_delta_file_is_refused_and_named_never_rebuilt_wrong(tmp_path):
    """A flipped byte anywhere in a delta file: the pull's check of the stored file
    refuses it; one its manifest vouches for (re-hashed) is refused by the decoder or
    by the rebuilt file's tree, never served."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")
    rng = np.random.default_rng(9)
    a = rng.integers(0, 1 << 16, 300, dtype=np.uint16)
    b = a.copy()
    b[::17] ^= 3
    _publish(store, 0, {"m.safetensors": _st({"a": ("BF16", a.tobytes())})})
    new = _st({"a": ("BF16", b.tobytes())})
    _publish(store, 1, {"m.safetensors": new})
    vdir = Path(store.version_url(1))
    name = "m.safetensors" + DELTA_SUFFIX
    good = (vdir / name).read_bytes()
    manifest = (vdir / MANIFEST).read_bytes()
    cache = tmp_path / "cache"
    store.pull(0, str(cache))
    for at in range(len(good)):
        damaged = bytearray(good)
        damaged[at] ^= 0x41
        (vdir / name).write_bytes(bytes(damaged))
        with pytest.raises(IntegrityError, match=name):
            store.pull(1, str(cache), retries=0)
        _resign(vdir, name)
        try:
            path = store.pull(1, str(cache), retries=0).path
        except IntegrityError as e:
            assert "'m.safetensors" in str(e)
            assert not (cache / "v000001").exists()
        else:  # a byte the decoding never reads (a zstd window size): the bytes are right
            assert _read_back(path) == {"m.safetensors": new}
            shutil.rmtree(path)
        (vdir / MANIFEST).write_bytes(manifest)
    (vdir / name).write_bytes(good)
    assert store.pull(1, str(cache)).base == 0


@pytest.fixture
def xor_zstd(tmp_path) -> RunStore:
    """A copy of ``data/xor_zstd/store``: v1 is a delta of v0 written by the
    ``xor-zstd`` writer (tensor and raw modes, a file equal to the base's, a new one)."""
    shutil.copytree(XOR_ZSTD / "store", tmp_path / "runs")
    return RunStore(StorageConfig(root=str(tmp_path / "runs")), "r")


def test_an_xor_zstd_delta_still_pulls_to_its_bytes(xor_zstd, tmp_path):
    store = xor_zstd
    m1 = store.read_manifest(1)
    assert m1.delta is not None and m1.delta.codec == "xor-zstd"
    for f in m1.files:
        if f.name.endswith(DELTA_SUFFIX):
            head = open(os.path.join(store.version_url(1), f.name), "rb").read(6)
            assert head == MAGICS["xor-zstd"]
    want = {n: (XOR_ZSTD / "v1" / n).read_bytes() for n in os.listdir(XOR_ZSTD / "v1")}
    pulled = store.pull(1, str(tmp_path / "cache")).path
    assert _read_back(pulled) == want
    assert verify_dir(pulled).files == m1.delta.full
    assert store.verify_version(1) == m1
    # A new delta of the same base is written with the codec of now, and rebuilds.
    v2 = dict(want, **{"raw.bin": want["raw.bin"][::-1]})
    m2 = _publish(store, 2, v2)
    assert m2.delta is not None and m2.delta.codec == "xor-words"
    assert _read_back(store.pull(2, str(tmp_path / "cache")).path) == v2


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_file_whose_magic_disagrees_with_its_codec_is_refused(codec, xor_zstd, tmp_path):
    """The xor-zstd fixture's v1, and a fresh xor-words delta, each with the other
    codec written into its manifest."""
    store = xor_zstd
    v = 1
    if codec == "xor-words":
        v = 2
        _publish(store, v, {"raw.bin": (XOR_ZSTD / "v1" / "raw.bin").read_bytes()[::-1]})
    vdir = Path(store.version_url(v))
    other = next(c for c in CODECS if c != codec)
    raw = json.loads((vdir / MANIFEST).read_text())
    assert raw["delta"]["codec"] == codec
    raw["delta"]["codec"] = other
    (vdir / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(
        IntegrityError,
        match=rf"\.xor\.zst' is a '{codec}' delta file but its manifest says '{other}'",
    ):
        store.pull(v, str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / f"v00000{v}").exists()
