"""keep_gathered: Megatron-FSDP steps that gather each unit once per step instead of twice per micro-batch.

Every run trains the same GPT on 2 gloo ranks with 2 micro-batches per rank; the held step must give megatron's
losses, grad norms and main weights bit for bit, issue fewer all-gathers, and hold nothing between steps."""
import pytest
import torch

from mfsdp_kit.config import ConfigError, EngineConfig
from tests.dist import launch

CASES = {
    "bf16": dict(dtype="bf16"),
    "fp32": dict(dtype="fp32"),
    "bf16-full-recompute": dict(dtype="bf16", recompute="full"),   # backward re-runs forward over held weights
    "moe-ep2": dict(dtype="fp32", ep=2),   # expert buffers on a 1-rank FSDP group (not sharded) beside sharded ones
}


@pytest.fixture(scope="module")
def runs():
    calls = [["scenarios_keep_gathered:train", dict(keep=keep, **case)] for case in CASES.values()
             for keep in (False, True)]
    calls += [["scenarios_keep_gathered:generate", dict(keep=keep)] for keep in (False, True)]
    results = launch.run("sequence", nproc=2, calls=calls)
    return {**{name: tuple(results[2 * i:2 * i + 2]) for i, name in enumerate(CASES)}, "greedy": tuple(results[-2:])}


def test_greedy_decoding_gathers_each_unit_once_per_call_with_the_same_tokens(runs):
    default, kept = runs["greedy"]
    assert kept["completions"] == default["completions"] and all(len(c) == 6 for _, c in kept["completions"])
    assert 0 < kept["gathers"] <= kept["buckets"] < default["gathers"] / 5, (default, kept)   # megatron: per token
    assert kept["gathered_after"] == 0, kept


@pytest.mark.parametrize("case", list(CASES))
def test_a_held_step_is_megatrons_step_bit_for_bit(runs, case):
    default, kept = runs[case]
    assert kept["losses"] == default["losses"], (default["losses"], kept["losses"])
    assert kept["grad_norms"] == default["grad_norms"]
    assert kept["weight_bits"] == default["weight_bits"]
    assert default["losses"][-1] < default["losses"][0]   # it trains


@pytest.mark.parametrize("case", list(CASES))
def test_a_held_step_gathers_each_bucket_once_and_holds_nothing_after_it(runs, case):
    default, kept = runs[case]
    # after the first step (which also gathers what the first forward finds prefetched), each bucket once a step
    # (megatron: 19 a step here, 4 layers x 2 micro-batches x forward and backward, + the embedding and head)
    assert all(0 < g <= kept["buckets"] for g in kept["gathers_per_step"][1:]), kept
    assert all(g >= 3 * k for g, k in zip(default["gathers_per_step"], kept["gathers_per_step"])), (default, kept)
    assert kept["gathered_after_step"] == default["gathered_after_step"]   # between steps: ZeRO-3's memory
    assert kept["most_gathered"] > default["most_gathered"]                # during one: the whole model


@pytest.mark.parametrize("fields, named", [
    (dict(use_megatron_fsdp=False), "use_megatron_fsdp=False"),
    (dict(use_megatron_fsdp=True, override_ddp_config=dict(data_parallel_sharding_strategy="optim_grads")),
     "'optim_grads'"),
    (dict(use_megatron_fsdp=True, override_ddp_config=dict(fsdp_double_buffer=True)), "fsdp_double_buffer"),
    (dict(use_megatron_fsdp=True, override_ddp_config=dict(nccl_ub=True)), "nccl_ub"),
])
def test_keep_gathered_is_refused_where_nothing_is_freed_or_no_bucket_slot_is_left(fields, named):
    with pytest.raises(ConfigError, match="fsdp_keep_gathered") as err:
        EngineConfig(fsdp_keep_gathered=True, **fields)   # refused when made: the fields alone say so
    assert named in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron's side-stream all-gathers and events run on a GPU")
def test_a_held_step_is_megatrons_step_on_a_gpu():
    """One GPU rank (NCCL): the gathers are asynchronous on megatron's side stream, so buckets may still be gathering
    when the hold ends. A one-rank group still gathers (a copy) and releases after each backward: 37 gathers a step
    with 4 micro-batches, against 5 held."""
    default, kept = launch.run("sequence", nproc=1, calls=[
        ["scenarios_keep_gathered:train", dict(keep=keep, dtype="bf16")] for keep in (False, True)])
    assert (kept["losses"], kept["grad_norms"]) == (default["losses"], default["grad_norms"])
    assert kept["weight_bits"] == default["weight_bits"]
    assert all(g >= 3 * k for g, k in zip(default["gathers_per_step"], kept["gathers_per_step"])), (default, kept)
    assert kept["gathered_after_step"] == default["gathered_after_step"]
