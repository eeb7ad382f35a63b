"""``rollout.reward: http://...`` against a real reward server on loopback
(http.server in a thread): a good reply, a retried 503, a server that times
out, one that is down, one that answers garbage or the wrong count, and the
scoring fanned out over Ray tasks."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.config import RolloutConfig
from rollout.remote_reward import RemoteRewardConfig, RemoteRewardError, post_rewards
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


class RewardServer:
    """A reward server on loopback; ``/ok`` scores exact matches, the other paths fail."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.flaky_left = 2
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body))
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
        ("/nan", "answered a non-number reward"),
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
    from tasks.rollout_services import ray_scorer

    cfg = RolloutConfig(reward=f"{server.url}/ok", remote_reward=FAST, reward_workers=2)
    before = len(server.requests)
    items = ITEMS * 3  # 9 samples: shares of 5 and 4, in order
    assert ray_scorer(cfg, timeout_s=60)(items) == [1.0, 0.0, 1.0] * 3
    sizes = sorted(len(body["samples"]) for _, body in server.requests[before:])
    assert sizes == [4, 5]
    assert ray_scorer(RolloutConfig(reward_workers=0), timeout_s=60) is None
