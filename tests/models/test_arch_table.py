"""The architecture truth table (tests/models/arch_table.py): every architecture Megatron-Bridge 0.3.1
lists either works end to end at TP 1 and TP 2 (or is refused at TP 2 with a ConfigError) or is
refused by check_folder with a ConfigError naming it. No third outcome. Minutes: marked slow."""
import pytest

from tests.models import arch_table


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return {r["arch"]: r for r in arch_table.collect(tmp_path_factory.mktemp("archs"))}


@pytest.mark.slow
def test_every_listed_architecture_has_an_outcome(rows):
    for arch, row in rows.items():
        print(arch, row["outcome"])
    assert not [p for row in rows.values() for p in arch_table.problems(row)]


@pytest.mark.slow
def test_the_must_work_families_work(rows):
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        assert rows[arch]["outcome"] == "works"
