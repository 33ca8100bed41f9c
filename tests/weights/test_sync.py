"""sync.load_into's planned path (weights.plan) == the bridge path == the folder, bitwise, on 2 gloo ranks:
DDP and Megatron-FSDP, the tiny qwen2 and architectures written by transformers (Llama, Qwen3 with
q/k norms, Llama with tied embeddings); after a training step the reused plan is still exact; a
misled or unknown mapping falls back to the bridge. One torchrun job for every case."""
import pytest

from tests.dist import launch

CASES = [  # (arch, fsdp, sabotage, overrides of the transformers config)
    ("tiny-qwen2", True, True, {}),
    ("tiny-qwen2", False, True, {}),
    ("Qwen3ForCausalLM", True, False, {}),
    ("LlamaForCausalLM", True, False, dict(tie_word_embeddings=True)),
]
IDS = [f"{a}-{'fsdp' if f else 'ddp'}{'-tied' if o else ''}" for a, f, _, o in CASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("sync"))
    calls = [["scenarios_sync:sync_paths", dict(arch=a, fsdp=f, sabotage=s, overrides=o, workdir=workdir)]
             for a, f, s, o in CASES]
    return dict(zip(IDS, launch.run("sequence", calls=calls)))


@pytest.mark.parametrize("case", IDS)
def test_planned_equals_bridge_and_folder(results, case):
    r = results[case]
    assert r["first"]["plan_built"] and r["first"]["bridge"] == 0, r["first"]     # every tensor planned
    assert r["first"]["planned"] == r["hf_tensors"] == r["first_bridge"]["bridge"]
    assert r["first"]["bytes"] == r["first_bridge"]["bytes"]
    assert r["planned_vs_bridge"] == 0.0 and r["planned_vs_folder"] == 0.0


@pytest.mark.parametrize("case", IDS)
def test_plan_reused_after_a_step_is_exact(results, case):
    r = results[case]
    assert not r["second"]["plan_built"] and r["second"]["planned"] == r["hf_tensors"]
    assert r["changed_by_step"] > 0
    assert r["trained_planned_vs_bridge"] == 0.0 and r["trained_planned_vs_export"] == 0.0


@pytest.mark.parametrize("case", IDS)
def test_a_warm_replay_does_no_per_tensor_work(results, case):
    """A warm replay is a few `_foreach_copy_` per unit on views made once (FSDP adds megatron's own
    gather ops). A silent fallback or per-tensor copies show as `copy_`; views remade on every sync
    as `select` / `split` (the QKV blocks, the gate/up halves)."""
    r = results[case]
    ops = r["replay_ops"]
    assert not any(ops.get(op) for op in ("copy_", "select", "split", "chunk")), ops
    assert 1 <= ops["_foreach_copy_"] <= 2 * r["units"], (ops, r["units"])
    if "ddp" in case:
        assert sum(ops.values()) == ops["_foreach_copy_"], ops


@pytest.mark.parametrize("case", IDS)
def test_plan_rebuilt_when_a_rollout_parameter_is_replaced(results, case):
    r = results[case]
    assert r["replaced"]["plan_built"] and r["replaced"]["planned"] == r["hf_tensors"]
    assert r["replaced_vs_bridge"] == 0.0


@pytest.mark.parametrize("case", [i for i, c in zip(IDS, CASES) if c[2]])
def test_misled_or_unknown_mappings_fall_back(results, case):
    r = results[case]
    s, layers = r["sabotaged"], r["layers"]
    # per layer: gate, up (swapped views), q, k, v and their biases (unknown), 2 norms (reversed); the final norm
    assert s["plan_built"] and s["bridge"] == layers * 10 + 1 and s["planned"] == r["hf_tensors"] - s["bridge"]
    assert r["sabotaged_vs_bridge"] == 0.0
