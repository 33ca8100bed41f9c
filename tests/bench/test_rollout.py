"""bench/rollout.py end to end on CPU (shape tiny, fp32): both backends time every batch size, beside the floor,
and the kit's greedy tokens and log-probs equal HF's (fp32)."""
from tests.bench.cli import run


def test_rollout_bench(tmp_path):
    res = run("rollout.py", "--shape", "tiny", "--batches", "2,4", "--prompt-tokens", "6", "--new-tokens", "70",
              "--hf-new-tokens", "4", "--variants", "eager", "--agreement-rows", "3", out=tmp_path / "r.json", nproc=1)
    assert res["device"] == "cpu" and [r["sequences"] for r in res["results"]] == [2, 4]
    for r in res["results"]:
        assert r["kit_steps"] == 70 and r["kit_decode_ms_per_step"] > 0 and r["kit_ms_per_step"] > 0 and r["hf_ms_per_step"] > 0, r
        assert r["floor_ms"] > 0 and r["kit_tokens_per_s"] == r["sequences"] / r["kit_ms_per_step"] * 1e3
    assert res["agreement"]["eager"]["token_agreement"] == 1.0 and res["agreement"]["eager"]["max_logprob_diff"] < 1e-4


def test_rollout_bench_with_a_tool(tmp_path):
    """--tools: the engine with and without a tool on the same rows; the tool is called and its wait reported."""
    res = run("rollout.py", "--shape", "tiny", "--batches", "4", "--prompt-tokens", "6", "--new-tokens", "128",
              "--hf-new-tokens", "2", "--variants", "eager", "--agreement-rows", "0", "--tools", out=tmp_path / "r.json",
              nproc=1)
    (row,) = res["tools"]
    assert row["plain"]["tokens_per_s"] > 0 and row["tools"]["tokens_per_s"] > 0
    assert row["tools"]["tool_calls"] > 0 and row["tools"]["tool_wait_s"] > 0 and "tool_calls" not in row["plain"]


def test_rollout_bench_shared_prefill(tmp_path):
    """--shared-prefill alone (--batches ""): 2 prompts of 256 tokens x 4 samples prefilled with `share_prefill` off
    and on; on runs each prompt once (a quarter of the tokens) and samples the same tokens."""
    res = run("rollout.py", "--shape", "tiny", "--batches", "", "--prompt-tokens", "256", "--shared-prefill", "2",
              "--samples", "4", "--repeats", "2", "--agreement-rows", "0", out=tmp_path / "r.json", nproc=1)
    shared = res["shared_prefill"]
    assert res["results"] == [] and shared["prompts"] == 2 and shared["samples"] == 4
    assert shared["off"]["prefill_tokens"] == 4 * shared["on"]["prefill_tokens"] == 4 * 2 * 256
    assert shared["same_tokens"] and shared["on"]["prefill_s"] > 0 and shared["on / off"] > 0


def test_rollout_bench_fp8_is_refused_on_cpu_and_bf16_still_runs(tmp_path):
    """--variants eager,fp8 on CPU: the FP8 variant refused by name (`DecodeConfig.weights`), the bf16 half of the
    table made, with the weights' floor beside each row."""
    res = run("rollout.py", "--shape", "tiny", "--batches", "2", "--prompt-tokens", "6", "--new-tokens", "8",
              "--hf-new-tokens", "2", "--variants", "eager,fp8", "--agreement-rows", "0", out=tmp_path / "r.json", nproc=1)
    assert "weights='fp8' is not allowed" in res["refused"]["fp8"] and "no CUDA device" in res["refused"]["fp8"]
    (row,) = res["results"]
    assert row["variant"] == "eager" and 0 < row["weights_floor_ms"] < row["floor_ms"]
