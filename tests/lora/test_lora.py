"""LoRA through Megatron-Bridge's PEFT: the config, and on 2 gloo ranks (DDP and Megatron-FSDP, TP 1 and 2) an
exact first forward, a frozen base (sharded under FSDP), adapters that train and alone hold grads, fp32 main
weights and optimizer state, and the same losses under every layout."""
import pytest

from mfsdp_kit import lora
from mfsdp_kit.config import ConfigError, EngineConfig, Wrapper
from tests.dist import launch
from tests.selection import parity_only
from tests.distributed.test_engine_dist import same_training   # the dense tests' tolerance

LAYOUTS = [(False, 1), (False, 2), (True, 1), (True, 2)]
IDS = ["ddp-tp1", "ddp-tp2", "fsdp-tp1", "fsdp-tp2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """LoRA training under the four layouts (TP2 on 2 ranks: DP 1), one 2-rank job. In a `-m parity` run
    only what the parity tests read: the same training, grads and resume; no exits, no GRPO."""
    workdir = str(tmp_path_factory.mktemp("lora"))
    lean = parity_only(request)
    calls = [["scenarios_lora:train_adapters", dict(fsdp=fsdp, tp=tp, workdir=workdir, exits=not lean)]
             for fsdp, tp in LAYOUTS]
    calls += [] if lean else [["scenarios_lora:grpo_with_lora", dict(workdir=workdir)]]
    calls += [["scenarios_lora:resume_adapters", dict(workdir=workdir)]]
    results = launch.run("sequence", nproc=2, calls=calls)
    return results[:GRPO] + [None] + results[GRPO:] if lean else results


GRPO, RESUME = len(LAYOUTS), len(LAYOUTS) + 1   # the last two results of the job


@pytest.mark.parametrize("bad, field", [(dict(rank=0), "lora.rank"), (dict(alpha=0), "lora.alpha"),
                                        (dict(dropout=1.0), "lora.dropout"), (dict(rank=2.5), "rank"),
                                        (dict(target_modules=[]), "lora.target_modules"),
                                        (dict(target_modules=["qkv"]), "lora.target_modules"),
                                        (dict(target_modules=["q_proj", "v_proj"]), "lora.target_modules"),
                                        (dict(target_modules=["gate_proj"]), "lora.target_modules")])
def test_bad_lora_config_names_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        lora.LoRAConfig(**bad)


def test_hf_names_map_to_megatrons_fused_linears():
    spec = lora.LoRAConfig(target_modules=["down_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
    assert spec.megatron_targets() == ["linear_qkv", "linear_fc1", "linear_fc2"]
    assert lora.LoRAConfig(target_modules=["o_proj", "linear_proj"]).megatron_targets() == ["linear_proj"]
    assert lora.LoRAConfig().megatron_targets() == list(lora.MEGATRON_TARGETS)


def test_engine_config_takes_lora_and_round_trips_yaml():
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True),
                       lora=lora.LoRAConfig(rank=4, alpha=8, target_modules=["o_proj"]))
    assert EngineConfig.from_yaml(cfg.validate().to_yaml()).lora == cfg.lora
    assert EngineConfig.from_yaml(EngineConfig().to_yaml()).lora is None
    with pytest.raises(ConfigError, match="lora"):
        EngineConfig(lora={"rank": 4})   # refused when made


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_first_forward_is_the_base_models(runs, index):
    """B = 0: the LoRA model's logits equal the plain model's, bit for bit."""
    assert runs[index]["init_diff"] == 0.0


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_base_stays_bit_equal_while_adapters_train(runs, index):
    r = runs[index]
    assert r["wrapper"] == ("FullyShardedDataParallel" if LAYOUTS[index][0] else "DistributedDataParallel")
    assert r["frozen_bit_equal"] and r["frozen_changed"] == [] and r["local_frozen_numel"] > 0
    assert r["adapters"] == 16   # 2 layers x 4 linears x (A, B)
    assert r["adapters_here"] > 0 and r["adapters_changed"] == r["adapters_here"]   # FSDP: some shards are empty
    assert r["all_trainable_are_adapters"] and len(r["trainable"]) == r["adapters"]
    assert r["losses"][-1] < r["losses"][0]


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_optimizer_and_grads_hold_adapters_only(runs, index):
    """Adam's exp_avg has one element per adapter weight over all ranks (sharded over DP: rank 0 holds parts of
    some adapters), none for the frozen base; grad buffers (and Megatron-FSDP's fp32 main weights) hold adapters
    only, 4 B each."""
    r, fsdp = runs[index], LAYOUTS[index][0]
    assert 0 < r["optimizer_params"] <= r["adapters"]
    assert r["state_numel_all_ranks"] * r["dp_size"] == r["trainable_numel_all_ranks"] > 0
    assert r["trainable_numel_all_ranks"] < r["frozen_numel_all_ranks"] / 10
    adapters_per_rank = r["trainable_numel_all_ranks"] // 2 // (r["dp_size"] if fsdp else 1)   # 2 ranks
    assert r["memory"]["grads_bytes"] == 4 * adapters_per_rank
    assert r["memory"]["main_params_bytes"] == (4 * adapters_per_rank if fsdp else 0)


@pytest.mark.parametrize("index", [2, 3], ids=IDS[2:])
def test_fsdp_shards_the_frozen_base(runs, index):
    """Each frozen weight is held once per TP slice over the DP ranks (DDP: on every rank)."""
    fsdp, ddp = runs[index], runs[index - 2]
    assert fsdp["local_frozen_numel"] == fsdp["frozen_numel_all_ranks"] // fsdp["dp_size"]
    assert ddp["local_frozen_numel"] == ddp["frozen_numel_all_ranks"]


@pytest.mark.parity
@pytest.mark.parametrize("ref, cand", [(0, 2), (1, 3), (0, 1), (2, 3)],
                         ids=["fsdp-vs-ddp-tp1", "fsdp-vs-ddp-tp2", "tp2-vs-tp1-ddp", "tp2-vs-tp1-fsdp"])
def test_lora_losses_match_across_layouts(runs, ref, cand):
    assert same_training(runs[ref], runs[cand])


@pytest.mark.parity
@pytest.mark.parametrize("index", [0, 1], ids=IDS[:2])
def test_adapter_grads_equal_hf_peft(runs, index):
    """One batch's adapter grads (megatron, after training moved B off 0) == HF peft's on the HF model from the
    same adapters, in fp32: B per q/k/v and gate/up after the bridge's split, A as the sum over its fused group."""
    g = runs[index]["grads_vs_peft"]
    assert g["names"] == g["peft_names"] == 2 * 2 * 7 and g["b_nonzero"]   # 2 layers x 7 HF modules x (A, B)
    assert g["max_diff"] <= 1e-6 * max(1.0, g["grad_scale"]), g


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_saved_adapter_loads_in_peft_with_megatrons_logits(runs, index):
    """Saved twice (the second replaces the first; no temporary folder left, nothing of the refused saves written);
    peft loads it on the base."""
    e = runs[index]["exits"]
    assert e["files"] == ["adapter_config.json", "adapter_model.safetensors"] and e["siblings"] == ["adapter", "merged"]
    assert e["scale"] == 2.0 and e["targets"] == sorted(lora.HF_TO_MEGATRON)
    assert e["peft"] < 2e-5 * max(1.0, e["logits_scale"]), e


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_merged_exports_equal_the_lora_model(runs, index):
    """`save_hf` (merged) loads in transformers, and the rollout sync writes merged weights: both give the LoRA
    model's logits."""
    e = runs[index]["exits"]
    assert e["merged"] < 2e-5 * max(1.0, e["logits_scale"]), e
    assert e["rollout"] < 2e-5 * max(1.0, e["logits_scale"]), e


@pytest.mark.parametrize("index", range(4), ids=IDS)
def test_the_sync_plan_merges_adapters_as_the_bridge_does(runs, index):
    """weights.plan writes W + (alpha / r) B A itself where TP is 1 (nothing left to the bridge's merge-and-export),
    with the bridge's values; at TP 2 the bridge converts. B is not zero here: the adapters have trained."""
    s = runs[index]["exits"]["sync"]
    assert s["weights_diff"] < 1e-6, s
    if "tp1" in IDS[index]:
        assert s["bridge"] == 0 and s["planned"] > 0, s


def test_grpo_runs_with_lora_on_merged_rollout_weights(runs):
    """The rollout refresh writes merged weights (W + s B A) each iteration: the rollout's log-probs of its own
    samples equal the trainer's at fp32 level, as in the dense GRPO tests; only the adapters move."""
    r = runs[GRPO]
    h = r["history"]
    assert len(h["reward"]) == 2 and all(b > 0 for b in h["sync_bytes"])
    assert all(0.0 <= d <= 1e-5 for d in h["logprob_diff_max"]), h["logprob_diff_max"]
    assert r["frozen_bit_equal"] and r["adapters_changed"] > 0


@pytest.mark.parity
def test_lora_checkpoint_resumes_exactly(runs):
    r = runs[RESUME]
    assert r["loaded_step"] == 2 and r["resumed"] == r["straight"]


def test_lora_checkpoint_holds_adapters_and_names_its_base(runs):
    r = runs[RESUME]
    assert r["all_adapters"] and len(r["model_keys"]) == 16 and r["lora_base"]["path"] == r["src"]
    assert len(r["lora_base"]["fingerprint"]) == 64
    assert [k.removeprefix("model.0.") for k in r["saved_model_keys"]] == sorted(r["model_keys"])
    # on disk (DCP's global sizes): the adapters and their optimizer state (fp32 main weights, Adam's moments, as
    # megatron's fsdp_dtensor layout keys them), a few RNG scalars; no base weight, which is 10x more here
    assert r["saved_numel"] < 8 * r["adapter_numel"] and 10 * r["adapter_numel"] < r["base_numel"]


def test_lora_checkpoint_refuses_another_base(runs):
    message = runs[RESUME]["refused"]
    assert message and "tiny_xs_other" in message and "base" in message and "fingerprint" in message


@pytest.mark.parametrize("index", [0, 3], ids=[IDS[0], IDS[3]])
def test_exits_refuse_what_they_cannot_write_by_name(runs, index):
    """`save_hf(merged=False)` of a LoRA model is a ConfigError naming `merged`; `save_adapter` into a folder that is
    not an adapter's is refused on every rank before the collective export."""
    refusals = runs[index]["exits"]["refusals"]
    assert "merged=False" in refusals["unmerged"] and "save_adapter" in refusals["unmerged"]
    assert "not an adapter folder" in refusals["foreign"]
