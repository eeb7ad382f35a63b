"""``engines.kind: sglang``: a Ray actor that runs and holds one SGLang server.

Owns one ``python -m sglang.launch_server`` process: its command line (from
``engines.sglang`` in the config), its log file, readiness (``/health_generate``
before a deadline) and a clean stop (SIGTERM to its process group, SIGKILL
after ``stop_timeout_s``). The server dies with the actor: it is spawned with
a parent-death signal, so ``ray.kill`` of the actor does not leave it
orphaned on the GPUs. The actor also answers the embedded engine's Ray methods
(``generate``, ``update_weights_from_disk``, ...) by calling its server over
HTTP with ``engines.client``, so ``EngineGroup`` drives both kinds alike.

The admin token (the env var named by ``engines.api_key_env``) is passed on
as ``--api-key``, so a server bound beyond loopback is never open; a
non-loopback host without a token is refused before anything starts. The
token is never logged: logs and ``command`` show it as ``***``. (It is on the
server's command line, as SGLang takes it, so local users who can read
``/proc`` can see it; run engines under their own user where that matters.)

Needs the ``sglang`` extra and CUDA GPUs; tests launch a stand-in server
script through ``engines.sglang.launch_command`` instead.
"""

from __future__ import annotations

import ctypes
import functools
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

import ray

from engines.client import EngineClient
from engines.config import EngineConfig, SGLangConfig
from engines.embedded import CONTROL_CONCURRENCY, CONTROL_GROUP, GENERATE_CONCURRENCY
from engines.security import require_token
from engines.types import GenerateResult, PauseMode, UpdateWeightsResult

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_control = ray.method(concurrency_group=CONTROL_GROUP)


@functools.cache
def actor_class() -> Any:
    """SGLangEngine as a threaded Ray actor with the embedded engine's control group
    (built once, as ``engines.embedded.actor_class`` is)."""
    return ray.remote(
        max_concurrency=GENERATE_CONCURRENCY,
        concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY},
    )(SGLangEngine)


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
) -> list[str]:
    """``launch_server`` arguments (SGLang 0.5.x names) for one engine."""
    args = ["--model-path", model_path, "--host", sc.host, "--port", str(port)]
    args += ["--tp-size", str(tp_size), "--weight-version", str(weight_version)]
    if sc.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(sc.mem_fraction_static)]
    if api_key:
        args += ["--api-key", api_key]
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


class SGLangEngine:
    """One SGLang server process, started in ``__init__`` and ready when it returns."""

    def __init__(
        self, model_path: str, engine_id: int, cfg: EngineConfig, weight_version: int = 0
    ) -> None:
        sc = cfg.sglang
        self.engine_id = engine_id
        self._cfg = cfg
        port = sc.port + engine_id if sc.port else free_port(sc.host)
        host = "127.0.0.1" if sc.host in ("0.0.0.0", "::") else sc.host
        self.url = f"http://{host}:{port}"
        prefix = sc.launch_command or [sys.executable, "-m", "sglang.launch_server"]
        api_key = os.environ.get(cfg.api_key_env) or None
        require_token(sc.host, api_key)  # before anything starts
        args = launch_args(model_path, sc, cfg.tp_size, port, weight_version, api_key)
        self._argv = [*prefix, *args]
        self.command = redacted(self._argv)  # what logs and errors show
        log_dir = Path(sc.log_dir or tempfile.mkdtemp(prefix="prefect-rl-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = str(log_dir / f"engine-{engine_id}.log")
        self._proc = self._spawn()
        self.client = EngineClient(self.url, api_key=api_key, retries=2)
        self._wait_ready(sc.startup_timeout_s)

    def _spawn(self) -> subprocess.Popen:
        """Start the server from a thread that lives as long as it does.

        The parent-death signal fires when the *thread* that forked exits, so
        that thread must outlive the server: it waits on it.
        """
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
        )
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
            raise RuntimeError(f"cannot start {self.command[:3]}: {box['error']}")
        log.info("engine %d: started %s (log %s)", self.engine_id, self.command, self.log_path)
        return box["proc"]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with {self._proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.client.health_generate():
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"SGLang server not healthy after {timeout_s:.0f}s (raise "
            f"engines.sglang.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}"
        )

    # ---- process ----------------------------------------------------------

    @_control
    def is_running(self) -> bool:
        return self._proc.poll() is None

    @_control
    def pid(self) -> int:
        return self._proc.pid

    @_control
    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @_control
    def stop(self) -> int:
        """SIGTERM the server's process group, SIGKILL it after stop_timeout_s; the exit code."""
        if self._proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(self._cfg.sglang.stop_timeout_s)
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

    @_control
    def http_url(self) -> str:
        return self.url

    # ---- the embedded engine's Ray methods, over HTTP ---------------------

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: list[dict] | dict,
        return_logprob: bool = True,
        rid: list[str] | None = None,
    ) -> list[GenerateResult]:
        if not input_ids:
            return []
        return self.client.generate(
            input_ids=[list(p) for p in input_ids],
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            rid=rid,
        )

    @_control
    def get_weight_version(self) -> str:
        return self.client.get_weight_version()

    @_control
    def model_info(self) -> dict[str, Any]:
        return self.client.model_info()

    @_control
    def health_generate(self) -> bool:
        return self.is_running() and self.client.health_generate()

    @_control
    def get_load(self) -> dict[str, int]:
        load = self.client.request("GET", "/get_load").json()
        total = sum(d.get("num_reqs", 0) for d in load)
        waiting = sum(d.get("num_waiting_reqs", 0) for d in load)
        return {"num_running_reqs": total - waiting, "num_waiting_reqs": waiting}

    @_control
    def pause_generation(self, mode: PauseMode = "abort") -> None:
        self.client.pause_generation(mode)

    @_control
    def continue_generation(self) -> None:
        self.client.continue_generation()

    @_control
    def flush_cache(self) -> bool:
        return self.client.flush_cache()

    @_control
    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> UpdateWeightsResult:
        from engines.client import EngineHTTPError

        try:
            return self.client.update_weights_from_disk(
                model_path, weight_version, flush_cache, abort_all_requests
            )
        except EngineHTTPError as e:  # a refused load is a result, as on the embedded engine
            return {"success": False, "message": e.message, "num_paused_requests": 0}

    @_control
    def update_weight_version(self, new_version: str) -> str:
        self.client.update_weight_version(new_version, abort_all_requests=False)
        return str(new_version)

    @_control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.client.abort_request(rid, abort_all)

    @_control
    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self.client.release_memory_occupation(tags)

    @_control
    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self.client.resume_memory_occupation(tags)
