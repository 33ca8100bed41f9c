"""runtime: the rendezvous store listens on MASTER_ADDR only; re-init in one process works; bad launch
arguments are ConfigErrors."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from mfsdp_kit.config import EngineConfig
from tests.dist import launch
from tests.dist.launch import free_port

SCRIPT = """
import psutil, sys
from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
port = int(sys.argv[1])
runtime.init(EngineConfig(), rank=0, world_size=1, master_port=port)
listen = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
          if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
runtime.init(EngineConfig(seed=5))          # a new layout over the same world
runtime.shutdown(destroy_process_group=True)
print("LISTEN", listen)
"""


def test_store_binds_loopback_only_and_reinit_works():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE"))}
    port = free_port()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(port)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LISTEN ['127.0.0.1']" in out.stdout, out.stdout


@pytest.mark.parametrize("own_store", [True, False], ids=["kit-store", "torchrun-store"])
def test_three_init_shutdown_cycles_in_one_process(own_store):
    """init after shutdown(destroy_process_group=True) rendezvouses again on the same store address,
    under a fresh key prefix; each cycle all-reduces over the world and a megatron group."""
    r = launch.run("reinit_cycles", cycles=3, port=free_port() if own_store else None, timeout_s=120,
                   torchrun=not own_store)   # the agent store exists under torchrun only
    assert r["sums"] == [3.0 * 2] * 3 and r["dp_sizes"] == [2, 2, 2], r   # (1 + 2) all-reduced twice
    print("seconds per cycle", r["seconds"])   # a hang fails through launch's timeout_s, not a clock assert


BARRIER = """
import sys, warnings
import torch.distributed as dist
from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
runtime.barrier()                                     # no process group yet: nothing to wait for
runtime.init(EngineConfig(), rank=0, world_size=1, master_port=int(sys.argv[1]))
with warnings.catch_warnings(record=True) as kit:
    warnings.simplefilter("always")
    runtime.barrier()
with warnings.catch_warnings(record=True) as plain:
    warnings.simplefilter("always")
    dist.barrier()
print("BACKEND", dist.get_backend())
print("KIT", [str(w.message) for w in kit])
print("PLAIN", [str(w.message) for w in plain])
runtime.shutdown(destroy_process_group=True)
"""


def test_barrier_names_the_ranks_device_on_a_gpu_and_is_plain_elsewhere():
    """runtime.barrier (sync.save_hf, adapters.save_adapter, ... end with one) tells NCCL this rank's GPU, so torch
    neither guesses it from the current context nor warns in a notebook cell that it did (a plain dist.barrier
    does, on a GPU: the control); on gloo it is dist.barrier; before init it does nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE"))}
    out = subprocess.run([sys.executable, "-c", BARRIER, str(free_port())], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "KIT []" in out.stdout, out.stdout
    on_gpu = torch.cuda.is_available()
    assert f"BACKEND {'nccl' if on_gpu else 'gloo'}" in out.stdout
    if on_gpu:
        assert "barrier(): using the device under current context" in out.stdout, out.stdout


@pytest.mark.parametrize("kwargs,field", [
    (dict(backend="mpi"), "backend"), (dict(world_size=0), "world_size"), (dict(rank=2, world_size=2), "rank"),
    (dict(rank=True, world_size=2), "rank"), (dict(timeout_s=0), "timeout_s"), (dict(local_rank=-1), "local_rank")])
def test_bad_launch_arguments_are_config_errors_before_any_socket(kwargs, field):
    from mfsdp_kit.distributed import runtime
    from mfsdp_kit.config import ConfigError
    dist = torch.distributed
    before = dist.is_initialized() and dist.distributed_c10d._get_default_group()  # an earlier test's world
    with pytest.raises(ConfigError, match=rf"^{field}=") as e:
        runtime.init(EngineConfig(), **{"rank": 0, "world_size": 1, **kwargs})
    assert "allowed:" in str(e.value) and isinstance(e.value, ValueError)
    assert (dist.is_initialized() and dist.distributed_c10d._get_default_group()) == before  # nothing was built


def test_loopback_interface_is_found_and_loopback_addresses_are_recognised():
    from mfsdp_kit.distributed import runtime
    name = runtime.loopback_interface()
    assert name is not None and name in dict(socket.if_nameindex()).values()
    assert runtime.is_loopback("127.0.0.1") and runtime.is_loopback("localhost") and runtime.is_loopback("::1")
    assert not runtime.is_loopback("192.0.2.7")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inputs on another device than the model's need a GPU")
def test_public_calls_take_cpu_inputs_on_a_gpu(tmp_path):
    """Every public call that takes tokens or a Batch takes them on the CPU for a model on the GPU and moves them to
    the runtime's device itself (08_lora once failed in megatron's VocabParallelEmbedding on CPU tokens), with
    the same answer as inputs already on the GPU. One rank, NCCL, the tiny qwen2 under Megatron-FSDP, SDPA
    attention (packed and padded paths), then with LoRA: logits against peft on the CPU, as 08_lora checks."""
    check_cpu_inputs(tmp_path)


def check_cpu_inputs(tmp_path):
    """The body of the test above; on a CPU runtime it runs the same calls (both devices are then the CPU)."""
    import peft
    import transformers
    from mfsdp_kit.lora import adapters
    from mfsdp_kit.weights import sync
    from mfsdp_kit.train import generate
    from mfsdp_kit.distributed import engine, runtime
    from mfsdp_kit.config import OptimConfig
    from mfsdp_kit.train.data import random_token_batches
    from mfsdp_kit.lora import LoRAConfig
    from mfsdp_kit.models import hf
    from mfsdp_kit.models.tiny import tiny
    from mfsdp_kit.rl.core import token_logprobs
    from mfsdp_kit.train import step
    src = tiny(tmp_path / "tiny", arch="qwen2", size="xs")
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp32", attention_backend="sdpa")
    runtime.init(cfg, rank=0, world_size=1, master_port=free_port())
    try:
        device = runtime.current().device
        model = hf.load(src, cfg)
        batch = random_token_batches(steps=1, global_batch=4, seq_len_tokens=16, vocab_size=model.vocab_size,
                                     seed=0, masked_fraction=0.3)[0]
        tokens, lengths = batch.tokens, [16, 5, 9, 12]
        for kw in (dict(), dict(lengths=lengths), dict(lengths=lengths, last_only=True)):   # packed and padded rows
            got = generate.logits(model.chunks, tokens, vocab_size=model.vocab_size, **kw)
            want = generate.logits(model.chunks, tokens.to(device), vocab_size=model.vocab_size, **kw)
            assert got.device == tokens.device and want.device == device   # the answer comes back where asked
            assert (got - want.cpu()).abs().max().item() <= 1e-5, kw
        assert generate.greedy(model.chunks, [[1, 5, 6], [1, 7]], max_new_tokens=3, stop_ids=2)   # lists of ids
        for packed in (True, False):
            got = token_logprobs(model.chunks, batch, micro_batch_size=2, packed=packed)
            want = token_logprobs(model.chunks, batch.to(device), micro_batch_size=2, packed=packed)
            assert (got - want).abs().max().item() <= 1e-5 and got.abs().sum() > 0, packed
        opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
        for packed, on in ((True, "cpu"), (False, "cpu"), (True, device)):   # as data.batches makes it, or moved
            assert step(model.chunks, opt, batch.to(on), micro_batch_size=2, packed=packed).loss > 0
        rollout = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)   # on the CPU
        assert sync.load_into(rollout, model.chunks, model.bridge)["tensors"] > 0
        engine.release(model.chunks)
        del model, opt

        lora_cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp32", attention_backend="sdpa",
                                lora=LoRAConfig(rank=4, alpha=8))
        runtime.init(lora_cfg)
        model = hf.load(src, lora_cfg)
        opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-2), lora_cfg)
        step(model.chunks, opt, batch, micro_batch_size=2)   # B moves off its zero init: the adapters count
        want = generate.logits(model.chunks, tokens, vocab_size=model.vocab_size)   # 08_lora's call
        engine.settle_param_gathers(model.chunks)
        path = adapters.save_adapter(chunks=model.chunks, bridge=model.bridge, path=tmp_path / "adapter")
        base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        with torch.no_grad():
            got = peft.PeftModel.from_pretrained(base, str(path)).eval()(tokens).logits
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())
        engine.release(model.chunks)
    finally:
        runtime.shutdown()
