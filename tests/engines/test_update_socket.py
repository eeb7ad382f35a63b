"""The engine's weight-update socket: only the engine's own user, with the token,
is answered (another user is kept out even with the token), a
request is JSON of one fixed shape (nothing is unpickled), a bad request ends
that connection and the socket keeps serving, and the socket folder of a dead
engine process is swept by the next one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from wire.update_socket import MAX_LINE, PREFIX, UpdateClient, UpdateSocket


@pytest.fixture
def served():
    calls: list[tuple] = []

    def handler(channel, key, flush, version):
        calls.append((channel, key, flush, version))
        return {"success": True, "message": f"copied {key}"}

    sock = UpdateSocket(handler)
    yield sock, calls
    sock.close()


def _raw(sock: UpdateSocket, payload: bytes) -> dict | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock.path)
        s.sendall(payload)
        line = s.makefile("rb").readline()
        rest = s.recv(1)  # the server closed the connection after a refusal
        assert rest == b""
        return json.loads(line) if line else None


def test_a_producer_with_the_token_drives_cached_updates_in_order(served):
    sock, calls = served
    folder = os.path.dirname(sock.path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # nobody else can reach it
    client = UpdateClient(sock.address())
    try:
        assert client.update("ch", "k1", False, None)["success"]
        assert client.update("ch", "k1", True, "7") == {"success": True, "message": "copied k1"}
    finally:
        client.close()
    assert calls == [("ch", "k1", False, None), ("ch", "k1", True, "7")]


@pytest.mark.parametrize(
    "payload, says",
    [
        (b'{"token": "nope", "channel": "c", "key": "k", "flush_cache": false}\n', "refused"),
        (b'{"channel": "c", "key": "k", "flush_cache": false}\n', "refused"),
        (b"\x80\x04\x95 a pickle is not a request\n", "not a JSON line"),
        (b"A" * (MAX_LINE + 10) + b"\n", "at most"),
    ],
)
def test_a_bad_request_is_answered_and_changes_nothing(served, payload, says):
    sock, calls = served
    reply = _raw(sock, payload)
    assert reply is not None and not reply["success"] and says in reply["message"]
    assert calls == []
    # The socket still serves the producer that has the token.
    client = UpdateClient(sock.address())
    try:
        assert client.update("c", "k", False, "1")["success"]
    finally:
        client.close()


def test_a_field_of_the_wrong_type_is_refused_by_name(served):
    sock, calls = served
    req = {"token": sock.token, "channel": "c", "key": ["k"], "flush_cache": False}
    reply = _raw(sock, json.dumps(req).encode() + b"\n")
    assert "'channel' and 'key' must be strings" in reply["message"]
    req = {"token": sock.token, "channel": "c", "key": "k", "flush_cache": "yes"}
    reply = _raw(sock, json.dumps(req).encode() + b"\n")
    assert "'flush_cache' must be true or false" in reply["message"]
    assert calls == []


def test_a_handler_error_is_the_reply_and_the_connection_lives_on():
    def handler(channel, key, flush, version):
        if key == "bad":
            raise RuntimeError("a model tensor changed shape")
        return {"success": True, "message": "ok"}

    sock = UpdateSocket(handler)
    client = UpdateClient(sock.address())
    try:
        reply = client.update("c", "bad", False, None)
        assert not reply["success"] and "changed shape" in reply["message"]
        assert client.update("c", "good", False, "2")["success"]
    finally:
        client.close()
        sock.close()
    assert not os.path.exists(os.path.dirname(sock.path))


def test_the_folder_of_a_killed_engine_is_swept_by_the_next():
    # A process that opens a socket and is SIGKILLed leaves its folder behind.
    code = (
        "import os, signal; from wire.update_socket import UpdateSocket; "
        "s = UpdateSocket(lambda *a: {}); print(s.path, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    left = os.path.dirname(out.stdout.strip())
    assert left.startswith(os.path.join(tempfile.gettempdir(), PREFIX)) and os.path.isdir(left)
    sock = UpdateSocket(lambda *a: {})
    try:
        assert not os.path.exists(left)
    finally:
        sock.close()


def _as_nobody(path: str, payload: bytes) -> str:
    """Connect to ``path`` from a child running as user nobody and send ``payload``;
    what came of it: "EACCES", "closed" (no answer) or the answer line."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the standard library, then _exit
        result = b"?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(path)
                s.sendall(payload)
                result = s.makefile("rb").readline().strip() or b"closed"
        except PermissionError:
            result = b"EACCES"
        except (ConnectionResetError, BrokenPipeError):
            # The engine checks the peer on accept and may close before the request
            # is even written (EPIPE) or read (ECONNRESET): either way, unanswered.
            result = b"closed"
        except OSError as e:
            result = f"OSError {e}".encode()
        finally:
            os.write(w, result)
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_is_kept_out_even_with_the_token(served):
    sock, calls = served
    req = {"token": sock.token, "channel": "c", "key": "k", "flush_cache": False}
    payload = json.dumps(req).encode() + b"\n"
    # The folder (0700) and the socket (0600) keep other users from connecting.
    assert stat.S_IMODE(os.stat(os.path.dirname(sock.path)).st_mode) == 0o700
    assert _as_nobody(sock.path, payload) == "EACCES"
    # Were both opened up (a umask or an admin's chmod), the engine still answers
    # only its own user, however the token leaked: the connection ends unanswered.
    os.chmod(os.path.dirname(sock.path), 0o777)
    os.chmod(sock.path, 0o777)
    assert _as_nobody(sock.path, payload) == "closed"
    assert calls == []
    client = UpdateClient(sock.address())  # the engine's own user is still served
    try:
        assert client.update("c", "k", False, "1")["success"]
    finally:
        client.close()


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 2000 + b"]" * 2000 + b"\n",  # deep nesting that fits in a line
        b'{"token": ' + b"[" * 1500 + b"]" * 1500 + b"}\n",  # nested inside the object
        b'{"channel": {"a": 1}, "key": "k", "flush_cache": false}\n',
        b'"just a string"\n',
    ],
    ids=["2000-nested-arrays", "nested-token", "nested-value", "not-an-object"],
)
def test_a_request_that_is_no_flat_object_ends_the_connection(served, payload):
    sock, calls = served
    reply = _raw(sock, payload)  # asserts that the engine closed the connection after it
    assert reply is not None and not reply["success"]
    assert reply["message"].startswith(("bad request", "refused"))
    assert calls == []


def test_a_folder_any_user_can_make_in_tmp_does_not_stop_the_socket(tmp_path):
    """Names no engine made: a pid too large for os.kill, a file, another user's folder
    with a dead pid. The next engine starts its socket and leaves them all alone."""
    tmp = tempfile.gettempdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    made = [
        os.path.join(tmp, f"{PREFIX}99999999999-x"),
        os.path.join(tmp, f"{PREFIX}{dead.pid}-afile"),
        os.path.join(tmp, f"{PREFIX}{dead.pid}-other"),
    ]
    try:
        os.mkdir(made[0])
        open(made[1], "w").close()
        if os.geteuid() == 0:  # user nobody's, moved in whole (no sweep sees it as ours)
            os.mkdir(tmp_path / "other")
            os.chown(tmp_path / "other", 65534, 65534)
            os.rename(tmp_path / "other", made[2])
        sock = UpdateSocket(lambda *a: {"success": True, "message": "ok"})
        try:
            client = UpdateClient(sock.address())
            try:
                assert client.update("c", "k", False, "1")["success"]
            finally:
                client.close()
        finally:
            sock.close()
        assert os.path.isdir(made[0]) and os.path.isfile(made[1])
        if os.geteuid() == 0:
            assert os.path.isdir(made[2])  # another user's: not ours to remove
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path) if os.path.isdir(path) else os.unlink(path)


# The engine side, in a process of its own with few file descriptors: the parent
# floods it with connections until every descriptor is in use, then lets them go.
_LOW_FD_ENGINE = r"""
import json, os, resource, sys
from wire.update_socket import UpdateSocket

sock = UpdateSocket(lambda c, k, f, v: {"success": True, "message": k})
used = len(os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 8, hard))
print(json.dumps({**sock.address(), "limit": used + 8}), flush=True)
sys.stdin.read()  # until the parent is done
"""


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_socket_accepts_again_after_running_out_of_file_descriptors():
    engine = subprocess.Popen(
        [sys.executable, "-c", _LOW_FD_ENGINE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    flood: list[socket.socket] = []
    try:
        address = json.loads(engine.stdout.readline())
        for _ in range(address["limit"] + 16):  # more than it can hold, and a full backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(address["path"])
            except BlockingIOError:  # the backlog is full: the engine accepts no more
                s.close()
                break
            flood.append(s)
        # Wait (not a timed assertion) until the engine holds every descriptor it may.
        deadline = time.monotonic() + 30
        while _open_fds(engine.pid) < address["limit"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _open_fds(engine.pid) >= address["limit"]
        time.sleep(0.3)  # its accept() meets EMFILE now, with connections still waiting
        for s in flood:
            s.close()
        flood.clear()
        client = UpdateClient(address, timeout_s=20)  # the flood is over: served again
        try:
            assert client.update("c", "k", False, "1") == {"success": True, "message": "k"}
        finally:
            client.close()
    finally:
        for s in flood:
            s.close()
        engine.stdin.close()
        engine.wait(timeout=30)
