"""Real services for the end-to-end tests: a Prefect server with a temporary
PREFECT_HOME on a free loopback port (one per test session, shared by the
in-process flows and the worker's), a Ray head (`ray start --head`), and a
process worker on the `prefect-rl` pool. Each is stopped with its whole session
(every process it started, Ray's workers included), and the Ray address file
that `ray start` wrote is removed with the head, as `ray stop` does."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(
    check, what: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"{what} not ready after {timeout}s:\n{log.read_text()[-3000:] if log else ''}"
    )


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a process started with
    ``start_new_session=True`` leads the session numbered by its pid; Ray's
    workers put themselves in process groups of their own, but stay in it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            pids.append(int(d.name))
    return pids


def kill_session(sid: int, timeout: float = 10) -> None:
    """SIGKILL every process left in session ``sid`` and wait until they are gone."""
    deadline = time.monotonic() + timeout
    while (pids := session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def settled_session(sid: int, timeout: float = 90) -> list[int]:
    """The processes left in session ``sid`` once they stop ending (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def rl_run_args(config: str, over: dict) -> list[str]:
    """``prefect-rl run CONFIG --set key=value ...``, each value as JSON (which is YAML)."""
    args = [str(BIN / "prefect-rl"), "run", config]
    for key, value in over.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    return args


def run_to_exit(
    args: list[str], env: dict[str, str], settle: bool = False, timeout: float = 600
) -> tuple[int, str, Future[list[str]]]:
    """Run ``args`` in a session of its own until it exits (a SIGKILL included): its
    return code, its stderr and what was still running in its session once processes
    stopped ending, a line per process (with ``settle``; else nothing: whatever is left
    is SIGKILLed before this returns). The settling is watched on a thread, so the
    caller goes on at once: after a SIGKILLed run, Ray's agents can take a minute to
    end, which a test's next runs need not wait for. What is left then is SIGKILLed."""
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        kill_session(proc.pid)
        raise
    left: Future[list[str]] = Future()
    if settle:
        threading.Thread(target=_settle, args=(proc.pid, left), daemon=True).start()
    else:
        kill_session(proc.pid)
        left.set_result([])
    return proc.returncode, err, left


def describe(pids: list[int]) -> list[str]:
    """``pid: command line`` of each of ``pids`` still there."""
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
        except OSError:  # ended since it was seen: still named, never dropped
            out.append(f"{pid}: (ended while described)")
    return out


def _settle(sid: int, left: Future[list[str]]) -> None:
    try:
        left.set_result(describe(settled_session(sid)))
    except BaseException as e:  # the waiting test sees it
        left.set_exception(e)
    finally:
        kill_session(sid)


def stop(
    proc: subprocess.Popen, signals: tuple[int, ...] = (signal.SIGTERM,), grace_s: float = 10
) -> None:
    """Stop a process started in a session of its own: the given signals to its
    group (``grace_s`` after each), then SIGKILL to whatever is left of its session."""
    for sig in signals:
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    kill_session(proc.pid)


def forget_ray_address(port: int) -> None:
    """Remove the address file ``ray start`` wrote for the head on ``port`` (what
    ``ray stop`` does), so no later ``ray.init()`` is sent to a dead cluster. A file
    naming another cluster (another user's on this machine) is left alone."""
    path = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        if path.read_text().strip().endswith(f":{port}"):
            path.unlink()
    except OSError:
        pass


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A service process in a session of its own (``stop`` ends all it started)."""
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_dir(tmp_path_factory) -> Path:
    """The folder every xdist worker of this pytest run shares: the one above their own
    temporary folders (new for every pytest run), or the run's own without xdist."""
    own = tmp_path_factory.getbasetemp()
    return own.parent if os.environ.get("PYTEST_XDIST_WORKER") else own


def migrated_db(tmp_path_factory) -> Path:
    """Where the first Prefect server of this pytest run leaves its migrated database
    (``PrefectServer.start_seeded``); it is there once the session's server runs."""
    return run_dir(tmp_path_factory) / "prefect-migrated.db"


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock``: one xdist worker at a time makes or reads ``path``."""
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


# The server's loop services that no test relies on (schedules, late and paused runs,
# automations, worker health, cancellation and lease cleanup). Each polls its
# database every few seconds: an idle server used 2.45 CPU s a minute with them and
# 1.14 without, and the suite runs a server per xdist worker on 2 cores. The event
# persister and the task run recorder stay: task runs reach the API through them.
IDLE_SERVICES_OFF = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in (
        "SCHEDULER",
        "LATE_RUNS",
        "PAUSE_EXPIRATIONS",
        "TRIGGERS",
        "FOREMAN",
        "CANCELLATION_CLEANUP",
        "REPOSSESSOR",
        "CLEANUP_RECONCILER",
    )
}


class PrefectServer:
    """``prefect server start`` on a free loopback port with a PREFECT_HOME of its own."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.home = workdir / "prefect-home"
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **IDLE_SERVICES_OFF,
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> PrefectServer:
        log = self.workdir / "server.log"
        args = ["server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = spawn([str(BIN / "prefect"), *args], self.env, log)
        _wait(
            lambda: httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200,
            "prefect server",
            120,
            self.proc,
            log,
        )
        return self

    def start_seeded(self, db: Path) -> PrefectServer:
        """Start on a copy of the migrated database ``db``; the first server of a pytest
        run (``db`` not there yet) migrates its own and leaves a copy there."""
        with locked(db):
            if db.exists():
                # Migrating an empty database is half a start (~5 CPU s on 2 cores).
                self.home.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(db, self.home / "prefect.db")
            else:
                self.start()
                # SQLite's online backup: a consistent copy of a database in use.
                with sqlite3.connect(self.home / "prefect.db") as src:
                    with sqlite3.connect(f"{db}.tmp") as dst:
                        src.backup(dst)
                os.replace(f"{db}.tmp", db)
                return self
        return self.start()

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)


class Stack:
    """A Ray head (or the session's cluster) and (after ``deploy``) a worker, on a
    Prefect server (the session's, or one of its own)."""

    def __init__(
        self, workdir: Path, ray_address: str | None = None, server: PrefectServer | None = None
    ):
        """``ray_address``: a running cluster to use (the test session's) instead of a head
        of its own; ``server``: a running Prefect server to use instead of one of its own."""
        self.workdir = workdir
        self.server = server or PrefectServer(workdir)
        self.own_server = server is None
        self.api_url = self.server.api_url
        self.own_ray = ray_address is None
        self.ray_port = free_port() if self.own_ray else int(ray_address.rsplit(":", 1)[1])
        self.ray_address = f"127.0.0.1:{self.ray_port}" if self.own_ray else ray_address
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(workdir / "prefect-home"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            # The worker picks up a scheduled run within a second, not Prefect's default 10 s.
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PWD": str(ROOT),
        }
        self.procs: list[tuple[subprocess.Popen, tuple[int, ...], float]] = []

    def _spawn(
        self, name: str, args: list[str], stop_signals=(signal.SIGTERM,), grace_s: float = 10
    ) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        proc = spawn(args, self.env, log)
        self.procs.append((proc, stop_signals, grace_s))
        return proc, log

    def start(self) -> Stack:
        if self.own_server:
            self.server.start()
        if not self.own_ray:
            return self
        proc, log = self._spawn(
            "ray",
            [
                str(BIN / "ray"),
                "start",
                "--head",
                "--block",
                f"--port={self.ray_port}",
                "--num-cpus=8",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
        )
        _wait(lambda: "Ray runtime started" in log.read_text(), "ray head", 120, proc, log)
        return self

    def cli(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(BIN / "prefect"), *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
                f"\n--- worker log ---\n{self.log_tail('worker')}"
            )
        return out

    def deploy_and_start_worker(self) -> None:
        # --overwrite: a second stack on the session's server (test_multinode.py and
        # test_deployments.py in one pytest process, as without xdist) finds the pool.
        self.cli("work-pool", "create", "rl-process", "--type", "process", "--overwrite")
        # The worker starts on the pool while the deployments are made (two CLI
        # processes, seconds each on 2 cores): it has nothing to pick up before a test
        # runs a deployment.
        # The worker ignores the first SIGTERM (its CLI passes SIGINT on, and the worker
        # never ended within 10 s of it): send it twice, a second apart, then SIGKILL.
        # Every flow run it started has finished by then (each test waits for its own).
        proc, log = self._spawn(
            "worker",
            [str(BIN / "prefect"), "worker", "start", "--pool", "rl-process"],
            stop_signals=(signal.SIGTERM, signal.SIGTERM),
            grace_s=1,
        )
        self.cli("--no-prompt", "deploy", "--all")
        _wait(lambda: "started" in log.read_text().lower(), "prefect worker", 120, proc, log)

    def log_tail(self, name: str, chars: int = 6000) -> str:
        log = self.workdir / f"{name}.log"
        return log.read_text()[-chars:] if log.exists() else ""

    def close(self) -> None:
        for proc, signals, grace_s in reversed(self.procs):
            stop(proc, signals, grace_s)
        if self.own_server:
            self.server.close()
        if self.own_ray:
            forget_ray_address(self.ray_port)


@contextmanager
def worker_stack(workdir: Path, ray_address: str, server: PrefectServer) -> Iterator[Stack]:
    """Every deployment of prefect.yaml on ``server`` and a process worker whose flow
    runs join the Ray cluster at ``ray_address`` (as a long-lived cluster is joined)."""
    s = Stack(workdir, ray_address=ray_address, server=server).start()
    try:
        s.deploy_and_start_worker()
        yield s
    finally:
        s.close()
