"""SFT on the embedded task: it learns, FSDP == DDP per step, micro-batching is exact, memory."""
import pytest
import torch

from mfsdp_kit.train import data, generate
from mfsdp_kit import train
from mfsdp_kit.config import ConfigError
from mfsdp_kit.train.parity import compare_curves
from mfsdp_kit.rl import core, dapo, grpo
from tests.dist import launch


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="module")
def parity_runs(workdir):
    """The parity tests' four runs in one 2-rank job (each run inits, seeds and shuts down its own layout):
    SFT under DDP and FSDP (4 micro-batches each), then one step's gradients as 1x8 and 4x2 micro-batches."""
    kw = dict(workdir=workdir, steps=20, global_batch=16, micro_batch_size=2, evaluate=False)
    calls = [["scenarios_train:sft", dict(fsdp=False, **kw)], ["scenarios_train:sft", dict(fsdp=True, **kw)],
             ["scenarios_train:first_step_grads", dict(micro_batch_size=8, workdir=workdir)],
             ["scenarios_train:first_step_grads", dict(micro_batch_size=2, workdir=workdir)]]
    return launch.run("sequence", calls=calls)


@pytest.fixture(scope="module")
def runs(workdir):
    """The other checks' runs in one 2-rank job: SFT that learns, then a NaN loss under DDP and FSDP."""
    calls = [["scenarios_train:sft", dict(fsdp=True, workdir=workdir, steps=150, global_batch=32,
                                          micro_batch_size=16)]]
    calls += [["scenarios_train:nonfinite_stops", dict(fsdp=fsdp, workdir=workdir, bad_step=2)] for fsdp in (False, True)]
    calls += [["scenarios_train:start_step_pipelined", dict(fsdp=fsdp, workdir=workdir)] for fsdp in (False, True)]
    return dict(zip(["sft", False, True, "piped_ddp", "piped_fsdp"], launch.run("sequence", calls=calls)))


@pytest.mark.parametrize("name", ["piped_ddp", "piped_fsdp"])
def test_start_step_pipelined_equals_step(runs, name):
    """Steps started before the last one is read (grads clipped at 0.05) give `step`'s losses and grad norms,
    bit for bit. That start_step waits for nothing is a GPU question: test_start_step_syncs_nothing_on_a_gpu."""
    r = runs[name]
    assert len(r["piped"]) == 3 and r["piped"] == r["alone"], r
    assert all(norm > 0.05 for _, norm in r["alone"]), r   # the clip scaled the grads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA sync exists only on a GPU")
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_start_step_syncs_nothing_on_a_gpu(fsdp):
    """On a GPU in bf16, train.start_step (after 2 warm-up steps) makes no host-blocking CUDA call: no stream,
    device or event synchronize, no blocking memcpy. One rank, NCCL, the kit's GPT with SDPA and fused Adam."""
    from torch.profiler import ProfilerActivity, profile
    from mfsdp_kit.distributed import engine, runtime
    from mfsdp_kit.config import EngineConfig, OptimConfig
    from mfsdp_kit.train.data import random_token_batches
    from mfsdp_kit.models import GPTSpec, gpt_model_fn
    from mfsdp_kit.train import start_step
    from tests.dist.launch import free_port
    cfg = EngineConfig(use_megatron_fsdp=fsdp, dtype="bf16", attention_backend="sdpa")
    runtime.init(cfg, rank=0, world_size=1, master_port=free_port())
    try:
        spec = GPTSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_len_tokens=128)
        chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
        opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4, clip_grad=1.0), cfg)
        data = random_token_batches(steps=3, global_batch=4, seq_len_tokens=128, vocab_size=spec.vocab_size, seed=0)
        for i in range(2):
            start_step(chunks, opt, data[i], micro_batch_size=2, step_index=i).result()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pending = start_step(chunks, opt, data[2], micro_batch_size=2, step_index=2)
        blocking = [e.name for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                "cudaEventSynchronize", "cudaMemcpy")]
        assert blocking == [], blocking
        assert pending.result().loss > 0
    finally:
        runtime.shutdown()


def test_sft_learns_the_task(runs):
    r = runs["sft"]
    print(f"train loss {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f}; held-out exact match "
          f"{r['accuracy_before']:.2f} -> {r['accuracy_after']:.2f}; samples {r['samples']}")
    assert r["loss"][-1] <= 0.5 * r["loss"][0]
    assert r["accuracy_after"] > r["accuracy_before"]
    assert r["lr"][0] < r["lr"][10] == pytest.approx(3e-3)  # warm-up, then the peak


@pytest.mark.parity
def test_fsdp_and_ddp_histories_match(parity_runs):
    ddp, fsdp = parity_runs[:2]  # global batch 16, micro-batches of 2: 4 per rank
    assert len(ddp["loss"]) == 20
    # the 10 warm-up steps differ only by reduction order; later ones statistically (mfsdp_kit.train.parity)
    report = compare_curves(ddp["loss"], fsdp["loss"], exact_steps=10, late_window=10,
                            reference_grad_norm=ddp["grad_norm"], candidate_grad_norm=fsdp["grad_norm"])
    print("FSDP vs DDP:", report)
    report.check()
    # memory: FSDP holds about half the weights and grads of DDP on each of 2 ranks
    d, f = ddp["memory"], fsdp["memory"]
    print("DDP", d, "\nFSDP", f)
    assert 4 * d["num_params"] <= d["params_bytes"] <= 1.01 * 4 * d["num_params"]  # + bucket padding
    assert 0.45 < f["params_bytes"] / d["params_bytes"] < 0.6
    assert 0.45 < f["grads_bytes"] / d["grads_bytes"] < 0.6


@pytest.mark.parity
def test_micro_batching_is_exact(parity_runs):
    one, four = parity_runs[2:]
    assert one["tokens"] == four["tokens"] > 0
    assert abs(one["loss"] - four["loss"]) <= 1e-6 * one["loss"]
    worst = max(abs(a - b) for a, b in zip(one["grads"], four["grads"]))
    scale = max(abs(a) for a in one["grads"])
    print("1x8 vs 4x2 micro-batches: max |grad diff|", worst, "of max |grad|", scale)
    assert worst <= 1e-5 * scale


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_nonfinite_loss_stops_with_the_step_number(runs, fsdp):
    r = runs[fsdp]
    print(r)
    assert r["completed"] == 2 and r["error"] and r["error"].startswith("step 2:")


# ---- arguments checked at the call (issue 36 case 5): before any work, so no model is needed here ----------------
BAD_COUNTS = [0, -1, -2, -4, "2", 2.0, None, True]
"""0 raised ZeroDivisionError, -1/-2/-4 a bare StopIteration, "2"/2.0/None a TypeError; True trained."""
CALLS = {   # name -> (call with the bad value for `argument`, argument)
    "step": (lambda v: train.step([], None, None, micro_batch_size=v), "micro_batch_size"),
    "start_step": (lambda v: train.start_step([], None, None, micro_batch_size=v), "micro_batch_size"),
    "forward_backward": (lambda v: train.forward_backward([], None, micro_batch_size=v), "micro_batch_size"),
    "fit.steps": (lambda v: train.fit([], None, iter([]), steps=v, micro_batch_size=2), "steps"),
    "fit.micro_batch_size": (lambda v: train.fit([], None, iter([]), steps=2, micro_batch_size=v), "micro_batch_size"),
    "batches": (lambda v: data.batches([], None, seq_len_tokens=8, global_batch=v), "global_batch"),
    "random_token_batches": (lambda v: data.random_token_batches(steps=v, global_batch=2, seq_len_tokens=8,
                                                                 vocab_size=5), "steps"),
    "greedy": (lambda v: generate.greedy([], [[1]], max_new_tokens=v, stop_ids=0), "max_new_tokens"),
    "rl.update": (lambda v: core.update(chunks=[], optimizer=None, batch=None, loss_fn=None, epochs=v,
                                        num_minibatches=1, micro_batch_size=1), "epochs"),
    "grpo.fit": (lambda v: grpo.fit(chunks=[], optimizer=None, bridge=None, rollout=None, prompt_pool=[],
                                    reward_fn=None, gcfg=None, iterations=v), "iterations"),
    "GRPOConfig": (lambda v: grpo.GRPOConfig(micro_batch_size=v), "micro_batch_size"),
    "DAPOConfig": (lambda v: dapo.DAPOConfig(samples_per_prompt=v), "samples_per_prompt"),
}


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
@pytest.mark.parametrize("name", CALLS)
def test_count_arguments_are_checked_at_the_call(name, value):
    call, argument = CALLS[name]
    with pytest.raises(ConfigError, match=rf"^{argument}={value!r} is not allowed; allowed: an integer"):
        call(value)
