import json

import pytest
from s3_server import FAKE_KEY_ID, FAKE_SECRET

from storage import RunStore, S3Options, StorageConfig, StorageError, is_local, open_root


def test_open_root_local_forms(tmp_path):
    fs, root = open_root(str(tmp_path / "r"))
    assert is_local(fs) and root == str(tmp_path / "r")
    fs2, root2 = open_root(f"file://{tmp_path}/r/")
    assert is_local(fs2) and root2 == str(tmp_path / "r")


def test_open_root_refuses_credentials_in_url():
    with pytest.raises(StorageError, match="AWS_ACCESS_KEY_ID"):
        open_root("s3://AKIA:secret@bucket/prefix")


def test_s3_credentials_never_in_url_or_run_json(s3_endpoint):
    cfg = StorageConfig(root="s3://prefect-rl-test/creds", s3=S3Options(endpoint_url=s3_endpoint))
    store = RunStore(cfg, "r")
    assert not is_local(store.fs)
    assert store.url == "s3://prefect-rl-test/creds/r"
    store.write_run_json({"config": cfg.model_dump(), "code": "abc"})
    raw = store.fs.cat_file(store.url + "/run.json").decode()
    assert FAKE_KEY_ID not in raw and FAKE_SECRET not in raw
    assert FAKE_SECRET not in store.url and FAKE_KEY_ID not in repr(store.__dict__)
    assert json.loads(raw)["code"] == "abc"
    with pytest.raises(StorageError, match="AWS_SECRET_ACCESS_KEY"):
        store.write_run_json({"oops": FAKE_SECRET})


def test_run_json_and_rollouts(store):
    assert not store.exists() and store.read_run_json() is None
    store.write_run_json({"a": 1})
    assert store.exists() and store.read_run_json() == {"a": 1}
    url = store.write_rollouts(3, {"samples": [1, 2]})
    assert url.endswith("rollouts/iter_000003.json")
    # committed = kept: a second write does not replace it
    assert store.write_rollouts(3, {"samples": [9]}) == url
    assert store.read_rollouts(3) == {"samples": [1, 2]}
    assert store.read_rollouts(4) is None


def test_bad_run_name(tmp_path):
    with pytest.raises(StorageError, match="path component"):
        RunStore(StorageConfig(root=str(tmp_path)), "../x")
