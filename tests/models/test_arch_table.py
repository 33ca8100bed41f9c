"""The architecture truth table (tests/models/arch_table.py): every architecture Megatron-Bridge 0.3.1
lists either works end to end at TP 1 and TP 2 (or is refused at TP 2 with a ConfigError) or is
refused by check_folder with a ConfigError naming it. No third outcome. Minutes: marked slow."""
import pytest

from mfsdp_kit.models import support
from tests.models import arch_table


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return {r["arch"]: r for r in arch_table.collect(tmp_path_factory.mktemp("archs"))}


@pytest.mark.slow
def test_every_listed_architecture_has_an_outcome(rows):
    for arch, row in rows.items():
        print(arch, row["outcome"])
        if row["outcome"] == "refused":
            assert arch in row["reason"] and arch in support.REFUSED
        elif row["outcome"] == "works":
            assert arch in support.VERIFIED
            for tp, r in row["tp"].items():
                if "refused" in r:
                    assert tp > 1 and "tensor_model_parallel_size" in r["refused"]
                    continue
                assert r["verify"]["relative"] < 1e-5, (arch, tp, r["verify"])
                assert r["export_names_match"] and r["export_shapes_match"] and r["export_maxdiff"] == 0.0
                assert abs(r["megatron_loss"] - r["hf_loss"]) < 1e-5 and r["trained_shapes_match"]
                assert r["reload_relative"] < 1e-5
                assert r["greedy"]["ok"], (arch, tp, r["greedy"])   # 32 greedy tokens == transformers'
        else:
            assert row["outcome"] == "not tested" and row["reason"]


@pytest.mark.slow
def test_the_must_work_families_work(rows):
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        assert rows[arch]["outcome"] == "works"
