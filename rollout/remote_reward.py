"""Rewards computed by a server (``rollout.reward: http://host:port/path``), as
slime's ``--rm-url`` and OpenRLHF's ``remote_rm_url`` do.

One POST per scoring call, JSON body::

    {"samples": [{"prompt", "response", "label", "prompt_index", "sample_index", "turns"}],
     "query": [prompt + response], "prompts": [prompt], "labels": [label]}

(``query``/``prompts``/``labels``: OpenRLHF's keys, so its reward servers work
as they are; ``response`` is the episode's answer, ``turns`` its whole
transcript). The reply must be ``{"rewards": [number, ...]}``, one finite
number per sample, in order.

Timeouts, connection failures, 429 and 5xx replies are retried
(``remote_reward.retries`` more times, with growing pauses): scoring is
idempotent. Anything else (a 4xx, a reply that is not that JSON, the wrong
count, a non-number) is a ``RemoteRewardError`` at once, naming the URL and
what was wrong. stdlib only (urllib): no Prefect, Ray or engines.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

RETRY_STATUS = (429, 500, 502, 503, 504)


class RemoteRewardError(RuntimeError):
    """The reward server failed, could not be reached, or answered garbage."""


class RemoteRewardConfig(BaseModel):
    """``rollout.remote_reward``: how a ``rollout.reward`` URL is called."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(60.0, gt=0, description="Seconds one POST may take")
    retries: int = Field(
        2, ge=0, description="More attempts after a timeout, 429/5xx or no connection"
    )
    backoff_s: float = Field(
        0.5, ge=0, description="Pause before the first retry; doubles each time"
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding a bearer token for the server"
    )


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_url(url: str) -> str:
    """Refuse a reward URL with credentials or without a host, naming the fix."""
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        raise ValueError(
            f"rollout.reward URL {parts.hostname!r} carries credentials; remove them from the "
            "URL and name the environment variable that holds a token in rollout.remote_reward.api_key_env"
        )
    if not parts.hostname:
        raise ValueError(f"rollout.reward {url!r} has no host; give http://host:port/path")
    return url


def request_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "samples": items,
        "query": [i["prompt"] + i["response"] for i in items],
        "prompts": [i["prompt"] for i in items],
        "labels": [i["label"] for i in items],
    }


def parse_rewards(url: str, raw: bytes, count: int) -> list[float]:
    """The rewards of a reply, or RemoteRewardError saying what is wrong with it."""
    fix = 'the server must answer {"rewards": [number, ...]} with one number per sample'
    try:
        body = json.loads(raw)
    except ValueError:
        raise RemoteRewardError(
            f"reward server {url} answered non-JSON ({raw[:80]!r}); {fix}"
        ) from None
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise RemoteRewardError(f"reward server {url} answered {str(body)[:80]!r}; {fix}")
    if len(rewards) != count:
        raise RemoteRewardError(
            f"reward server {url} answered {len(rewards)} rewards for {count} samples; {fix}"
        )
    bad = next((r for r in rewards if isinstance(r, bool) or not isinstance(r, (int, float))), None)
    if bad is not None or not all(math.isfinite(r) for r in rewards):
        raise RemoteRewardError(f"reward server {url} answered a non-number reward {bad!r}; {fix}")
    return [float(r) for r in rewards]


def post_rewards(url: str, cfg: RemoteRewardConfig, items: list[dict[str, Any]]) -> list[float]:
    """The server's reward of each item (see the module docstring for both shapes)."""
    if not items:
        return []
    data = json.dumps(request_body(items)).encode()
    headers = {"Content-Type": "application/json"}
    token = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last = ""
    for attempt in range(cfg.retries + 1):
        if attempt:
            time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=cfg.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code not in RETRY_STATUS:
                detail = e.read()[:200].decode(errors="replace")
                raise RemoteRewardError(
                    f"reward server {url} refused the samples: HTTP {e.code}: {detail}"
                ) from None
            last = f"HTTP {e.code}"
        except TimeoutError:  # a read that took longer than timeout_s
            last = f"no answer within rollout.remote_reward.timeout_s={cfg.timeout_s:g}s"
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                last = f"no answer within rollout.remote_reward.timeout_s={cfg.timeout_s:g}s"
            else:
                last = f"unreachable ({reason})"
        else:
            return parse_rewards(url, raw, len(items))
    raise RemoteRewardError(
        f"reward server {url} failed {cfg.retries + 1} times, last: {last}; check that it runs "
        "and answers, or raise rollout.remote_reward.timeout_s / retries"
    )
