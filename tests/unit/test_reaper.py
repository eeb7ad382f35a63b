"""Nothing a run started outlives it: SIGKILL the guarded process and what it
started ends (its own session left too, and a process whose environment lost the
mark, below a marked parent); kill its watcher with it and the next guarded run
ends the leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import reaper

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="Linux /proc")

# A run in miniature: guard, start a child and a grandchild in a session of its own,
# print their pids, then die by SIGKILL (optionally with its watcher first).
RUN = r"""
import os, signal, subprocess, sys, time
from pathlib import Path
from tasks import reaper
token = reaper.guard()
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
child = subprocess.Popen(["sleep", "600"], **quiet)
detached = subprocess.Popen(["setsid", "sleep", "601"], **quiet)
# A grandchild without the mark (as Ray's agents look once they set their title over
# their environment), under a marked parent that is still alive.
holder = subprocess.Popen(
    [sys.executable, "-c", "import subprocess; p = subprocess.Popen(['sleep', '602'], env={}); "
     "print(p.pid, flush=True); p.wait()"],
    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
)
unmarked = int(holder.stdout.readline())
time.sleep(0.3)
print(child.pid, detached.pid, unmarked, flush=True)
if sys.argv[1] == "with-watcher":
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and token.encode() in (d / "cmdline").read_bytes():
                os.kill(int(d.name), signal.SIGKILL)
        except OSError:
            pass
os.kill(os.getpid(), signal.SIGKILL)
"""


def alive(pid: int) -> bool:
    return reaper._start_time(pid) is not None


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def run(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", RUN, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    return [int(p) for p in out.stdout.split()]


def test_what_a_killed_run_started_ends_with_it():
    pids = run("alone")
    assert wait_gone(pids) == []


def test_the_next_guard_ends_what_a_run_killed_with_its_watcher_left():
    pids = run("with-watcher")
    assert [p for p in pids if alive(p)] == pids  # nobody ended them yet
    try:
        assert set(pids) <= set(reaper.reap_orphans())  # (other dead runs' leftovers too)
        assert wait_gone(pids) == []
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
