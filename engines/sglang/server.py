"""One ``python -m sglang.launch_server`` process: command line, log, readiness, stop.

The server is spawned with a parent-death signal from a thread that waits on
it, so it dies with the engine actor (``ray.kill`` leaves nothing on the
GPUs). A server that exits or stays unhealthy fails ``wait_ready`` with the
command (token hidden) and the last lines of its log. The admin token (the env
var named by ``engines.api_key_env``) is passed as ``--api-key``, so a server
bound beyond loopback is never open; a non-loopback host without a token is
refused before anything starts. The token is never logged: logs and
``command`` show it as ``***``. (It is on the server's command line, as SGLang
takes it, so local users who can read ``/proc`` can see it; run engines under
their own user where that matters.)
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from engines.client import EngineClient
from engines.config import SGLangConfig
from engines.security import require_token
from engines.types import AdapterServing

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_args(
    model_path: str,
    sc: SGLangConfig,
    tp_size: int,
    port: int,
    weight_version: int,
    api_key: str | None = None,
    adapters: AdapterServing | None = None,
) -> list[str]:
    """``launch_server`` arguments (SGLang 0.5.x names) for one engine. ``adapters``:
    LoRA on, sized for the adapter versions a run keeps loaded (each is its own slot
    of a batch, which the base model shares: SGLang needs loaded >= per batch)."""
    args = ["--model-path", model_path, "--host", sc.host, "--port", str(port)]
    args += ["--tp-size", str(tp_size), "--weight-version", str(weight_version)]
    if sc.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(sc.mem_fraction_static)]
    if sc.cuda_graph_max_bs is not None:
        args += ["--cuda-graph-max-bs", str(sc.cuda_graph_max_bs)]
    if api_key:
        args += ["--api-key", api_key]
    if adapters is not None:
        args += ["--enable-lora", "--max-lora-rank", str(adapters.max_rank)]
        args += ["--lora-target-modules", *adapters.target_modules]
        args += ["--max-loras-per-batch", str(adapters.max_loaded)]
        args += ["--max-loaded-loras", str(adapters.max_loaded)]
    return args + list(sc.extra_args)


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the value after ``--api-key`` replaced, for logs and errors."""
    return [
        "***"
        if i and argv[i - 1] == "--api-key"
        else a.split("=", 1)[0] + "=***"
        if a.startswith("--api-key=")
        else a
        for i, a in enumerate(argv)
    ]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SGLangServer:
    """One server process for engine ``engine_id``; started by ``__init__``, not yet ready."""

    def __init__(
        self,
        model_path: str,
        engine_id: int,
        sc: SGLangConfig,
        tp_size: int,
        weight_version: int,
        api_key: str | None,
        adapters: AdapterServing | None = None,
    ) -> None:
        self.engine_id = engine_id
        self._sc = sc
        port = sc.port + engine_id if sc.port else free_port(sc.host)
        host = "127.0.0.1" if sc.host in ("0.0.0.0", "::") else sc.host
        self.url = f"http://{host}:{port}"
        require_token(sc.host, api_key)  # before anything starts
        prefix = sc.launch_command or [sys.executable, "-m", "sglang.launch_server"]
        args = launch_args(model_path, sc, tp_size, port, weight_version, api_key, adapters)
        self._argv = [*prefix, *args]
        self.command = redacted(self._argv)  # what logs and errors show
        log_dir = Path(sc.log_dir or tempfile.mkdtemp(prefix="prefect-rl-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = str(log_dir / f"engine-{engine_id}.log")
        self._proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        """Start the server from a thread that lives as long as it does.

        The parent-death signal fires when the *thread* that forked exits, so
        that thread must outlive the server: it waits on it.
        """
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
        )
        if self._sc.pythonpath:  # SGLang's own environment first (its transformers differ)
            env["PYTHONPATH"] = os.pathsep.join([*self._sc.pythonpath, env["PYTHONPATH"]])
        box: dict[str, Any] = {}
        started = threading.Event()

        def run() -> None:
            try:
                with open(self.log_path, "ab") as out:
                    box["proc"] = subprocess.Popen(
                        self._argv,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # its own group: stop() signals the whole tree
                        preexec_fn=_die_with_parent,
                    )
            except OSError as e:
                box["error"] = e
            finally:
                started.set()
            if "proc" in box:
                box["proc"].wait()

        threading.Thread(target=run, name=f"sglang-{self.engine_id}", daemon=True).start()
        started.wait()
        if "error" in box:
            raise RuntimeError(f"cannot start {' '.join(self.command[:3])}: {box['error']}")
        log.info("engine %d: started %s (log %s)", self.engine_id, self.command, self.log_path)
        return box["proc"]

    def wait_ready(self, client: EngineClient) -> float:
        """Wait for ``/health_generate`` within ``startup_timeout_s``; seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + self._sc.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server of engine {self.engine_id} exited with "
                    f"{self._proc.returncode} before it was ready; command: "
                    f"{' '.join(self.command)}\nlog {self.log_path}:\n{self.log_tail()}"
                )
            if client.health_generate():
                return time.monotonic() - t0
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"SGLang server of engine {self.engine_id} not healthy after "
            f"{self._sc.startup_timeout_s:.0f}s (raise engines.sglang.startup_timeout_s); "
            f"command: {' '.join(self.command)}\nlog {self.log_path}:\n{self.log_tail()}"
        )

    def is_running(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> int:
        """SIGTERM the server's process group, SIGKILL it after stop_timeout_s; the exit code."""
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(self._sc.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("engine %d: SGLang ignored SIGTERM; killing it", self.engine_id)
                self._signal(signal.SIGKILL)
                self._proc.wait()
        return self._proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
