"""A same-host signal for cached weight updates: one Unix socket per engine process.

Why: once an engine holds a producer's staging buffer open (``engines.embedded.weight_cache``),
an update is a few hundred microseconds of device copy, and a Ray actor call
around it costs more than the copy (about 1.4 ms on the H200 host, 0.76 GB of
bf16 copied in 0.47 ms). Only the signal moves here; the weights stay where
the CUDA IPC or shared-memory handle put them, and anything that is not a
cached update (a first push, a streamed bucket, a cache miss) still goes
through ``update_weights_from_tensor`` over Ray.

The protocol is one JSON object per line each way, in order, on a connection
the producer keeps:

    {"token": ..., "channel": ..., "key": ..., "flush_cache": bool,
     "weight_version": str | null}
    -> the reply of update_weights_from_tensor (success, message, cache_miss, ...)

Who may send: the socket lives in a folder of its own (mode 0700) named with the
engine's pid, the peer must run as the engine's user (SO_PEERCRED), and every
request carries the random token handed out over Ray (the trusted control
plane). Requests are one flat JSON object of at most ``MAX_LINE`` bytes: no
pickle, so a request can name a cached buffer and a version string, nothing
else; anything else (nesting, another shape, a wrong token) ends the connection.
A folder of this user whose engine process died is removed by the next engine
that starts one on the host; whatever else matches the name in /tmp (another
user's folder, a pid no process can have) is left alone. Running out of file
descriptors pauses accepting, never ends it.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "prefect-rl-upd-"
MAX_LINE = 4096
# accept() errors that pass once other connections close: the listener backs off
# for _BACKOFF_S and accepts again.
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
_BACKOFF_S = 0.05
Handler = Callable[[str, str, bool, str | None], dict[str, Any]]


# A pid above Linux's largest pid_max (2**22) names no process: a folder that says
# so is not an engine's (os.kill would raise OverflowError on the largest).
_PID_MAX = 1 << 22


def _sweep_dead() -> None:
    """Remove socket folders whose engine process is gone (a SIGKILL cannot clean up).
    Only folders of this user whose name carries a possible pid are judged: /tmp is
    shared, and anything another user made there is skipped, never a reason to fail."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-*")):
        pid = os.path.basename(path)[len(PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or not 0 < int(pid) <= _PID_MAX:
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue  # a file, a link, another user's: not ours to judge
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, OverflowError, ValueError):  # alive (EPERM), or gone meanwhile
            continue


def parse_request(line: bytes, token: str) -> tuple[str, str, bool, str | None]:
    """(channel, key, flush_cache, weight_version) of one request line, or ValueError
    naming what is wrong (the connection is then closed). The token is compared in
    constant time. A request is one flat object: deep nesting (2,000 nested arrays
    fit in a line) is refused like malformed JSON, a nested field by its name."""
    try:
        req = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not a JSON line: {e}") from None
    if not isinstance(req, dict):
        raise ValueError("a request is a JSON object")
    given = req.get("token")
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
        raise PermissionError("wrong or missing token")
    channel, key, flush, version = (
        req.get(k) for k in ("channel", "key", "flush_cache", "weight_version")
    )
    if not isinstance(channel, str) or not isinstance(key, str):
        raise ValueError("'channel' and 'key' must be strings")
    if not isinstance(flush, bool):
        raise ValueError("'flush_cache' must be true or false")
    if version is not None and not isinstance(version, str):
        raise ValueError("'weight_version' must be a string or null")
    return channel, key, flush, version


class UpdateSocket:
    """The engine's listener: a daemon thread accepting producer connections, each
    served by its own thread, each request answered by ``handler``."""

    def __init__(self, handler: Handler) -> None:
        _sweep_dead()
        self._handler = handler
        self._dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")  # mode 0700
        self.path = os.path.join(self._dir, "s")
        self.token = secrets.token_hex(32)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, name="update-socket", daemon=True).start()

    def address(self) -> dict[str, Any]:
        """What a producer needs to connect (given out over Ray only)."""
        return {"path": self.path, "token": self.token, "pid": os.getpid()}

    def _accept(self) -> None:
        starved = False
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno not in _TRANSIENT:
                    return  # closed
                # Out of descriptors or memory (a flood of connections, ours or another
                # process's): those close again, so wait and accept again, never end.
                if not starved:
                    log.warning("weight-update socket: accept failed (%s); retrying", e)
                starved = True
                time.sleep(_BACKOFF_S)
                continue
            starved = False
            try:
                if not self._same_user(conn):
                    conn.close()
                    continue
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except (OSError, RuntimeError):  # no thread to serve it: this one is refused
                conn.close()
                time.sleep(_BACKOFF_S)

    @staticmethod
    def _same_user(conn: socket.socket) -> bool:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid == os.getuid()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            while True:
                line = reader.readline(MAX_LINE + 1)
                if not line:
                    return
                try:
                    if len(line) > MAX_LINE or not line.endswith(b"\n"):
                        raise ValueError(f"a request is one line of at most {MAX_LINE} bytes")
                    request = parse_request(line, self.token)
                except PermissionError as e:
                    log.warning("weight-update socket: refused a request: %s", e)
                    self._send(conn, {"success": False, "message": f"refused: {e}"})
                    return  # a peer without the token gets one answer, then nothing
                except Exception as e:  # noqa: BLE001 - whatever a bad request raised: it ends here
                    self._send(conn, {"success": False, "message": f"bad request: {e}"})
                    return  # the stream may be out of step: the producer reconnects
                try:
                    reply = self._handler(*request)
                except Exception as e:  # noqa: BLE001 - the producer reports it; the engine lives on
                    reply = {"success": False, "message": f"{type(e).__name__}: {e}"}
                if not self._send(conn, reply):
                    return

    @staticmethod
    def _send(conn: socket.socket, reply: dict[str, Any]) -> bool:
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class UpdateClient:
    """The producer's end: one kept connection to one engine's socket."""

    def __init__(self, address: dict[str, Any], timeout_s: float = 300.0) -> None:
        self.path, self._token = str(address["path"]), str(address["token"])
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(self.path)
        self._reader = self._sock.makefile("rb")

    def update(
        self, channel: str, key: str, flush_cache: bool, weight_version: str | None
    ) -> dict[str, Any]:
        """Ask the engine to copy the cached buffer ``key`` of ``channel``; its reply.
        OSError (or ConnectionError) when the engine is gone or the socket broke."""
        req = {
            "token": self._token,
            "channel": channel,
            "key": key,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        self._sock.sendall(json.dumps(req).encode() + b"\n")
        line = self._reader.readline()
        if not line:
            raise ConnectionError(f"the engine closed its weight-update socket {self.path}")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._reader.close()
            self._sock.close()
