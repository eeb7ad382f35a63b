"""Nothing a run started outlives it: the temporary Prefect server, a local Ray
cluster (GCS, raylet, agents, workers) and the engines in it.

``guard()`` marks this process's environment with ``PREFECT_RL_GUARD=<token>``
(the token names this process: pid and start time), so every process started
afterwards, and every process those start, carries the mark. It then starts a
small watcher (this file run as a script, stdlib only) holding the read end of
a pipe whose write end only this process holds. However this process ends (a
return, an exception, SIGKILL), the kernel closes that pipe, the watcher reads
EOF and ends every process of this user that carries the token: SIGTERM, then
SIGKILL. The watcher lives in a session of its own (Ctrl-C in the terminal
reaches the run, not the watcher) and carries no mark itself.

If the watcher was killed too (a ``kill -9`` of a whole process group), the next
``guard()`` reaps instead: marked processes whose marking process is gone.

A cluster at ``ray.address`` is not ours: its processes carry no mark and are
never touched, so engines there keep serving after a run.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ENV = "PREFECT_RL_GUARD"
_guarded: dict[int, str] = {}  # pid -> token: guard() once per process (fork-safe)
_pipes: list[int] = []  # write ends kept open for the process's life


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart);
    None once it has ended (a zombie has ended: it only waits for its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _owner_alive(token: str) -> bool:
    pid, started, _ = (token.split("-", 2) + ["", ""])[:3]
    return pid.isdigit() and _start_time(int(pid)) == started


def _marked(predicate) -> list[int]:
    """Pids of this user's processes whose environment carries a token passing ``predicate``."""
    me, uid, found = os.getpid(), os.getuid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if d.stat().st_uid != uid:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(ENV.encode() + b"="):
                if predicate(item.split(b"=", 1)[1].decode(errors="replace")):
                    found.append(int(d.name))
                break
    return found


def _with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every live process of this user below them. A process may lose its
    mark: Ray's agents set their process title over the environment's memory, so
    ``/proc/PID/environ`` no longer shows the token, but their parent (a marked
    raylet) still names them its children."""
    uid, children = os.getuid(), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if d.stat().st_uid != uid:
                continue
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    found, todo = set(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != os.getpid():
                found.add(child)
                todo.append(child)
    return sorted(found)


def reap(predicate, grace_s: float = 3.0, rounds: int = 5) -> list[int]:
    """SIGTERM the marked processes and their descendants, SIGKILL what is left after
    ``grace_s``; repeated while new ones appear (a dying raylet may still start a
    worker). The pids ended."""
    ended: set[int] = set()
    for _ in range(rounds):
        pids = _marked(predicate)
        pids = _with_descendants(pids) if pids else pids
        if not pids:
            break
        ended.update(pids)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_start_time(p) for p in pids):
                time.sleep(0.1)
            pids = [p for p in pids if _start_time(p) is not None]
            if not pids:
                break
    return sorted(ended)


def reap_orphans() -> list[int]:
    """End marked processes whose marking process is gone (a run killed with its watcher)."""
    return reap(lambda token: not _owner_alive(token), grace_s=2.0)


def guard() -> str:
    """Mark this process and start its watcher (once per process); the token.

    Linux only (it reads /proc); elsewhere it does nothing."""
    pid = os.getpid()
    if pid in _guarded:
        return _guarded[pid]
    if not Path("/proc/self/environ").exists():
        return ""
    reap_orphans()
    token = f"{pid}-{_start_time(pid)}-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    read_end, write_end = os.pipe()
    subprocess.Popen(
        # -I: the script's folder (tasks/, which has a types.py) stays off sys.path.
        [sys.executable, "-I", "-S", __file__, token],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        close_fds=True,
    )
    os.close(read_end)
    os.set_inheritable(write_end, False)  # only this process holds it: EOF = this process ended
    _guarded[pid] = token
    _pipes.append(write_end)
    os.environ[ENV] = token
    return token


def _watch(token: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = sys.stdin.fileno()
    # EOF comes at once when the run ends; the liveness poll covers a forked
    # child of the run that still holds the pipe's write end.
    while _owner_alive(token):
        readable, _, _ = select.select([fd], [], [], 1.0)
        if readable and not os.read(fd, 65536):
            break
    reap(lambda t: t == token)


if __name__ == "__main__":
    _watch(sys.argv[1])
