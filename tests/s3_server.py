"""A real HTTP S3 endpoint for tests: moto's standalone server on a free loopback port.

Reusable from any test package: ``with moto_s3() as endpoint_url: ...``. Sets
dummy AWS credentials in the environment for its lifetime (botocore reads
them there, exactly as in production); nothing is mocked in-process.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

# Deliberately distinctive so tests can assert they never leak into files/URLs.
FAKE_KEY_ID = "AKIAPREFECTRLFAKE0001"
FAKE_SECRET = "prefect-rl-fake-secret-0123456789abcdef"
_ENV = {
    "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
}
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_aws_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*_ENV, *_UNSET)}
    os.environ.update(_ENV)
    for k in _UNSET:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def moto_s3() -> Iterator[str]:
    """Start moto's S3 server; yield its endpoint URL; stop it on exit."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    with fake_aws_env():
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


def make_bucket(endpoint_url: str, bucket: str) -> None:
    """Create ``bucket`` through s3fs (a real HTTP call to the endpoint)."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint_url, skip_instance_cache=True)
    if not fs.exists(bucket):
        fs.mkdir(bucket)
