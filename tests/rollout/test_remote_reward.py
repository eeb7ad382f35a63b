"""``rollout.reward: http://...`` against a real reward server on loopback
(http.server in a thread): a good reply, a retried 503, a server that times
out, one that is down, one that answers garbage or the wrong count, and the
scoring fanned out over Ray tasks. The limits: redirects are never
followed (the token stays with the configured origin), rewards are bounded,
``timeout_s`` bounds the whole reply (a dripped one too), a body has a size
cap, and retry pauses have a ceiling."""

from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError

from rollout.config import RolloutConfig
from rollout.remote_reward import (
    RemoteRewardConfig,
    RemoteRewardError,
    backoff_pauses,
    post_rewards,
)
from rollout.rewards import score

ITEMS = [
    {
        "prompt": "3+4=",
        "response": r,
        "label": "7",
        "prompt_index": 0,
        "sample_index": j,
        "turns": [],
    }
    for j, r in enumerate(["7", "8", "7"])
]


# A valid reply of 3 rewards, dripped or padded by the paths below.
REPLY = b'{"rewards": [1.0, 0.0, 1.0]}'


# A valid reply dripped a byte every 0.1 s (4 s in all); a valid reply padded
# to 32 MiB and ended by closing the connection (a server that never stops).
SLOW_REPLIES = {
    "/drip": ([bytes([b]) for b in REPLY.ljust(40)], 0.1, True),
    "/endless": (
        [REPLY[:-1] + b', "pad": "'] + [b"x" * 2**16] * 512 + [b'"}'],
        0.0,
        False,
    ),
}
BAD_REWARDS = {"/huge": b"1e39", "/negative": b"-1e39", "/bigint": b"1" + b"0" * 400}


class RewardServer:
    """A reward server on loopback; ``/ok`` scores exact matches, the other paths fail.
    Every request's method, path and headers are kept in ``seen``; ``/drip`` and
    ``/endless`` put "cut" (the client closed first) or "finished" in ``outcomes``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.outcomes: queue.Queue[str] = queue.Queue()
        self.flaky_left = 2
        self.redirect_to = ""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # where a followed redirect would land
                server.seen.append(("GET", self.path, dict(self.headers)))
                self._reply(200, REPLY)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body))
                server.seen.append(("POST", self.path, dict(self.headers)))
                if self.path.startswith("/redirect-"):
                    self.send_response(int(self.path.rsplit("-", 1)[1]))
                    self.send_header("Location", server.redirect_to)
                    self.send_header("Content-Length", "0")
                    return self.end_headers()
                if self.path in SLOW_REPLIES:
                    return self._stream(*SLOW_REPLIES[self.path])
                if self.path in BAD_REWARDS:
                    return self._reply(200, b'{"rewards": [1.0, %s, 0.0]}' % BAD_REWARDS[self.path])
                if self.path == "/deep":
                    return self._reply(
                        200, b'{"rewards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                    )
                if self.path == "/slow":
                    time.sleep(1.0)
                if self.path == "/flaky" and server.flaky_left > 0:
                    server.flaky_left -= 1
                    return self._reply(503, b"busy")
                if self.path == "/garbage":
                    return self._reply(200, b"<html>not json</html>")
                if self.path == "/short":
                    return self._reply(200, b'{"rewards": [1.0]}')
                if self.path == "/nan":
                    return self._reply(200, b'{"rewards": [1.0, NaN, 0.0]}')
                if self.path == "/bad-request":
                    return self._reply(400, b"no such label")
                rewards = [float(s["response"] == s["label"]) for s in body["samples"]]
                self._reply(200, json.dumps({"rewards": rewards}).encode())

            def _reply(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, parts: list[bytes], pause_s: float, length: bool) -> None:
                """200 with ``parts`` written one by one; without ``length`` the body
                ends when the connection closes."""
                self.send_response(200)
                if length:
                    self.send_header("Content-Length", str(sum(map(len, parts))))
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                for part in parts:
                    time.sleep(pause_s)
                    try:
                        self.wfile.write(part)
                    except OSError:  # the client shut the connection before the end
                        return server.outcomes.put("cut")
                server.outcomes.put("finished")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    s = RewardServer()
    yield s
    s.close()


FAST = RemoteRewardConfig(timeout_s=0.3, retries=1, backoff_s=0.01)


def test_rewards_come_from_the_server_with_openrlhf_keys(server):
    cfg = RolloutConfig(reward=f"{server.url}/ok", remote_reward=FAST)
    assert score(cfg, ITEMS) == [1.0, 0.0, 1.0]
    path, body = server.requests[-1]
    assert path == "/ok"
    assert body["labels"] == ["7", "7", "7"] and body["query"][1] == "3+4=8"
    assert [s["sample_index"] for s in body["samples"]] == [0, 1, 2]


def test_a_busy_server_is_retried(server):
    server.flaky_left = 1
    assert post_rewards(f"{server.url}/flaky", FAST, ITEMS) == [1.0, 0.0, 1.0]
    assert [p for p, _ in server.requests[-2:]] == ["/flaky", "/flaky"]


def test_a_server_that_times_out_fails_after_its_retries(server):
    before = len(server.requests)
    with pytest.raises(
        RemoteRewardError, match=r"failed 2 times, last: no answer within .*timeout_s=0.3s"
    ):
        post_rewards(f"{server.url}/slow", FAST, ITEMS)
    assert [p for p, _ in server.requests[before:]] == ["/slow", "/slow"]


def test_a_server_that_is_down_names_the_url():
    down = RewardServer()
    url = f"{down.url}/ok"
    down.close()
    with pytest.raises(
        RemoteRewardError, match=rf"reward server {url} failed 2 times, last: unreachable"
    ):
        post_rewards(url, FAST, ITEMS)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/garbage", "answered non-JSON"),
        ("/short", "answered 1 rewards for 3 samples"),
        ("/nan", "answered a non-finite reward nan for sample 1"),
        ("/bad-request", "refused the samples: HTTP 400: no such label"),
    ],
)
def test_garbage_fails_at_once_saying_what_is_wrong(server, path, why):
    before = len(server.requests)
    with pytest.raises(RemoteRewardError, match=why):
        post_rewards(f"{server.url}{path}", FAST, ITEMS)
    assert len(server.requests) == before + 1  # never retried: the server answered


def test_a_url_with_credentials_is_refused_at_load():
    with pytest.raises(ValueError, match="carries credentials; remove them"):
        RolloutConfig(reward="http://user:secret@127.0.0.1:8000/reward")


def test_scoring_fans_out_over_ray_tasks(ray_cluster, server):
    from tasks.rollouts.services import ray_scorer

    cfg = RolloutConfig(reward=f"{server.url}/ok", remote_reward=FAST, reward_workers=2)
    before = len(server.requests)
    items = ITEMS * 3  # 9 samples: shares of 5 and 4, in order
    assert ray_scorer(cfg, timeout_s=60)(items) == [1.0, 0.0, 1.0] * 3
    sizes = sorted(len(body["samples"]) for _, body in server.requests[before:])
    assert sizes == [4, 5]
    assert ray_scorer(RolloutConfig(reward_workers=0), timeout_s=60) is None


@pytest.fixture(scope="module")
def elsewhere():
    """Another origin, which records what reaches it."""
    s = RewardServer()
    yield s
    s.close()


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_the_token_never_leaves(server, elsewhere, monkeypatch, code):
    monkeypatch.setenv("PREFECT_RL_TEST_RM_TOKEN", "s3cret-token")
    server.redirect_to = f"{elsewhere.url}/ok"
    cfg = FAST.model_copy(update={"api_key_env": "PREFECT_RL_TEST_RM_TOKEN"})
    with pytest.raises(
        RemoteRewardError,
        match=rf"reward server {server.url}/redirect-{code} answered HTTP {code} redirecting "
        rf"to '{elsewhere.url}/ok'; redirects are not followed .* set rollout.reward to the final URL",
    ):
        post_rewards(f"{server.url}/redirect-{code}", cfg, ITEMS)
    assert elsewhere.seen == []  # neither the samples nor the token went there
    assert server.seen[-1][2]["Authorization"] == "Bearer s3cret-token"  # the configured origin


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/huge", r"answered reward 1e\+39 for sample 1, outside \[-1e\+06, 1e\+06\]"),
        ("/negative", r"answered reward -1e\+39 for sample 1, outside"),
        ("/bigint", r"answered reward an integer of 401 digits for sample 1, outside"),
        ("/deep", "answered JSON nested too deeply"),
    ],
)
def test_a_reward_out_of_bounds_is_refused_naming_the_server(server, path, why):
    # 1e39 is a finite float64 but inf in the trainer's float32: persisted, it would
    # make NaN advantages in every retry. 10**400 and deep nesting once escaped as
    # OverflowError / RecursionError without the server's name.
    with pytest.raises(RemoteRewardError, match=rf"reward server {server.url}{path} {why}"):
        post_rewards(f"{server.url}{path}", FAST, ITEMS)


def test_max_abs_is_the_bound_and_is_itself_bounded(server):
    wide = FAST.model_copy(update={"max_abs": 1e30})
    with pytest.raises(RemoteRewardError, match=r"reward 1e\+39 .* \[-1e\+30, 1e\+30\]"):
        post_rewards(f"{server.url}/huge", wide, ITEMS)
    for bad in (float("inf"), 1e31, 0):
        with pytest.raises(ValidationError, match="max_abs"):
            RemoteRewardConfig(max_abs=bad)


def test_a_dripped_reply_is_cut_off_at_timeout_s(server):
    # Each byte comes well within the socket timeout; only a deadline over the
    # whole call stops it. The server sees the connection shut before its drip ends.
    cfg = RemoteRewardConfig(timeout_s=0.5, retries=0)
    with pytest.raises(
        RemoteRewardError, match=r"failed 1 times, last: no answer within .*timeout_s=0.5s"
    ):
        post_rewards(f"{server.url}/drip", cfg, ITEMS)
    assert server.outcomes.get(timeout=60) == "cut"


def test_an_endless_reply_is_refused_at_max_reply_mb(server):
    cfg = RemoteRewardConfig(timeout_s=30, retries=1, max_reply_mb=1)
    before = len(server.requests)
    with pytest.raises(
        RemoteRewardError,
        match=rf"reward server {server.url}/endless answered more than "
        r"rollout.remote_reward.max_reply_mb=1 MiB",
    ):
        post_rewards(f"{server.url}/endless", cfg, ITEMS)
    assert server.outcomes.get(timeout=60) == "cut"
    assert len(server.requests) == before + 1  # refused, not retried


def test_retry_pauses_double_up_to_max_backoff_s():
    cfg = RemoteRewardConfig(retries=10, backoff_s=0.5, max_backoff_s=30)
    assert backoff_pauses(cfg) == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert backoff_pauses(RemoteRewardConfig(retries=0)) == []
    assert backoff_pauses(RemoteRewardConfig(retries=3, backoff_s=0)) == [0, 0, 0]
    # retries is bounded: 10 retries wait at most 10 * max_backoff_s between attempts.
    with pytest.raises(ValidationError, match="retries"):
        RemoteRewardConfig(retries=11)
