"""Qwen3-MoE and OLMoE (tiny, written by transformers) on 2 gloo ranks at expert-parallel size 1 and 2,
DDP and Megatron-FSDP, all four layouts of both in one torchrun job (tests/dist/scenarios_moe.py):
logits vs HF, export exact (EP 2: the experts gathered from both ranks under their HF names), the
loss vs transformers', FSDP == DDP and EP 2 == EP 1 training, save_hf at EP 2 reloads to the same
logits, and a checkpoint round trip that is bitwise."""
import pytest

from mfsdp_kit.train.parity import compare_curves
from tests.dist import launch
from tests.selection import parity_only

ARCHS = ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"]
LAYOUTS = ["ep1-ddp", "ep1-fsdp", "ep2-ddp", "ep2-fsdp"]
CASES = [(a, layout) for a in ARCHS for layout in LAYOUTS]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def runs(work, request):
    # the portable pass (-m parity) reads only the losses and grad norms: the same training, none of the other checks
    return launch.run("scenarios_moe:moe_layouts", archs=ARCHS, workdir=str(work), train_only=parity_only(request))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_moe_matches_hf_exports_exactly_and_checkpoints_bitwise(runs, case):
    arch, layout = case
    r = runs[arch][layout]
    print(case, r["verify"], "export max|diff|", r["export_maxdiff"], "loss", r["megatron_loss"], "HF",
          runs[arch]["hf_loss"], "layout seconds", round(r["seconds"], 1))
    assert r["wrapper"] == ("FullyShardedDataParallel" if layout.endswith("fsdp") else "DistributedDataParallel")
    ep = int(layout[2])
    assert (r["ep_size"], r["local_experts"], r["expert_dp_size"]) == (ep, 4 // ep, 2 // ep)
    assert r["verify"]["ok"] and r["verify"]["relative"] < 1e-5
    assert r["export_names_match"] and r["export_shapes_match"] and r["export_maxdiff"] == 0.0
    assert abs(r["megatron_loss"] - runs[arch]["hf_loss"]) < 1e-5
    trained = r["trained_export"]
    assert trained["export_names_match"] and trained["export_shapes_match"] and trained["export_maxdiff"] > 0
    if ep > 1:
        print("save_hf reload relative", r["reload_relative"])
        assert r["reload_relative"] < 1e-5
    assert r["checkpoint"]["all_equal"], r["checkpoint"]["per_rank"]
    if layout.endswith("ddp"):   # memory_report sees every parameter DDP holds, experts included
        local, buffers = r["local_params_bytes"], r["memory_params_bytes"]   # buffers are padded a little
        assert local <= buffers < 1.05 * local, (local, buffers)


def same_training(a: dict, b: dict):
    """Every step compared at the dense tests' tolerance (tests/distributed/test_engine_dist.py)."""
    report = compare_curves(a["losses"], b["losses"], exact_steps=len(a["losses"]),
                            reference_grad_norm=a["grad_norms"], candidate_grad_norm=b["grad_norms"])
    print(report)
    return report.check()


@pytest.mark.parity
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("reference, candidate", [("ep1-ddp", "ep1-fsdp"), ("ep2-ddp", "ep2-fsdp"),
                                                  ("ep1-ddp", "ep2-ddp"), ("ep1-fsdp", "ep2-fsdp")])
def test_moe_layouts_train_the_same(runs, arch, reference, candidate):
    a, b = runs[arch][reference], runs[arch][candidate]
    print(arch, reference, a["losses"], a["grad_norms"], "\n", candidate, b["losses"], b["grad_norms"])
    same_training(a, b)


def test_ep2_checkpoint_converts_to_the_same_hf_weights(runs, work):
    """checkpoint.to_hf rebuilds the model in one process (EP 1) and reads the EP 2 Megatron-FSDP checkpoint,
    whose experts are saved under their global numbers: the folder equals save_hf's from the live model."""
    r = launch.run("scenarios_moe:to_hf_equals_save_hf", nproc=1, archs=ARCHS, workdir=str(work))
    print(r)
    assert all(v["names_match"] and v["maxdiff"] == 0.0 for v in r.values()), r
