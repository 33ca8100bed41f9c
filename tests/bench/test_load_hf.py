"""bench/load_hf.py end to end on 2 gloo ranks (shape small, fp32): rank 0 writes a sharded folder with
an index, both ranks load it phase by phase into Megatron-FSDP and train one step."""
import math

from tests.bench.cli import run

PHASES = ["check", "provider", "build", "weights", "wrap", "settle", "train"]


def test_load_hf_bench(tmp_path):
    res = run("load_hf.py", "--shape", "small", "--root", str(tmp_path), "--shard-gb", "0.0002",
              out=tmp_path / "load.json")
    assert res["world"] == 2 and res["write"]["shards"] >= 2 and res["write"]["params"] == res["params"]
    assert [[p["phase"] for p in r["phases"]] for r in res["ranks"]] == [PHASES, PHASES]
    assert all(p["seconds"] >= 0 and p["rss_bytes"] > 0 for r in res["ranks"] for p in r["phases"])
    loss = res["ranks"][0]["losses"][0]
    assert abs(loss - math.log(512)) < 0.1, loss      # random weights: about a uniform guess over the vocab
    assert not (tmp_path / "mfsdp_load_small").exists()   # removed without --keep
