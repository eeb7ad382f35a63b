"""A live holder keeps its run against a taker whose wall clock runs 5 minutes ahead:
the holder renews from the moment it takes the lease (also while it still writes
run.json and v0), and the taker judges only those renewals, by its own monotonic
clock. Once the holder is gone, the taker takes over after the TTL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import storage.lease as lease_mod
from flows.config import load_config
from storage.errors import LeaseHeldError
from storage.run_store import RunStore

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 2.0

# The holder, in a process of its own on "another host" (so no pid check can end the
# wait early): it takes the lease as prepare_run does, then stays in its setup (the
# base model's publish, say) until the test kills it.
_HOLDER = r"""
import sys
from flows.config import load_config
from tasks.context import RunContext
from tasks.prepare import take_lease

cfg = load_config(None, {"storage.root": sys.argv[1], "run.name": "skew",
                         "storage.lease_ttl_s": float(sys.argv[2])})
ctx = take_lease(RunContext(cfg=cfg, base_model_path=sys.argv[1], owner="otherhost:7"))
print(ctx.fence, flush=True)
sys.stdin.read()  # setting up: writing run.json, publishing a large v0 ...
"""


def test_a_skewed_clock_never_takes_a_live_holder_and_takes_a_dead_one_after_the_ttl(
    tmp_path, monkeypatch
):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), str(TTL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "1"
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 300)  # this process runs ahead
        cfg = load_config(None, {"storage.root": str(tmp_path), "run.name": "skew"})
        taker = RunStore(cfg.storage, "skew")
        # The holder's expires_at is long past by the taker's clock; its renewals are not.
        assert not taker.read_lease().live(time.time())
        with pytest.raises(LeaseHeldError, match="otherhost:7.*renewed"):
            taker.acquire_lease("taker", ttl_s=TTL_S)
        assert taker.read_lease().owner == "otherhost:7"
    finally:
        holder.send_signal(signal.SIGKILL)  # a holder that dies: its renewals stop
        holder.wait(timeout=30)
    waits: list[float] = []
    real_sleep = lease_mod._sleep
    monkeypatch.setattr(lease_mod, "_sleep", lambda s: (waits.append(s), real_sleep(s)))
    lease = taker.acquire_lease("taker", ttl_s=TTL_S)
    assert lease.fence == 2 and taker.read_lease().owner == "taker"
    assert waits  # taken only after watching the silent holder (for its TTL), not at once


def test_the_flows_keeper_goes_on_renewing_and_releases_on_exit(tmp_path):
    from tasks.context import RunContext
    from tasks.lease import LeaseKeeper
    from tasks.prepare import take_lease

    over = {"storage.root": str(tmp_path), "run.name": "kept", "storage.lease_ttl_s": 0.3}
    ctx = take_lease(RunContext(load_config(None, over), base_model_path=str(tmp_path)))
    renewals = ctx.store.read_lease().renewals
    with LeaseKeeper(ctx) as keeper:
        deadline = time.monotonic() + 30
        while ctx.store.read_lease().renewals < renewals + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctx.store.read_lease().renewals >= renewals + 2
        keeper.check()
    released = ctx.store.read_lease()
    assert released.released and released.fence == ctx.fence
