"""The run lease: fencing, takeover by the holder's renewals (not clocks), fast paths."""

import os
import subprocess
import sys
import threading
import time

import pytest
from store_helpers import publish

import storage.lease as lease_mod
from storage import LeaseHeldError, LeaseLostError, RunStore


def _no_wait(monkeypatch) -> list[float]:
    """Make any wait of a taker fail loudly: proves a takeover happened at once."""

    def refuse(s: float) -> None:
        raise AssertionError(f"the taker waited ({s}s) where it must take over at once")

    monkeypatch.setattr(lease_mod, "_sleep", refuse)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


class _Renewer:
    """The holder's keeper: renews every ``every`` seconds in a thread, like tasks/lease.py."""

    def __init__(self, store: RunStore, owner: str, ttl_s: float, every: float):
        self._stop = threading.Event()
        self.errors: list[Exception] = []

        def loop() -> None:
            while not self._stop.wait(every):
                try:
                    store.renew_lease(owner, ttl_s)
                except Exception as e:  # surfaced by the test
                    self.errors.append(e)
                    return

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def test_fence_increases_and_survives_release(cfg, monkeypatch):
    a, b = RunStore(cfg, "run1"), RunStore(cfg, "run1")
    first = a.acquire_lease("alice", ttl_s=30)
    assert first.fence == 1 and a.fence == 1
    assert a.acquire_lease("alice", ttl_s=30).fence == 1  # the same process again: same fence
    a.release_lease("alice")
    released = b.read_lease()
    assert released is not None and released.released and released.fence == 1
    _no_wait(monkeypatch)  # a released lease is free at once
    second = b.acquire_lease("bob", ttl_s=30)
    assert second.fence == 2 and b.read_lease().owner == "bob"
    b.release_lease("bob")
    assert a.acquire_lease("alice", ttl_s=30).fence == 3  # never reused after a release


def test_skewed_clock_taker_waits_for_renewals_to_stop(cfg, monkeypatch):
    """The taker's wall clock runs 5 minutes ahead. It must not take a lease whose holder
    keeps renewing it; once the renewals stop it takes over with the next fence, and the
    old holder can neither renew nor commit."""
    holder = RunStore(cfg, "run1")
    assert holder.acquire_lease("holder", ttl_s=1.0).fence == 1
    real_time, taker_thread = time.time, threading.get_ident()
    monkeypatch.setattr(
        time, "time", lambda: real_time() + (300 if threading.get_ident() == taker_thread else 0)
    )
    keeper = _Renewer(holder, "holder", ttl_s=1.0, every=0.1)
    taker = RunStore(cfg, "run1")
    try:
        with pytest.raises(LeaseHeldError, match="holder.*renewed"):
            taker.acquire_lease("taker", ttl_s=1.0)
    finally:
        keeper.stop()
    assert not keeper.errors and holder.read_lease().owner == "holder"
    with pytest.raises(LeaseHeldError, match="wait=False"):
        taker.acquire_lease("taker", ttl_s=1.0, wait=False)  # a maintenance flow: fail fast
    lease = taker.acquire_lease("taker", ttl_s=1.0)  # watches 1 s without a renewal
    assert lease.fence == 2 and taker.read_lease().owner == "taker"
    with pytest.raises(LeaseLostError, match="fence 2.*must stop.*rerun"):
        holder.renew_lease("holder", ttl_s=1.0)
    with pytest.raises(
        LeaseLostError, match=r"\(fence 1\) lost.*'taker'\) took the run at fence 2"
    ):
        holder.write_record(1, "train", {"loss": 1.0})
    assert taker.read_record(1, "train") is None


def _loser_commits(loser: RunStore) -> dict:
    """Every kind of commit a writer makes, each as a thunk."""

    def weights() -> None:
        publish(loser, 5)

    def checkpoint() -> None:
        w = loser.checkpoint_writer(5)
        with w.open("model.pt") as f:
            f.write(b"stale")
        w.commit({"weights_version": 5})

    return {
        "ledger": lambda: loser.write_record(5, "train", {"loss": 1.0}),
        "weights": weights,
        "checkpoint": checkpoint,
        "rollouts": lambda: loser.write_rollouts(5, {"samples": [1]}),
        "metrics": lambda: loser.append_metrics(5, {"reward": 0.0}),
        "serving": lambda: loser.record_serving(0, 5),
        "run_json": lambda: loser.write_run_json({"stale": True}),
        "gc": lambda: loser.gc(keep_last=1),
    }


def test_loser_cannot_commit_anything(cfg):
    """After a forced takeover the first writer's store (fence 1) is refused for every
    commit it makes, and nothing it tried is visible; the taker commits normally."""
    first = RunStore(cfg, "run1")
    first.acquire_lease("first", ttl_s=30)
    publish(first, 1)
    publish(first, 2)
    first.write_run_json({"owner": "first"})
    taker = RunStore(cfg, "run1")
    assert taker.acquire_lease("taker", ttl_s=30, force=True).fence == 2
    # Another process of the loser rebuilds its store from the fence it was given.
    loser = RunStore(cfg, "run1", fence=1)
    for what, commit in _loser_commits(loser).items():
        with pytest.raises(LeaseLostError, match="'taker'.*fence 2.*must stop"):
            commit()
        assert what  # the name shows in the traceback of a failing iteration
    reader = RunStore(cfg, "run1")
    assert reader.read_record(5, "train") is None
    assert reader.committed_versions() == [1, 2]
    assert reader.committed_checkpoints() == []
    assert reader.read_rollouts(5) is None and reader.read_metrics() == []
    assert reader.serving_versions() == {} and reader.read_run_json() == {"owner": "first"}
    if loser.local_version_dir(1):
        assert not [
            n for n in os.listdir(os.path.dirname(loser.version_url(1))) if n.startswith(".")
        ]
    with pytest.raises(LeaseLostError):
        first.renew_lease("first", ttl_s=30)
    taker.write_record(5, "train", {"loss": 0.5})
    publish(taker, 5)
    assert reader.read_record(5, "train") == {"loss": 0.5} and reader.committed_versions() == [
        1,
        2,
        5,
    ]
    assert RunStore(cfg, "run1").write_rollouts(6, {"x": 1})  # fence=None: readers/tests skip it


def test_dead_local_pid_is_taken_over_at_once(cfg, monkeypatch):
    """A crashed flow on this host (owner "host:pid", pid gone) blocks no resume."""
    owner = f"{os.uname().nodename}:{_dead_pid()}"
    RunStore(cfg, "run1").acquire_lease(owner, ttl_s=3600)
    _no_wait(monkeypatch)
    lease = RunStore(cfg, "run1").acquire_lease(f"{os.uname().nodename}:{os.getpid()}", ttl_s=30)
    assert lease.fence == 2


def test_live_local_pid_is_watched_not_taken(cfg, monkeypatch):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        RunStore(cfg, "run1").acquire_lease(f"{os.uname().nodename}:{holder.pid}", ttl_s=0.3)
        waits: list[float] = []
        real = lease_mod._sleep
        monkeypatch.setattr(lease_mod, "_sleep", lambda s: (waits.append(s), real(s)))
        # Not renewing: taken, but only after watching it for its ttl.
        assert RunStore(cfg, "run1").acquire_lease("taker", ttl_s=30).fence == 2
        assert waits
    finally:
        holder.kill()
        holder.wait()


def test_force_takes_a_renewed_lease_at_once(cfg, monkeypatch):
    holder = RunStore(cfg, "run1")
    holder.acquire_lease("holder", ttl_s=30)
    _no_wait(monkeypatch)
    assert RunStore(cfg, "run1").acquire_lease("ops", ttl_s=30, force=True).fence == 2
    with pytest.raises(LeaseLostError, match="'ops'"):
        holder.renew_lease("holder", ttl_s=30)
    holder.release_lease("holder")  # not holder's any more: left alone
    assert holder.read_lease().owner == "ops" and not holder.read_lease().released


def test_racing_acquirers_only_one_wins(cfg):
    """The winner renews, as a run does (tasks/lease.py). A taker that read its lease.json
    before others took a turn watches it; without renewals it would rightly take over
    once ttl_s passed silent (a CI run once ended with two winners that way)."""
    stores = [RunStore(cfg, "run1") for _ in range(4)]
    won, lost, keepers = [], [], []
    barrier = threading.Barrier(len(stores))

    def go(i):
        barrier.wait()
        try:
            stores[i].acquire_lease(f"w{i}", ttl_s=30)
        except LeaseHeldError:
            lost.append(i)
            return
        won.append(i)
        keepers.append(_Renewer(stores[i], f"w{i}", ttl_s=30, every=0.1))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for keeper in keepers:
        keeper.stop()
    assert len(won) == 1 and len(lost) == 3
    assert stores[0].read_lease().owner == f"w{won[0]}"
    assert [k.errors for k in keepers] == [[]]  # nobody took the winner's lease


def test_racing_takers_of_a_dead_holder_get_one_fence(cfg, monkeypatch):
    """Four takers find a dead holder at once: the fence claim lets exactly one win."""
    RunStore(cfg, "run1").acquire_lease(f"{os.uname().nodename}:{_dead_pid()}", ttl_s=3600)
    stores = [RunStore(cfg, "run1") for _ in range(4)]
    won: list[int] = []
    barrier = threading.Barrier(len(stores))

    class WouldWait(Exception):
        pass

    def would_wait(s: float) -> None:  # a late taker finds the winner's live lease
        raise WouldWait()

    monkeypatch.setattr(lease_mod, "_sleep", would_wait)

    def go(i):
        barrier.wait()
        try:
            won.append(stores[i].acquire_lease(f"t{i}", ttl_s=30).fence)
        except (LeaseHeldError, WouldWait):
            pass

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won == [2]


def test_taker_that_died_between_claim_and_lease_blocks_nobody(cfg, monkeypatch):
    """A taker claimed fence 2 and died before writing lease.json: the next taker skips
    that fence at once (the claimer's pid is gone) instead of waiting or reusing it."""
    store = RunStore(cfg, "run1")
    store.acquire_lease("first", ttl_s=30)
    store.release_lease("first")
    claim = store.read_lease().model_copy(
        update={"owner": f"{os.uname().nodename}:{_dead_pid()}", "fence": 2, "released": False}
    )
    store.fs.pipe_file(
        f"{store.url}/lease-fences/000000000002.json", claim.model_dump_json().encode()
    )
    _no_wait(monkeypatch)
    assert RunStore(cfg, "run1").acquire_lease("next", ttl_s=30).fence == 3
