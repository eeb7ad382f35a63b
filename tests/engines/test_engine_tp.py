"""An embedded engine spanning 2 ranks (engines.tp_size=2) on a real Ray cluster:
it generates what a 1-rank engine generates, reloads from disk on every rank or
on none, every rank verifying what it reads against the version's manifest, takes
tensor handles one per rank, joins a broadcast group with every rank, and its
ranks live and die with it."""

from __future__ import annotations

import os
import shutil
import time
import uuid

import fsspec
import pytest
import ray

from engines.config import EngineConfig
from engines.embedded.weight_files import read_state_dict
from engines.group import EngineGroup
from storage.weights import WeightsWriter
from training.broadcast_sender import BroadcastSender
from training.weight_sender import ShmSegment
from wire.flat_bucket import flatten

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "stop_token_ids": []}
PROMPTS = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14, 15]]


def _group(tp: int) -> EngineGroup:
    cfg = EngineConfig(num_engines=1, tp_size=tp, num_cpus_per_engine=0.5, health_timeout_s=120.0)
    return EngineGroup(f"test-tp{tp}-{uuid.uuid4().hex[:8]}", cfg, namespace="prefect-rl-test")


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_dir):
    one, two = _group(1), _group(2)
    one.start(str(tiny_dir), 0)
    two.start(str(tiny_dir), 0)
    yield one, two
    one.shutdown()
    two.shutdown()


def _gen(group: EngineGroup) -> list[dict]:
    return ray.get(group.handle(0).generate.remote(PROMPTS, GREEDY))


def _sha(group: EngineGroup) -> str:
    return ray.get(group.handle(0).state_sha256.remote())


def test_two_ranks_generate_like_one(engines):
    one, two = engines
    assert ray.get(two.handle(0).model_info.remote())["tp_size"] == 2
    assert _sha(one) == _sha(two)  # gathered shards == the full model
    a, b = _gen(one), _gen(two)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    for ra, rb in zip(a, b):
        lp_a = [x[0] for x in ra["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in rb["meta_info"]["output_token_logprobs"]]
        assert lp_a == pytest.approx(lp_b, abs=1e-4)
    assert ray.get(two.handle(0).health_generate.remote())


def test_disk_reload_is_all_ranks_or_none(engines, tiny_v1, broken_dir, tiny_dir):
    one, two = engines
    bad = ray.get(two.handle(0).update_weights_from_disk.remote(str(broken_dir), "9"))
    assert not bad["success"] and "missing" in bad["message"]
    assert ray.get(two.handle(0).get_weight_version.remote()) == "0"
    for g in engines:
        assert ray.get(g.handle(0).update_weights_from_disk.remote(str(tiny_v1), "1"))["success"]
    assert _sha(one) == _sha(two)
    assert [r["output_ids"] for r in _gen(one)] == [r["output_ids"] for r in _gen(two)]
    for g in engines:  # back to v0 for the next test
        assert ray.get(g.handle(0).update_weights_from_disk.remote(str(tiny_dir), "0"))["success"]


def test_each_rank_verifies_the_version_it_reads(engines, tiny_v1, tiny_dir, tmp_path):
    """A byte flipped in a shard of a committed version: the engine refuses it and serves
    on, and rank 1 reading the folder itself names the mismatch too; the intact version
    loads on every rank."""
    _, two = engines
    writer = WeightsWriter(fsspec.filesystem("file"), str(tmp_path / "weights"), "t", 1, 1, 0)
    for f in sorted(tiny_v1.iterdir()):
        writer.add_file(f.name, str(f))
    writer.commit()  # shards, then manifest.json last: v1, as a run publishes it
    intact = tmp_path / "weights" / "v000001"
    damaged = shutil.copytree(intact, tmp_path / "corrupt-tp")
    shard = sorted(damaged.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x10
    shard.write_bytes(data)
    h = two.handle(0)
    res = ray.get(h.update_weights_from_disk.remote(str(damaged), "1"))
    assert not res["success"] and "hash mismatch" in res["message"]
    assert ray.get(h.get_weight_version.remote()) == "0"

    def stage_on_rank_1(engine, path):  # what rank 1 finds when it reads the dir itself
        return ray.get(engine.served.ranks.peers[0].stage_from_disk.remote(path))

    err = ray.get(h.__ray_call__.remote(stage_on_rank_1, str(damaged)))
    assert err is not None and err.startswith("rank 1") and "hash mismatch" in err
    ok = ray.get(h.update_weights_from_disk.remote(str(intact), "1"))
    assert ok["success"], ok["message"]
    # back to v0 for the next test
    assert ray.get(h.update_weights_from_disk.remote(str(tiny_dir), "0"))["success"]


def test_tensor_handles_one_per_rank(engines, tiny_v1):
    one, two = engines
    target = ray.get(one.handle(0).update_weights_from_disk.remote(str(tiny_v1), "1"))
    assert target["success"]
    flats = flatten(sorted(read_state_dict(tiny_v1).items()))
    seg = ShmSegment(flats)
    try:
        engine = two.handle(0)
        with pytest.raises(ray.exceptions.RayTaskError, match="one per rank"):
            ray.get(engine.update_weights_from_tensor.remote([seg.handle], weight_version="1"))
        reply = ray.get(
            engine.update_weights_from_tensor.remote([seg.handle, seg.handle], weight_version="1")
        )
    finally:
        seg.close()
    assert reply["success"], reply
    assert ray.get(engine.get_weight_version.remote()) == "1"
    assert _sha(two) == _sha(one)


def test_broadcast_reaches_every_rank(engines, tiny_dir):
    one, two = engines
    assert ray.get(one.handle(0).update_weights_from_disk.remote(str(tiny_dir), "0"))["success"]
    state = read_state_dict(tiny_dir)
    sender = BroadcastSender()
    try:
        out = sender.send(
            two.handle(0), sorted(state.items()), 5, 64 * 1024, False, "tp-bcast", "gloo"
        )
    finally:
        sender.close()
    assert out["buckets"] > 1
    assert ray.get(two.handle(0).get_weight_version.remote()) == "5"
    assert _sha(two) == _sha(one)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_die_with_the_engine(engines, tiny_dir):
    one, two = engines
    before = ray.get(two.handle(0).rank_pids.remote())
    assert len(set(before)) == 2  # rank 0 (the engine actor) and rank 1: two processes
    two.restart(0, str(tiny_dir), 0)
    after = ray.get(two.handle(0).rank_pids.remote())
    assert len(set(after)) == 2 and not set(before) & set(after)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in before)
    assert [r["output_ids"] for r in _gen(two)] == [r["output_ids"] for r in _gen(one)]
