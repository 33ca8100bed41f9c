"""Qwen3-MoE and OLMoE (tiny, written by transformers) on 2 gloo ranks at expert-parallel size 1:
load -> wrap -> logits vs HF -> export exact -> one step -> export keeps HF names and shapes."""
import pytest

from tests.dist import launch

CASES = [("Qwen3MoeForCausalLM", True), ("Qwen3MoeForCausalLM", False), ("OlmoeForCausalLM", True),
         ("OlmoeForCausalLM", False)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe")
    return {c: launch.run("scenarios_arch:arch_roundtrip", arch=c[0], fsdp=c[1], workdir=str(work)) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'fsdp' if c[1] else 'ddp'}")
def test_moe_matches_hf_and_exports_exactly(runs, case):
    r = runs[case]
    print(case, r["verify"], "export max|diff|", r["export_maxdiff"], "loss", r["loss"])
    assert r["wrapper"] == ("FullyShardedDataParallel" if case[1] else "DistributedDataParallel")
    assert r["verify"]["ok"] and r["verify"]["relative"] < 1e-5
    assert r["export_names_match"] and r["export_shapes_match"] and r["export_maxdiff"] == 0.0
    assert r["changed_by_step"] > 0 and r["trained_shapes_match"]
    assert abs(r["megatron_loss"] - r["hf_loss"]) < 1e-5 and r["reload_relative"] < 1e-5


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"])
def test_moe_fsdp_step_equals_ddp_step(runs, arch):
    fsdp, ddp = runs[(arch, True)], runs[(arch, False)]
    print(arch, "loss FSDP", fsdp["loss"], "DDP", ddp["loss"])
    assert abs(fsdp["loss"] - ddp["loss"]) < 1e-6
