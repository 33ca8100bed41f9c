"""bench/router_replay.py end to end on 2 gloo ranks, fp32 (the rollout engine and the trainer agree to roundoff:
no flips, the mismatch the same with and without replay), one architecture to keep it short."""
from tests.bench.cli import run


def test_router_replay_bench(tmp_path):
    res = run("router_replay.py", "--dtype", "fp32", "--archs", "Qwen3MoeForCausalLM", "--prompts", "2", "--samples",
              "2", "--max-new-tokens", "6", "--root", str(tmp_path / "models"), out=tmp_path / "r.json")
    row = res["rows"]["Qwen3MoeForCausalLM"]
    print(row)
    assert row["tokens"] > 0 and row["flips"] == 0.0
    assert row["diff_max_with"] < 1e-4 and row["diff_max_without"] < 1e-4
    assert res["provenance"]["device"]
