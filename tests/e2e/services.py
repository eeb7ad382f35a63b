"""Real services for the end-to-end tests: a Prefect server with a temporary
PREFECT_HOME on a free loopback port, a Ray head (`ray start --head`), and a
process worker on the `prefect-rl` pool. Each is stopped with its process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, what: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout}s:\n{log.read_text()[-3000:] if log else ''}")


def stop(proc: subprocess.Popen, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Stop a process group: the given signals, then SIGKILL."""
    for sig in signals:
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class Stack:
    """A Prefect server, a Ray head and (after ``deploy``) a worker."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port, self.ray_port = free_port(), free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ray_address = f"127.0.0.1:{self.ray_port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(workdir / "prefect-home"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PWD": str(ROOT),
        }
        self.procs: list[tuple[subprocess.Popen, tuple[int, ...]]] = []

    def _spawn(self, name: str, args: list[str], stop_signals=(signal.SIGTERM,)) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        proc = subprocess.Popen(
            args, cwd=ROOT, env=self.env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append((proc, stop_signals))
        return proc, log

    def start(self) -> Stack:
        proc, log = self._spawn(
            "server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        )
        _wait(lambda: httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200, "prefect server", 120, proc, log)
        proc, log = self._spawn(
            "ray",
            [str(BIN / "ray"), "start", "--head", "--block", f"--port={self.ray_port}", "--num-cpus=8",
             "--include-dashboard=false", "--disable-usage-stats"],
        )
        _wait(lambda: "Ray runtime started" in log.read_text(), "ray head", 120, proc, log)
        return self

    def cli(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(BIN / "prefect"), *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
                f"\n--- worker log ---\n{self.log_tail('worker')}"
            )
        return out

    def deploy_and_start_worker(self) -> None:
        self.cli("work-pool", "create", "rl-process", "--type", "process")
        self.cli("--no-prompt", "deploy", "--all")
        # The worker ignores the first SIGTERM: send it twice, then SIGKILL.
        proc, log = self._spawn(
            "worker", [str(BIN / "prefect"), "worker", "start", "--pool", "rl-process"],
            stop_signals=(signal.SIGTERM, signal.SIGTERM),
        )
        _wait(lambda: "started" in log.read_text().lower(), "prefect worker", 120, proc, log)

    def log_tail(self, name: str, chars: int = 6000) -> str:
        log = self.workdir / f"{name}.log"
        return log.read_text()[-chars:] if log.exists() else ""

    def close(self) -> None:
        for proc, signals in reversed(self.procs):
            stop(proc, signals)
