"""Adapter versions (``train.lora``): peft's two files committed like any version, with
the identity of the base they apply to. A pull verifies them, names a damaged file,
and refuses an adapter whose base is gone or was republished with other bytes;
retention keeps a kept adapter's base; manifests of full versions read and write
as before."""

from __future__ import annotations

import json

import pytest
from store_helpers import payload, publish

from storage import IntegrityError, RunStore
from storage.fs import write_bytes
from storage.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST
from storage.types import WeightsManifest

ADAPTER_FILES = {
    ADAPTER_WEIGHTS: payload(7, 40_000),
    ADAPTER_CONFIG: json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}).encode(),
}


def publish_adapter(store: RunStore, version: int) -> WeightsManifest:
    """``version`` as an adapter of v0, written as the trainer writes one."""
    w = store.weights_writer(version, iteration=version, parent=version - 1)
    for name, data in ADAPTER_FILES.items():
        with w.open(name) as f:
            f.write(data)
    return w.commit(adapter=store.adapter_of(0))


def test_an_adapter_version_is_committed_pulled_and_verified_with_its_base(store, tmp_path):
    base = publish(store, 0)
    m = publish_adapter(store, 1)
    assert m.adapter is not None and m.adapter.base == 0
    assert m.adapter.base_digest == base.digest()
    assert store.read_manifest(1) == m
    assert store.version_state(1) == "committed"
    raw = json.loads(store.fs.cat(f"{store.version_url(1)}/{MANIFEST}"))
    assert raw["adapter"] == {"base": 0, "base_digest": base.digest(), "format": "peft-lora"}
    # the files carry the same hashes as any version's, and a pull verifies them
    assert all(f.tree is not None for f in m.files)
    pulled = store.pull(1, str(tmp_path / "cache"))
    assert sorted(p.name for p in (tmp_path / "cache" / "v000001").iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST]
    )
    assert pulled.bytes == sum(len(d) for d in ADAPTER_FILES.values())
    # a full version's manifest has no adapter key: its bytes are what they were
    assert "adapter" not in json.loads(store.fs.cat(f"{store.version_url(0)}/{MANIFEST}"))


def test_a_flipped_byte_in_an_adapter_file_is_refused_and_named(store, tmp_path):
    publish(store, 0)
    publish_adapter(store, 1)
    path = f"{store.version_url(1)}/{ADAPTER_WEIGHTS}"
    data = bytearray(store.fs.cat(path))
    data[12_345] ^= 0x01
    write_bytes(store.fs, path, bytes(data))
    with pytest.raises(IntegrityError, match=ADAPTER_WEIGHTS.replace(".", r"\.")):
        store.pull(1, str(tmp_path / "cache"))
    with pytest.raises(IntegrityError, match=ADAPTER_WEIGHTS.replace(".", r"\.")):
        store.verify_version(1)


def test_an_adapter_whose_base_changed_or_is_gone_is_refused_naming_both(store, tmp_path):
    publish(store, 0)
    m = publish_adapter(store, 1)
    # v0 republished with other bytes (after a gc): the adapter was trained on another base
    forged = m.model_copy(
        update={"adapter": m.adapter.model_copy(update={"base_digest": "ab" * 32})}
    )
    write_bytes(store.fs, f"{store.version_url(1)}/{MANIFEST}", json.dumps(forged.dump()).encode())
    got = store.read_manifest(0).digest()[:12]
    with pytest.raises(IntegrityError, match=rf"trained on v000000 .*abababab.*digest {got}"):
        store.pull(1, str(tmp_path / "cache"))
    # its base deleted: damaged (retention never does this), and a pull names the base
    store.fs.rm(f"{store.version_url(0)}/{MANIFEST}")
    assert store.version_state(1) == "damaged"
    assert "adapter of v0" in store.version_problem(1)
    with pytest.raises(IntegrityError, match="its base v000000 is missing"):
        store.pull(1, str(tmp_path / "cache2"))


def test_retention_keeps_the_base_of_every_kept_adapter(store):
    publish(store, 0)
    for v in (1, 2, 3):
        publish_adapter(store, v)
    report = store.gc(keep_last=2)
    assert report.deleted_versions == [1]
    assert report.protected == {0: "base of kept adapter version 2"}
    assert store.committed_versions() == [0, 2, 3]


def test_an_adapter_applies_only_to_a_full_version(store):
    publish(store, 0)
    publish_adapter(store, 1)
    with pytest.raises(IntegrityError, match="v000001 is an adapter"):
        store.adapter_of(1)
    with pytest.raises(ValueError, match="adapter base v2 is not older than version 1"):
        WeightsManifest.model_validate(
            {**store.read_manifest(1).dump(), "adapter": {"base": 2, "base_digest": "0" * 64}}
        )
