"""warren bench create --blocks (docs/performance.md "Running it"): the floor,
crun and Warren's create+destroy interleaved in short blocks, each ratio
reported per block and as median and range. Checks the report's shape, not
any figure (no timing assertions)."""
import json


def test_bench_create_blocks(daemon):
    r = daemon.cli("bench", "create", "-q", "-n", "8", "-c", "2", "--blocks", "2",
                   "--floor-count", "40", "--no-alt", timeout=600)
    assert r.returncode == 0, r
    j = json.loads(r.stdout)
    b = j["blocks"]
    assert b["blocks"] == 2 and b["warren_count"] == 4 and b["floor_count"] == 20, b
    assert len(b["each"]) == 2, b
    for e in b["each"]:
        assert e["warren_rate"] > 0 and e["floor_rate"] > 0 and e["vs_floor"] > 0, e
        assert "crun_rate" not in e and "vs_crun" not in e, e  # --no-alt
    v = b["vs_floor"]
    assert 0 < v["min"] <= v["median"] <= v["max"], v
    assert b["vs_crun"] is None, b
    # the targets are judged on the block median; the single run stays reported
    assert abs(j["ratios"]["warren_vs_floor_rate"] - v["median"]) < 0.01, (j["ratios"], v)
    assert j["targets"]["create_vs_floor>=1.0"] == (j["ratios"]["warren_vs_floor_rate"] >= 1.0)
    assert j["targets"]["create_vs_crun>=10"] is None
    assert "warren_vs_floor_rate" in j["ratios_single_run"], j
    assert j["warren"]["count"] == 8, j["warren"]
    # no block option: no blocks in the report
    r = daemon.cli("bench", "create", "-q", "-n", "4", "-c", "1", "--floor-count", "10",
                   "--no-alt", timeout=600)
    assert r.returncode == 0, r
    j = json.loads(r.stdout)
    assert "blocks" not in j and "ratios_single_run" not in j, j
