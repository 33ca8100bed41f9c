"""bench/sft_grpo.py end to end on 2 gloo ranks (size xs, 1-digit): SFT start saved, gold-SFT control,
GRPO with greedy and sampled held-out accuracy; a second run from the saved start stops after the SFT."""
from tests.bench.cli import run


def _bench(*flags: str, out) -> dict:
    return run("sft_grpo.py", "--size", "xs", "--sft-digits", "1", "--rl-digits", "1", *flags, out=out)


def test_sft_grpo_bench(tmp_path):
    start = tmp_path / "start"
    # step counts only as large as the checks need: each stage runs and reports its own count
    res = _bench("--sft-steps", "10", "--rl-sft-steps", "10", "--rl-sft-max-steps", "10",
                 "--save-rl-start", str(start), "--ceiling-sft-steps", "3", "--grpo-iterations", "2",
                 "--grpo-eval-every", "1", "--grpo-eval-samples", "2", out=tmp_path / "a.json")
    assert res["sft"]["steps"] == 10 and res["rl_sft"]["steps"] == 10 and res["ceiling_sft"]["steps"] == 3
    assert res["ceiling_sft"]["accuracy_before"] == res["rl_sft"]["accuracy_after"]  # the copy is the start
    assert [it for it, _, _ in res["heldout_curve"]] == [0, 1, 2]
    assert all(0 <= g <= 1 and 0 <= s <= 1 for _, g, s in res["heldout_curve"])
    assert res["heldout_curve"][0][1] == res["rl_sft"]["accuracy_after"]
    assert len(res["grpo"]["reward"]) == 2 and res["grpo"]["sync_bytes"][0] > 0 and res["sync_gbps"] > 0
    assert (start / "config.json").exists()

    again = _bench("--skip-sft1", "--rl-sft-steps", "0", "--init-from", str(start), "--grpo-iterations", "0",
                   out=tmp_path / "b.json")
    assert "grpo" not in again and again["sft"] is None
    assert again["rl_sft"]["accuracy_after"] == res["rl_sft"]["accuracy_after"]  # the saved start reloads
