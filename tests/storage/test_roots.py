"""check_root: a bad storage root fails before anything starts, with a message naming
the root and the fix (and never the secret of a URL)."""

import os

import pytest
from conftest import BUCKET
from s3_server import FAKE_SECRET

from storage import S3Options, StorageConfig, StorageError
from storage.fs import check_root


def test_good_roots_pass_and_leave_nothing(tmp_path, s3_endpoint):
    check_root(StorageConfig(root=str(tmp_path / "new" / "runs")))  # parents are made later
    check_root(StorageConfig(root=str(tmp_path)))
    assert os.listdir(tmp_path) == []  # the probe file is gone
    cfg = StorageConfig(root=f"s3://{BUCKET}/roots-ok", s3=S3Options(endpoint_url=s3_endpoint))
    check_root(cfg)
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    assert not fs.exists(f"{BUCKET}/roots-ok")


@pytest.mark.parametrize("below", [False, True])
def test_root_that_is_a_file(tmp_path, below):
    f = tmp_path / "runs"
    f.write_text("not a folder")
    root = f / "sub" if below else f
    with pytest.raises(StorageError, match=rf"{f}.* is a file.*set storage.root to a folder"):
        check_root(StorageConfig(root=str(root)))


def test_read_only_root_real_mount():
    """/proc/sys is read-only for every user, root included (os.access says so, and
    creating a file there fails even where os.access would not)."""
    with pytest.raises(StorageError, match=r"/proc/sys/prefect-rl.*writable"):
        check_root(StorageConfig(root="/proc/sys/prefect-rl/runs"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0555")
def test_read_only_root_chmod(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(StorageError, match=rf"{ro}.*not writable.*writable folder"):
            check_root(StorageConfig(root=str(ro / "runs")))
    finally:
        ro.chmod(0o755)


def test_missing_bucket_names_bucket_and_endpoint(s3_endpoint):
    cfg = StorageConfig(root="s3://no-such-bucket-x/p", s3=S3Options(endpoint_url=s3_endpoint))
    with pytest.raises(StorageError) as e:
        check_root(cfg)
    msg = str(e.value)
    assert "'no-such-bucket-x' does not exist" in msg and s3_endpoint in msg
    assert "aws s3 mb s3://no-such-bucket-x" in msg


def test_unreachable_endpoint_is_named(s3_endpoint):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    cfg = StorageConfig(root=f"s3://{BUCKET}/p", s3=S3Options(endpoint_url=dead, max_attempts=1))
    with pytest.raises(StorageError, match=r"cannot reach bucket.*127.0.0.1:9.*endpoint_url"):
        check_root(cfg)


def test_credentials_in_url_refused_without_echoing_the_secret():
    url = f"s3://AKIAXXXX:{FAKE_SECRET}@{BUCKET}/prefix"
    with pytest.raises(StorageError) as e:
        check_root(StorageConfig(root=url))
    msg = str(e.value)
    assert FAKE_SECRET not in msg and "AKIAXXXX" not in msg
    assert f"s3://***@{BUCKET}/prefix" in msg and "AWS_SECRET_ACCESS_KEY" in msg


def test_an_endpoint_that_never_answers_fails_at_the_read_timeout(s3_endpoint):
    """A real socket that accepts and stays silent (a hung proxy): the root check ends
    at storage.s3.read_timeout_s, naming the endpoint and the setting."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel accepts connections; nobody ever reads or answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    opts = S3Options(endpoint_url=url, max_attempts=1, read_timeout_s=1.0)
    try:
        with pytest.raises(StorageError, match=r"cannot reach bucket.*127.0.0.1.*read_timeout_s"):
            check_root(StorageConfig(root=f"s3://{BUCKET}/p", s3=opts))
    finally:
        silent.close()


def test_max_attempts_is_not_multiplied_by_s3fs_retries():
    """storage.s3.max_attempts bounds the tries: a real endpoint that drops every
    connection sees fewer requests at max_attempts 1 than s3fs's own 5 tries of each
    would make, and more at 3."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    seen: list[bytes] = []

    def drop_each() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            seen.append(conn.recv(65536)[:16])
            conn.close()  # no answer: botocore reads a dropped connection

    threading.Thread(target=drop_each, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    counts = {}
    try:
        for attempts in (1, 3):
            seen.clear()
            opts = S3Options(endpoint_url=url, max_attempts=attempts)
            with pytest.raises(StorageError, match="cannot reach bucket"):
                check_root(StorageConfig(root=f"s3://{BUCKET}/p{attempts}", s3=opts))
            counts[attempts] = len(seen)
    finally:
        server.close()
    assert 1 <= counts[1] < 5 and counts[1] < counts[3], counts
