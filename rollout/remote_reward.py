"""Rewards computed by a server (``rollout.reward: http://host:port/path``), as
slime's ``--rm-url`` and OpenRLHF's ``remote_rm_url`` do.

One POST per scoring call, JSON body::

    {"samples": [{"prompt", "response", "label", "prompt_index", "sample_index", "turns"}],
     "query": [prompt + response], "prompts": [prompt], "labels": [label]}

(``query``/``prompts``/``labels``: OpenRLHF's keys, so its reward servers work
as they are; ``response`` is the episode's answer, ``turns`` its whole
transcript). The reply must be ``{"rewards": [number, ...]}``, one number per
sample, in order, each finite with ``|r| <= remote_reward.max_abs`` (1e6): a
persisted rollout is trained on and replayed for good, so a reward that would
overflow the trainer's float32 advantages is refused here, naming the sample.

Limits, so that a server cannot stall or flood the rollout step:

- ``timeout_s`` bounds the whole call: connect, send, the headers and the
  whole body. A reply still arriving at the deadline (a byte at a time) is cut
  off: the socket is shut down by a timer, since a socket timeout only bounds
  each read.
- A reply body larger than ``max_reply_mb`` is refused (not retried).
- Redirects are never followed: a 3xx is refused naming its ``Location``,
  since following one would send the samples and the bearer token to whatever
  origin it names; configure the final URL instead.
- Timeouts, connection failures, 429 and 5xx replies are retried
  (``retries`` more times, at most 10), pausing ``backoff_s`` doubling up to
  ``max_backoff_s`` (``backoff_pauses``): scoring is idempotent.

Anything else (a 4xx, a reply that is not that JSON, the wrong count, a
non-number, a reward out of bounds) is a ``RemoteRewardError`` at once, naming
the URL and what was wrong. stdlib only (http.client): no Prefect, Ray or
engines.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

RETRY_STATUS = (429, 500, 502, 503, 504)
ERROR_DETAIL_BYTES = 200  # of a refusal's body, for the message
_CHUNK = 64 * 1024


class RemoteRewardError(RuntimeError):
    """The reward server failed, could not be reached, or answered garbage."""


class RemoteRewardConfig(BaseModel):
    """``rollout.remote_reward``: how a ``rollout.reward`` URL is called."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds one POST may take in all: connect, send, headers and the whole body",
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="More attempts after a timeout, 429/5xx or no connection",
    )
    backoff_s: float = Field(
        0.5,
        ge=0,
        allow_inf_nan=False,
        description="Pause before the first retry; doubles each time, up to max_backoff_s",
    )
    max_backoff_s: float = Field(
        30.0, ge=0, allow_inf_nan=False, description="The longest pause between two attempts"
    )
    max_reply_mb: float = Field(
        64.0,
        gt=0,
        allow_inf_nan=False,
        description="A reply body larger than this (MiB) is refused",
    )
    max_abs: float = Field(
        1e6,
        gt=0,
        le=1e30,  # a group's sum of up to 10^8 such rewards still fits float32 (3.4e38)
        allow_inf_nan=False,
        description="A reward r with |r| above this is refused (the trainer computes in float32)",
    )
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding a bearer token for the server; "
        "only the config file may set it",
    )


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_url(url: str) -> str:
    """Refuse a reward URL with credentials or without a host, naming the fix."""
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        raise ValueError(
            f"rollout.reward URL {parts.hostname!r} carries credentials; remove them from the "
            "URL and name the environment variable that holds a token in rollout.remote_reward.api_key_env"
        )
    if not parts.hostname:
        raise ValueError(f"rollout.reward {url!r} has no host; give http://host:port/path")
    return url


def backoff_pauses(cfg: RemoteRewardConfig) -> list[float]:
    """The pause before each retry: ``backoff_s`` doubling, never above ``max_backoff_s``."""
    return [min(cfg.backoff_s * 2**i, cfg.max_backoff_s) for i in range(cfg.retries)]


def request_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "samples": items,
        "query": [i["prompt"] + i["response"] for i in items],
        "prompts": [i["prompt"] for i in items],
        "labels": [i["label"] for i in items],
    }


def parse_rewards(url: str, raw: bytes, count: int, max_abs: float = 1e6) -> list[float]:
    """The rewards of a reply, or RemoteRewardError saying what is wrong with it."""
    fix = 'the server must answer {"rewards": [number, ...]} with one number per sample'
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RemoteRewardError(
            f"reward server {url} answered non-JSON ({raw[:80]!r}: {e}); {fix}"
        ) from None
    except RecursionError:  # a deeply nested reply exhausts the parser's stack
        raise RemoteRewardError(
            f"reward server {url} answered JSON nested too deeply; {fix}"
        ) from None
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise RemoteRewardError(f"reward server {url} answered {str(body)[:80]!r}; {fix}")
    if len(rewards) != count:
        raise RemoteRewardError(
            f"reward server {url} answered {len(rewards)} rewards for {count} samples; {fix}"
        )
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise RemoteRewardError(
                f"reward server {url} answered a non-number reward {str(r)[:80]!r} "
                f"for sample {i}; {fix}"
            )
        if isinstance(r, float) and not math.isfinite(r):
            raise RemoteRewardError(
                f"reward server {url} answered a non-finite reward {r} for sample {i}; {fix}"
            )
        if not abs(r) <= max_abs:  # an int is compared exactly: float(10**400) overflows
            value = (
                f"{r:.6g}" if isinstance(r, float) else f"an integer of {len(str(abs(r)))} digits"
            )
            raise RemoteRewardError(
                f"reward server {url} answered reward {value} for sample {i}, outside "
                f"[-{max_abs:g}, {max_abs:g}] (rollout.remote_reward.max_abs); fix the server, "
                "or raise max_abs if rewards that large are meant"
            )
    return [float(r) for r in rewards]


class _Retry(Exception):
    """An attempt failed in a way that another attempt may not: says how."""


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return cls(parts.hostname, parts.port, timeout=timeout_s), path


def _read_body(resp: http.client.HTTPResponse, limit: int) -> bytes | None:
    """The whole body, or None when it passes ``limit`` bytes. ``read1`` does one
    socket read per call, so the deadline timer's shutdown ends the loop at once."""
    declared = resp.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    while chunk := resp.read1(_CHUNK):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    if resp.length:  # close-delimited replies have None; chunked ones raise IncompleteRead
        raise http.client.IncompleteRead(b"".join(chunks), resp.length)
    return b"".join(chunks)


class _Deadline:
    """Shuts the watched socket down when ``seconds`` have passed, so that a blocked
    read returns at once: a socket timeout bounds each read, never the whole call."""

    def __init__(self, seconds: float) -> None:
        self.expired, self._done = False, False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket | None) -> None:
        # Our own reference: http.client hands the socket to the response and drops it.
        with self._lock:
            self._sock = sock
            if self.expired:  # it fired during connect: cut the call now
                self._shutdown()

    def _expire(self) -> None:
        # Under the lock, so the socket is never one that the caller already closed.
        with self._lock:
            if not self._done:
                self.expired = True
                self._shutdown()

    def _shutdown(self) -> None:
        if self._sock is not None:
            try:  # the plain socket's shutdown: SSLSocket's is not safe beside a read
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


def _post_once(url: str, cfg: RemoteRewardConfig, data: bytes, headers: dict[str, str]) -> bytes:
    """One POST within ``cfg.timeout_s`` in all: the 2xx body, else RemoteRewardError
    (refused: sending it again would not help) or _Retry (it may)."""
    timeout = f"no answer within rollout.remote_reward.timeout_s={cfg.timeout_s:g}s"
    conn, path = _connection(url, cfg.timeout_s)
    deadline = _Deadline(cfg.timeout_s)
    resp: http.client.HTTPResponse | None = None
    raw: bytes | None = None
    try:
        conn.connect()
        deadline.watch(conn.sock)
        conn.request("POST", path, body=data, headers=headers)
        resp = conn.getresponse()
        status, location = resp.status, resp.getheader("Location")
        if 200 <= status < 300:
            raw = _read_body(resp, int(cfg.max_reply_mb * 2**20))
        elif not 300 <= status < 400:
            raw = resp.read1(ERROR_DETAIL_BYTES)  # enough for the message
    except (OSError, http.client.HTTPException) as e:
        # The socket's own timeout (timeout_s per read) can fire a hair before the
        # deadline's timer of the same length: either way no answer came in time.
        late = deadline.expired or isinstance(e, TimeoutError)
        raise _Retry(timeout if late else f"unreachable ({e})") from None
    finally:
        deadline.finish()
        if resp is not None:  # it holds the socket open after conn.close()
            resp.close()
        conn.close()
    if deadline.expired:  # whatever arrived, it arrived too late
        raise _Retry(timeout)
    if 300 <= status < 400:
        raise RemoteRewardError(
            f"reward server {url} answered HTTP {status} redirecting to {location!r}; "
            "redirects are not followed (they would carry the samples and the token "
            "elsewhere): set rollout.reward to the final URL"
        )
    if status in RETRY_STATUS:
        raise _Retry(f"HTTP {status}")
    if not 200 <= status < 300:
        raise RemoteRewardError(
            f"reward server {url} refused the samples: HTTP {status}: "
            f"{(raw or b'').decode(errors='replace')}"
        )
    if raw is None:
        raise RemoteRewardError(
            f"reward server {url} answered more than rollout.remote_reward.max_reply_mb="
            f"{cfg.max_reply_mb:g} MiB; a reply holds one number per sample: check the server"
        )
    return raw


def post_rewards(url: str, cfg: RemoteRewardConfig, items: list[dict[str, Any]]) -> list[float]:
    """The server's reward of each item (see the module docstring for both shapes)."""
    if not items:
        return []
    data = json.dumps(request_body(items)).encode()
    headers = {"Content-Type": "application/json"}
    token = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last = ""
    for pause in [0.0, *backoff_pauses(cfg)]:
        time.sleep(pause)
        try:
            raw = _post_once(url, cfg, data, headers)
        except _Retry as e:
            last = str(e)
        else:
            return parse_rewards(url, raw, len(items), cfg.max_abs)
    raise RemoteRewardError(
        f"reward server {url} failed {cfg.retries + 1} times, last: {last}; check that it runs "
        "and answers, or raise rollout.remote_reward.timeout_s / retries"
    )
