"""HSDP (mfsdp_kit/config/hsdp.py): Megatron-FSDP sharded within 2 instances of 2 gloo ranks, replicated across them.

One 4-rank job: the same training as DDP's and Megatron-FSDP's over 4 ranks, half the parameters per rank, a
bitwise checkpoint round trip and exact resume, the checkpoint loaded into other layouts, exact weight sync and
export on the planned path, and keep_gathered's held step bit-equal. What megatron-core 0.16.1 gets wrong is
refused by name: by EngineConfig.validate, or at wrap for a model's own MoE config."""
import pytest

from mfsdp_kit.config import ConfigError, EngineConfig
from mfsdp_kit.distributed.memory import zero_formula_bytes
from tests.dist import launch
from tests.distributed.test_engine_dist import same_training

HSDP = {"num_distributed_optimizer_instances": 2}


@pytest.fixture(scope="module")
def trained():
    """The same training under DDP, Megatron-FSDP and HSDP over 4 ranks: all the parity test needs, in a job of
    its own, so a `-m parity` run runs only these three (make test's portable pass leaves HSDP out: PORTABLE_PARITY)."""
    calls = {
        "ddp": ["train_losses", dict(fsdp=False, steps=3)],
        "fsdp": ["train_losses", dict(fsdp=True, steps=3)],
        "hsdp": ["train_losses", dict(fsdp=True, steps=3, ddp=HSDP)],
    }
    return dict(zip(calls, launch.run("sequence", nproc=4, calls=list(calls.values()))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("hsdp")
    root = str(work / "ckpt")
    calls = {
        "saved": ["scenarios_ckpt:train_save", dict(fsdp=True, root=root, ddp=HSDP)],
        "resumed": ["scenarios_ckpt:resume", dict(fsdp=True, root=root, ddp=HSDP)],
        "elsewhere": ["scenarios_hsdp:load_into_other_layouts", dict(root=root)],
        "sync": ["scenarios_sync:sync_paths", dict(arch="tiny-qwen2", fsdp=True, workdir=str(work), ddp=HSDP)],
        # 2 micro-batches of 1 per rank: what a held step keeps, it keeps across micro-batches
        "released": ["scenarios_keep_gathered:train", dict(keep=False, dtype="fp32", micro_batch_size=1, ddp=HSDP)],
        "kept": ["scenarios_keep_gathered:train", dict(keep=True, dtype="fp32", micro_batch_size=1, ddp=HSDP)],
    }
    return dict(zip(calls, launch.run("sequence", nproc=4, calls=list(calls.values()))))


@pytest.mark.parity
@pytest.mark.parametrize("reference", ["ddp", "fsdp"])
def test_hsdp_trains_as_ddp_and_fsdp_do(trained, reference):
    hsdp = trained["hsdp"]
    print(reference, trained[reference]["losses"], "\nHSDP", hsdp["losses"])
    same_training(trained[reference], hsdp)
    assert hsdp["wrapper"] == "FullyShardedDataParallel" and hsdp["losses"][-1] < hsdp["losses"][0]


def test_hsdp_shards_over_an_instance_not_the_world(trained):
    total = trained["hsdp"]["spec_params"]
    print("local params per rank: HSDP", trained["hsdp"]["local_numel"], "FSDP", trained["fsdp"]["local_numel"],
          "of", total)
    assert all(abs(n / total - 1 / 2) < 0.05 for n in trained["hsdp"]["local_numel"])   # 2 ranks per instance
    assert all(abs(n / total - 1 / 4) < 0.05 for n in trained["fsdp"]["local_numel"])
    # memory.memory_report: the ZeRO formula's N is an instance's 2 ranks, and the bytes follow the formula as
    # closely as Megatron-FSDP's over 4 do (in fp32 both hold a main-weight copy the formula does not count)
    hsdp, fsdp = trained["hsdp"]["memory"], trained["fsdp"]["memory"]
    assert (hsdp["dp_size"], fsdp["dp_size"]) == (2, 4)
    measured = {name: r["model_state_bytes"] / zero_formula_bytes(num_params=total, dp_size=r["dp_size"],
                                                                   fsdp=True, dtype="fp32")
                for name, r in (("hsdp", hsdp), ("fsdp", fsdp))}
    assert abs(measured["hsdp"] / measured["fsdp"] - 1) < 0.03, measured


def test_hsdp_checkpoint_round_trip_resume_and_other_layouts(runs):
    saved, resumed, elsewhere = runs["saved"], runs["resumed"], runs["elsewhere"]
    assert saved["differs_before_load"] and saved["roundtrip"]["all_equal"], saved["roundtrip"]
    assert resumed["start"] == 5 and resumed["losses"] == saved["losses"][5:]
    for wrapper in ("fsdp", "ddp"):   # the same weights
        assert elsewhere[wrapper]["equal"] and elsewhere[wrapper]["n"] == 15, elsewhere[wrapper]
    # Megatron-FSDP over all 4 ranks carries the optimizer on (moments, the warmed-up lr) as HSDP would have
    got, want = elsewhere["fsdp"]["losses"], saved["losses"][5:7]
    assert got == pytest.approx(want, rel=1e-6), (got, want)


def test_hsdp_weight_sync_and_export_are_exact_on_the_planned_path(runs):
    r = runs["sync"]
    assert r["first"]["planned"] == r["hf_tensors"] and r["first"]["bridge"] == 0, r["first"]
    assert r["planned_vs_bridge"] == r["planned_vs_folder"] == 0.0
    assert r["trained_planned_vs_bridge"] == r["trained_planned_vs_export"] == 0.0 and r["changed_by_step"] > 0
    assert r["sabotaged_vs_bridge"] == 0.0


def test_a_held_hsdp_step_is_the_released_one_bit_for_bit(runs):
    released, kept = runs["released"], runs["kept"]
    assert kept["losses"] == released["losses"] and kept["grad_norms"] == released["grad_norms"]
    assert kept["weight_bits"] == released["weight_bits"]
    assert all(0 < g <= kept["buckets"] for g in kept["gathers_per_step"][1:]), kept   # each bucket once a step
    assert all(g >= 3 * k for g, k in zip(released["gathers_per_step"], kept["gathers_per_step"])), (released, kept)


@pytest.mark.parametrize("fields, named, made", [
    (dict(use_megatron_fsdp=True, override_ddp_config={**HSDP, "outer_dp_sharding_strategy": "optim"}),
     "outer_dp_sharding_strategy='optim'", True),
    (dict(use_megatron_fsdp=True, expert_model_parallel_size=2, override_ddp_config=HSDP), "MoE experts", True),
    (dict(use_megatron_fsdp=True, override_ddp_config={"num_distributed_optimizer_instances": 3}),
     "a divisor of the 4 data x context", False),   # needs the world size
    (dict(use_megatron_fsdp=False, override_ddp_config=HSDP), "DDP without a GPU", False),   # needs the machine
])
def test_what_megatron_gets_wrong_is_refused_by_name(fields, named, made):
    """`made`: refused by EngineConfig(...) (the fields alone); else by validate(world_size=4, on_gpu=False)."""
    with pytest.raises(ConfigError, match="allowed") as e:
        cfg = EngineConfig(**fields)
        assert not made, "made without a ConfigError"
        cfg.validate(world_size=4, on_gpu=False)
    assert named in str(e.value)
    EngineConfig(use_megatron_fsdp=True, override_ddp_config=HSDP).validate(world_size=4, on_gpu=False)


def test_an_hf_moe_model_under_hsdp_is_refused_at_wrap():
    from megatron.core.transformer import TransformerConfig

    from mfsdp_kit.config import hsdp
    moe = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4)
    dense = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    cfg = EngineConfig(use_megatron_fsdp=True, override_ddp_config=HSDP)
    with pytest.raises(ConfigError, match="data_parallel_replicate_size=2 .* MoE experts"):
        hsdp.check_model(cfg, moe)
    hsdp.check_model(cfg, dense)
    hsdp.check_model(EngineConfig(use_megatron_fsdp=True), moe)
