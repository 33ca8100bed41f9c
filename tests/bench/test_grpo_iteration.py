"""bench/grpo_iteration.py end to end on CPU (size xs, fp32, 1 rank): each backend's iteration split into sync,
rollout, log-prob and update seconds, with the engine's own counters, and fp32 log-probs that agree."""
from tests.bench.cli import ROOT, run


def test_grpo_iteration_bench(tmp_path):
    res = run("grpo_iteration.py", "--size", "xs", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8",
              "--iterations", "1", "--micro-batch-size", "2", out=tmp_path / "g.json", nproc=1)
    assert set(res["histories"]) == {"hf", "continuous"}
    for name, h in res["histories"].items():
        assert all(h[k][0] > 0 for k in ("rollout_s", "logprob_s", "update_s")), name
        assert 0 <= h["logprob_diff_max"][0] <= 1e-5, (name, h["logprob_diff_max"])
    assert res["histories"]["hf"]["engine"] == [{}]
    assert all(len(h["compile_s"]) == 1 and h["compile_s"][0] >= 0 for h in res["histories"].values())
    stats = res["histories"]["continuous"]["engine"][0]
    assert stats["sequences"] == 4 and stats["steps"] > 0 and stats["seconds"] > 0


def test_grpo_iteration_bench_with_lora_on_a_shape(tmp_path):
    """--shape small --lora-rank 4: a perf.hf_folder shape with the tiny tokenizer, LoRA on every linear, two
    iterations (the second samples from the refreshed, merged weights) with fp32 log-probs that agree; the folder
    is removed after. (The merge itself is checked against the bridge in tests/weights/.)"""
    res = run("grpo_iteration.py", "--shape", "small", "--lora-rank", "4", "--root", str(tmp_path), "--prompts", "2",
              "--samples", "2", "--max-new-tokens", "8", "--iterations", "2", "--micro-batch-size", "2",
              "--backends", "continuous", out=tmp_path / "g.json", nproc=1)
    h = res["histories"]["continuous"]
    assert res["args"]["lora_rank"] == 4 and len(h["update_s"]) == 2
    assert max(h["logprob_diff_max"]) <= 1e-5, h["logprob_diff_max"]
    assert not (tmp_path / "mfsdp_grpo_iteration_small").exists()


def test_grpo_iteration_bench_fp8_rollout_is_refused_on_cpu(tmp_path):
    """--backends continuous,continuous_fp8 with the rollout correction on CPU: the FP8 backend refused by name
    (`DecodeConfig.weights`), the bf16 one's iteration recorded with its reward and log-prob mismatch."""
    res = run("grpo_iteration.py", "--size", "xs", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8",
              "--iterations", "1", "--micro-batch-size", "2", "--backends", "continuous,continuous_fp8",
              "--rollout-correction", "token-truncate", out=tmp_path / "g.json", nproc=1)
    h, refused = res["histories"]["continuous"], res["histories"]["continuous_fp8"]["refused"]
    assert "weights='fp8' is not allowed" in refused and "no CUDA device" in refused
    assert len(h["reward"]) == 1 and 0 <= h["logprob_diff_mean"][0] <= 1e-5


def test_grpo_iteration_bench_with_partial_rollouts(tmp_path):
    """--partial-fraction 0.5 --max-staleness 2 (the grpo_partial GPU section's flags): twice the groups in flight,
    each iteration trains on its prompts' worth, the staleness histogram recorded and within the bound."""
    res = run("grpo_iteration.py", "--size", "xs", "--prompts", "2", "--samples", "2", "--max-new-tokens", "8",
              "--iterations", "3", "--micro-batch-size", "2", "--backends", "continuous", "--partial-fraction", "0.5",
              "--max-staleness", "2", out=tmp_path / "g.json", nproc=1)
    h = res["histories"]["continuous"]
    assert res["args"]["partial_fraction"] == 0.5 and len(h["rollout_s"]) == 3
    assert len(h["staleness_tokens"]) == 3 and max(h["staleness_max"]) <= 2 and sum(h["rows_carried"]) > 0


def test_positions_leave_room_for_the_budget():
    import importlib.util
    spec = importlib.util.spec_from_file_location("grpo_iteration", ROOT / "bench" / "grpo_iteration.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.positions_for(512) == 1024 and bench.positions_for(2048) == 2304
