"""``bench.peers.compare``: runs of one system over several seeds are summarised as
the median and range a reader compares systems by."""

from __future__ import annotations

import json

from bench.peers.compare import across_seeds, load, to_target


def result(path, walls: list[float], evals: dict[int, float], system: str | None = None):
    rows = [
        {"iteration": k, "eval_pass_at_1_greedy": evals.get(k), "reward_mean": 0.1}
        for k in range(1, len(walls) + 1)
    ]
    data = {"walls": walls, "rows": rows, "base": {"pass_at_1_greedy": 0.2}}
    if system:
        data["system"] = system
    path.write_text(json.dumps(data))
    return str(path)


def test_each_system_shows_its_median_and_range_over_seeds(tmp_path):
    files = [
        result(tmp_path / "p0.json", [2.0, 1.0, 1.0, 1.0], {2: 0.4, 4: 0.6}),
        result(tmp_path / "p1.json", [2.0, 1.5, 1.5, 1.5], {2: 0.5, 4: 0.7}),
        result(tmp_path / "p2.json", [2.0, 2.0, 2.0, 2.0], {2: 0.3, 4: 0.45}),
        result(tmp_path / "t0.json", [3.0, 3.0, 3.0, 3.0], {2: 0.6, 4: 0.7}, "trl"),
    ]
    curves = [load(f) for f in files]
    for c in curves[:3]:
        c["system"] = f"project:{c['path']}"
    assert to_target(curves[0]["points"]) == (4, 5.0)
    lines = across_seeds(curves)
    assert len(lines) == 2  # the header and the project: one TRL run has no spread
    project = lines[1].split()
    assert project[:2] == ["project", "3"]
    # iteration seconds 1.0, 1.5, 2.0; pass@1 0.5 reached by two of three runs, at
    # 5.0 s and 3.5 s of iterations; last pass@1 0.6, 0.7, 0.45
    assert project[2:4] == ["1.50", "(1.00-2.00)"]
    assert project[4:6] == ["4.2", "(3.5-5.0)"]
    assert project[6] == "2/3"
    assert project[7:] == ["0.600", "(0.450-0.700)"]
