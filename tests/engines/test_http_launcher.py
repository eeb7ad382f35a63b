"""The SGLang launcher (engines.sglang).

SGLang itself needs CUDA, so the launcher runs tests/engines/standin_sglang_server.py,
a STAND-IN that takes launch_server's arguments and serves the embedded
engine over the same protocol. What is tested is the launcher: the command
line, the readiness wait, the log, a clean stop, death with the actor.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray

from engines.client import EngineClient
from engines.config import EngineConfig, SGLangConfig
from engines.group import EngineGroup
from engines.sglang.engine import SGLangEngine

STANDIN = str(Path(__file__).with_name("standin_sglang_server.py"))


def _cfg(tmp_path, *flags: str, host: str = "127.0.0.1", **kw) -> EngineConfig:
    sc = SGLangConfig(
        host=host,
        launch_command=[sys.executable, STANDIN, *flags],
        log_dir=str(tmp_path),
        # Generous: the stand-in imports torch, and a loaded 2-core CI machine once took
        # over 60 s to start it. No test here waits for this deadline to pass.
        startup_timeout_s=300,
        extra_args=["--enable-foo"],
        **kw,
    )
    return EngineConfig(kind="sglang", num_engines=1, health_timeout_s=120, sglang=sc)


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_group_of_sglang_kind_runs_and_stops_standin(
    ray_cluster, tiny_dir, tiny_v1, broken_dir, tmp_path
):
    group = EngineGroup(f"test-{uuid.uuid4().hex[:8]}", _cfg(tmp_path), namespace="prefect-rl-test")
    group.start(str(tiny_dir), weight_version=3)
    try:
        h = group.handle(0)
        pid = ray.get(h.pid.remote())
        log = ray.get(h.log_tail.remote())
        assert "stand-in sglang server" in log and "--enable-foo" in log
        assert "'weight_version': '3'" in log  # --weight-version reached the server
        # The group drives it through the same Ray methods as an embedded engine.
        out = group.generate_groups([[1, 5, 6]], 2, {"max_new_tokens": 4}, [[1, 2]])
        assert len(out[0]) == 2 and {r["meta_info"]["weight_version"] for r in out[0]} == {"3"}
        res = ray.get(h.update_weights_from_disk.remote("/etc", "4"))
        assert not res["success"] and "no *.safetensors" in res["message"]
        # A folder short of a tensor never reaches the server: real SGLang would load the
        # rest and serve a mix of versions.
        res = ray.get(h.update_weights_from_disk.remote(str(broken_dir), "4"))
        assert not res["success"] and "missing 1 tensor(s)" in res["message"]
        assert ray.get(h.get_weight_version.remote()) == "3"
        urls = group.start_http()
        with EngineClient(urls[0]) as client:
            assert client.health_generate() and client.get_weight_version() == "3"
        # Killing the actor takes its server with it (parent-death signal).
        ray.kill(h, no_restart=True)
        assert _gone(pid), "the server outlived its actor"
    finally:
        group.shutdown()


def test_launcher_passes_the_token_as_api_key_and_never_logs_it(
    tmp_path, tiny_dir, monkeypatch, caplog
):
    token = "launch-s3cret"
    cfg = _cfg(tmp_path, host="0.0.0.0")
    monkeypatch.delenv(cfg.api_key_env, raising=False)
    with pytest.raises(ValueError, match="api key"):  # refused before anything starts
        SGLangEngine(str(tiny_dir), 0, cfg)
    assert not (tmp_path / "engine-0.log").exists()
    monkeypatch.setenv(cfg.api_key_env, token)
    caplog.set_level(logging.DEBUG, logger="engines.sglang")
    eng = SGLangEngine(str(tiny_dir), 0, cfg)
    try:
        # The server got the token: its admin endpoints refuse a caller without it.
        url = eng.client.base_url
        assert httpx.post(f"{url}/pause_generation", json={"mode": "abort"}).status_code == 401
        assert eng.client.flush_cache() is True  # the actor's client sends it
        assert "--api-key" in eng.command and token not in " ".join(eng.command)
        assert token not in caplog.text and "--api-key" in caplog.text
        assert token not in (tmp_path / "engine-0.log").read_text()
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def plain_engine(tmp_path_factory, tiny_dir):
    """One launched stand-in with the default settings, except that it ignores SIGTERM
    (stopped after 1 s by SIGKILL), for the tests that only talk to it (a launch is a
    process importing torch: tens of seconds on a loaded 2-core CI machine). Each such
    test leaves it awake and serving v0, as it found it; the last of them, the stop
    test (last in this file), stops it."""
    cfg = _cfg(tmp_path_factory.mktemp("plain-engine"), "--ignore-sigterm", stop_timeout_s=1.0)
    eng = SGLangEngine(str(tiny_dir), 0, cfg)
    try:
        yield eng
    finally:
        eng.stop()


def test_sglang_sleep_and_wake_are_idempotent(plain_engine):
    """Colocation wakes an engine that may be awake already; real SGLang 0.5.17 kills its
    scheduler on resuming a tag it never released, so the actor resumes only what it
    released, and reports its state as the embedded engine does."""
    eng = plain_engine
    woke = eng.resume_memory_occupation()  # awake already: nothing is sent
    assert (woke["state"], woke["changed"]) == ("awake", False)
    slept = eng.release_memory_occupation(["weights"])
    assert (slept["state"], slept["changed"]) == ("asleep", True)
    again = eng.release_memory_occupation(["weights"])
    assert (again["state"], again["changed"]) == ("asleep", False)
    assert eng.resume_memory_occupation()["changed"] is True
    assert eng.resume_memory_occupation()["changed"] is False
    assert eng.client.health_generate()  # the server lived through all of it


def test_an_endpoint_the_server_lacks_names_its_version(plain_engine):
    """An SGLang whose API differs (here: the stand-in has no /get_weights_by_name) is
    named with its version and the API prefect-rl drives, not a bare 404."""
    eng = plain_engine
    with pytest.raises(
        RuntimeError,
        match=r"SGLang .+ at http://.+ has no /get_weights_by_name.+drives SGLang 0.5",
    ):
        eng.get_weights_by_name("model.embed_tokens.weight")
    assert eng.get_weight_version() == "0"  # and the engine goes on serving


def test_launcher_stop_escalates_and_failed_launch_reports_log(plain_engine, tmp_path, tiny_dir):
    """Last of the tests on ``plain_engine``, which ignores SIGTERM: it stops it."""
    eng = plain_engine
    assert eng.client.health_generate() and eng.is_running()
    assert eng.health_generate()  # what the steps ask: a scheduler round trip
    t0 = time.monotonic()
    assert eng.stop() == -9  # SIGTERM ignored: SIGKILL after stop_timeout_s
    assert time.monotonic() - t0 >= 1.0 and not eng.is_running()
    assert not eng.health_generate()  # a dead server is not alive
    with pytest.raises(RuntimeError, match="exited with 3") as e:
        SGLangEngine(str(tiny_dir), 1, _cfg(tmp_path, "--exit-after-start"))
    assert "stand-in sglang server" in str(e.value)  # the log tail names the cause
    assert f"command: {sys.executable} {STANDIN}" in str(e.value)  # and what was run
    assert os.path.exists(tmp_path / "engine-1.log")
