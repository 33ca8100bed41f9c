"""grad_upcast: Megatron-FSDP's fp32 grads made a part at a time inside the step, with megatron's bits.

Every run trains the same bf16 GPT on 2 gloo ranks; "whole" is megatron-core's own path (every fp32 grad copy
made when backward ends). by_part must give the same losses, grad norms and fp32 main weights bit for bit, and
hold at most one part of fp32 grads at any Adam call."""
import pytest
import torch

from mfsdp_kit.distributed import grad_upcast
from mfsdp_kit.config import ConfigError, OptimConfig
from tests.dist import launch

PART = 4096   # bytes: the scenarios' GPT has ~100 KiB of fp32 grads per rank, so this is many parts
CASES = {
    "clipped": dict(clip_grad=0.05),          # the clip factor < 1 at every step
    "unclipped": dict(clip_grad=0.0),         # no norm taken, no factor
    "fused-adam": dict(clip_grad=0.05, adam_implementation="fused"),
    "optimizer-offload": dict(clip_grad=0.05, optimizer_offload=True),
    "tensor-parallel-2": dict(clip_grad=0.05, tp=2),   # the norm leaves out TP-duplicated params (norm weights)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("moe"))
    calls = []
    for case in CASES.values():
        calls += [["scenarios_grad_upcast:train", dict(upcast="whole", **case)],
                  ["scenarios_grad_upcast:train", dict(upcast="by_part", part_bytes=PART, **case)]]
    calls += [["scenarios_grad_upcast:refused", dict(fsdp=False, dtype="bf16")],
              ["scenarios_grad_upcast:refused", dict(fsdp=True, dtype="fp32")],
              ["scenarios_grad_upcast:moe", dict(upcast="whole", workdir=work)],
              ["scenarios_grad_upcast:moe", dict(upcast="by_part", workdir=work)],
              ["scenarios_grad_upcast:resume", dict(root=f"{work}/ckpt")],
              ["release_frees", dict(release=True, dtype="bf16")]]
    results = launch.run("sequence", nproc=2, calls=calls)
    pairs = {name: tuple(results[2 * i:2 * i + 2]) for i, name in enumerate(CASES)}
    return pairs, results[-6:-4], results[-4:-2], results[-2], results[-1]


@pytest.mark.parametrize("case", list(CASES))
def test_by_part_is_megatrons_step_bit_for_bit(runs, case):
    whole, by_part = runs[0][case]
    assert by_part["installed"] and not whole["installed"]
    assert by_part["losses"] == whole["losses"], (whole["losses"], by_part["losses"])
    assert by_part["grad_norms"] == whole["grad_norms"]
    assert by_part["weight_bits"] == whole["weight_bits"]   # this rank's fp32 main weights, exactly
    assert whole["losses"][-1] < whole["losses"][0]        # it trains
    if CASES[case]["clip_grad"]:
        assert all(n > CASES[case]["clip_grad"] for n in whole["grad_norms"])   # so the clip did scale


@pytest.mark.parametrize("case", list(CASES))
def test_by_part_holds_one_part_of_fp32_grads(runs, case):
    whole, by_part = runs[0][case]
    total = whole["local_fp32_bytes"]
    assert whole["fp32_grad_bytes_after_backward"] == total and whole["max_fp32_grad_bytes"] == total
    assert by_part["fp32_grad_bytes_after_backward"] == 0
    assert 0 < by_part["max_fp32_grad_bytes"] <= max(PART, by_part["largest_param_bytes"]) < total
    assert by_part["adam_calls"] > 4 * whole["adam_calls"]   # several parts per step


def test_declines_where_megatron_makes_no_copy(runs):
    ddp_bf16, fsdp_fp32 = runs[1]
    assert ddp_bf16 and fsdp_fp32


def test_by_part_on_an_expert_parallel_moe(runs):
    """Qwen3-MoE (written by transformers) at expert-parallel size 2 on 2 ranks, bf16, clip active, the upcast
    chosen through OptimConfig (engine.build_optimizer installs it): megatron's bits."""
    whole, by_part = runs[2]
    assert by_part["installed"] and not whole["installed"]
    assert (by_part["losses"], by_part["grad_norms"]) == (whole["losses"], whole["grad_norms"])
    assert by_part["weight_bits"] == whole["weight_bits"]


def test_resume_with_the_by_part_step_is_exact(runs):
    """bf16 FSDP, clip active: a checkpoint loaded into a model built from another seed trains on with the
    straight run's losses, bit for bit (Adam's state is per param, so the parts change nothing in it)."""
    r = runs[3]
    assert r["installed"] and len(r["resumed"]) == 2 and r["resumed"] == r["straight"], r


def test_a_released_model_with_the_by_part_step_is_freed(runs):
    """The step wrapper refers to its optimizer (a cycle Python's gc collects): engine.release still frees a
    dropped bf16 FSDP model, as tests/distributed/test_engine_dist.py checks for fp32."""
    assert runs[4]["freed"], runs[4]


def test_parts_keep_order_and_bound():
    entries = [grad_upcast.Entry(buffer=None, name=str(i), param=None, nbytes=n)
               for i, n in enumerate([10, 20, 5, 40, 1, 1])]
    plan = grad_upcast.parts(entries, 30)
    assert [[e.name for e in p] for p in plan] == [["0", "1"], ["2"], ["3"], ["4", "5"]]
    assert [e for p in plan for e in p] == entries


def test_bad_grad_upcast_names_the_field():
    with pytest.raises(ConfigError, match="grad_upcast.*by_part \\| whole"):
        OptimConfig(grad_upcast="half")   # refused when made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels (fused Adam, the bf16 norm) run only on a GPU")
def test_by_part_is_megatrons_step_on_a_gpu():
    """The same comparison on one GPU rank (NCCL, CUDA's fused Adam and foreach norm), clip active; and fp16
    (a loss scaler) declined."""
    case = dict(clip_grad=0.05, adam_implementation="fused")
    whole, by_part, declined_fp16 = launch.run("sequence", nproc=1, calls=[
        ["scenarios_grad_upcast:train", dict(upcast="whole", **case)],
        ["scenarios_grad_upcast:train", dict(upcast="by_part", part_bytes=PART, **case)],
        ["scenarios_grad_upcast:refused", dict(fsdp=True, dtype="fp16")]])   # fp16's scaler needs a GPU
    assert declined_fp16   # megatron's loss scaler unscales and inf-tests every fp32 grad before the step
    assert by_part["installed"] and by_part["fp32_grad_bytes_after_backward"] == 0
    assert (by_part["losses"], by_part["grad_norms"]) == (whole["losses"], whole["grad_norms"])
    assert by_part["weight_bits"] == whole["weight_bits"]
