"""rl.rollout.model_runner: the bucket set covers every step the scheduler can ask for, a kept cache serves later calls
with the steps it has, and on a GPU every graph is captured when the cache is made: a second call captures nothing,
and its tokens equal a fresh engine's; the cache is sized beside a measured transient peak that covers a call."""
import random
import threading
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig
from mfsdp_kit.rl.rollout.kernels import attention
from mfsdp_kit.rl.rollout.kernels.attention import triton
from mfsdp_kit.models.support import triton_available
from mfsdp_kit.perf.compile_time import kit_kernel
from mfsdp_kit.rl.rollout.model_runner import buckets, glue_mode
from mfsdp_kit.rl.rollout.scheduler import batch_bucket, bucketed
from mfsdp_kit.rl.rollout.scheduler import Scheduler

ROWS = [[5, 17, 42, 9, 77, 3, 120], [8, 8, 200], [31, 64, 11, 150, 151], [7], [90, 91, 92, 93, 94, 95, 96, 97, 98]]


@pytest.mark.parametrize("per_doubling", [1, 2])
def test_buckets_cover_every_batch_and_slot_bucket_once(per_doubling):
    for rows, slots, bucket, least in [(1, 8, 8, 2), (5, 24, 8, 2), (8, 64, 16, 2), (512, 576, 64, 2),
                                       (300, 1088, 64, 2), (512, 576, 64, 16), (12, 32, 16, 16)]:
        got = buckets(rows=rows, slots=slots, slot_bucket=bucket, min_batch=least, per_doubling=per_doubling)
        assert len(got) == len(set(got))
        want = {(batch_bucket(n, rows=rows, least=least, per_doubling=per_doubling), s) for n in range(1, rows + 1)
                for s in range(bucket, slots + 1, bucket)}
        assert set(got) == want, (rows, slots)
        assert got[0] == (batch_bucket(rows, rows=rows, per_doubling=per_doubling), slots)   # the largest first
        assert min(b for b, _ in got) == min(rows, max(2, least))
    graphs = {1: 6, 2: 11}[per_doubling]   # 16..512 rows: the powers of two, or with 24, 48, ..., 384 between
    assert len(buckets(rows=512, slots=576, slot_bucket=64, min_batch=16, per_doubling=per_doubling)) == graphs * 9


def test_a_bucket_holds_its_rows_and_idles_at_most_half_or_a_third():
    for per_doubling, idle in ((1, 1 / 2), (2, 1 / 3)):
        for n in range(16, 513):
            b = batch_bucket(n, rows=512, least=16, per_doubling=per_doubling)
            assert n <= b and (b - n) / b < idle, (per_doubling, n, b)


@pytest.mark.parametrize("kernels,graph_mode,compile_glue,want_gpu", [
    ("auto", "capture", True, "triton"), ("auto", "reduce-overhead", True, "compiled"),
    ("torch", "capture", True, "compiled"), ("torch", "capture", False, "eager"),
    ("triton", "capture", True, "triton")])
def test_glue_mode_takes_the_triton_kernels_by_default_where_they_run(kernels, graph_mode, compile_glue, want_gpu):
    """"auto" is the Triton kernels on a GPU that runs them (else the compiled torch glue), never with
    reduce-overhead graphs (inductor compiles that step from torch ops); off a GPU every mode is eager."""
    cfg = DecodeConfig(kernels=kernels, graph_mode=graph_mode, compile_glue=compile_glue)
    gpu = torch.device("cuda")
    fallback = "compiled" if compile_glue else "eager"
    assert glue_mode(cfg, gpu) == (want_gpu if triton_available(gpu) or want_gpu != "triton" else fallback)
    assert glue_mode(cfg, torch.device("cpu")) == "eager"


def test_every_chunk_the_scheduler_plans_is_a_bucket():
    """The scheduler's chunks over random calls (no model: each step samples token 1, a stop id on a random
    schedule) ask only for (batch, slots) pairs in `buckets`, so the steps made up front are all a call needs."""
    gen = random.Random(0)
    for _ in range(30):
        rows, bucket, least = gen.choice([2, 3, 4, 7, 8, 20, 40]), gen.choice([4, 8]), gen.choice([2, 4, 16])
        per_doubling = gen.choice([1, 2])
        prompts = [[3] * gen.randint(1, 9) for _ in range(gen.randint(1, 50))]
        new = gen.randint(1, 30)
        slots = bucketed(max(map(len, prompts)) + new + 4, bucket)
        allowed = set(buckets(rows=rows, slots=slots, slot_bucket=bucket, min_batch=least, per_doubling=per_doubling))
        s = Scheduler(prompts, rows=rows, slots=slots, max_new_tokens=new, stops={1}, check_every=4,
                      slot_bucket=bucket, prefill_tokens=64, min_batch=least, buckets_per_doubling=per_doubling,
                      tools=None, tokenizer=None, stats={})
        while s.busy():
            for group in s.admit():
                s.record(group, torch.full((len(group), 1), 2), torch.zeros(len(group), 1))
            s.compact()
            chunk = s.next_chunk()
            if chunk is None:
                continue
            assert {(chunk.batch, k) for k in chunk.slots} <= allowed, (chunk, rows, slots)
            stop = torch.tensor([[1 if gen.random() < 0.2 else 2 for _ in chunk.slots] for _ in range(chunk.batch)])
            s.decoded(chunk, stop, torch.zeros(stop.shape))


@contextmanager
def _kit_compile_threads():
    """The names of the threads on which Triton compiled or loaded a kit kernel inside the block."""
    names = []
    compilation = triton.knobs.compilation if attention.triton is not None else None
    before = compilation.listener if compilation is not None else None

    def listener(*, src, **_):
        if kit_kernel(src):
            names.append(threading.current_thread().name)
    if compilation is not None:
        compilation.listener = listener
    try:
        yield names
    finally:
        if compilation is not None:
            compilation.listener = before


def load(tmp_path, device="cpu", dtype=torch.float32):
    folder = write_tiny("Qwen2ForCausalLM", tmp_path / "qwen2")
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device), AutoTokenizer.from_pretrained(folder))


def test_a_kept_cache_keeps_its_steps_and_a_new_shape_makes_a_new_cache(tmp_path):
    model, tok = load(tmp_path)
    rollout = ContinuousRollout(model, tok, config=DecodeConfig(max_batch_size=4, check_every=3, slot_bucket=8))
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, seed=0)
    rollout.generate(ROWS, **kw)
    cache, steps = rollout.runner.cache, dict(rollout.runner.cache.steps)
    assert cache.shape == (4, 24) and steps   # CPU: steps made as they are first asked for, eagerly
    rollout.generate(ROWS[:2], **kw)
    assert rollout.runner.cache is cache and all(cache.steps[k] is f for k, f in steps.items())
    rollout.generate(ROWS, max_new_tokens=40, temperature=1.0, top_p=1.0, seed=0)   # more slots: a new cache
    assert rollout.runner.cache is not cache and rollout.runner.cache.shape[1] >= 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: a GPU")
@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    attention.triton is None, reason="Triton"))])
def test_every_graph_is_captured_when_the_cache_is_made_on_a_gpu(kernels, tmp_path):
    """Every step a call can ask for is captured with the cache (with the Triton kernels, one per batch bucket, their
    kernels compiled ahead on the compile threads, none in a capture's warm-up), a second call captures nothing, and its
    tokens equal the first's and a fresh engine's."""
    model, tok = load(tmp_path, "cuda", torch.bfloat16)
    cfg = DecodeConfig(max_batch_size=16, check_every=4, slot_bucket=16, min_batch=2, kernels=kernels)
    rollout = ContinuousRollout(model, tok, config=cfg)
    kw = dict(max_new_tokens=40, temperature=1.0, top_p=1.0)
    with _kit_compile_threads() as threads:
        first = rollout.generate(ROWS * 3, seed=1, **kw)
    assert all(name.startswith("mfsdp-triton") for name in threads), threads
    assert (rollout.stats["kernels_s"] > 0) == (kernels == "triton")
    cache = rollout.runner.cache
    made = {(b, rollout.runner.step_slots(s))
            for b, s in buckets(rows=cache.shape[0], slots=cache.shape[1], slot_bucket=16, min_batch=cfg.min_batch,
                                per_doubling=cfg.buckets_per_doubling)}
    assert set(cache.steps) == made and len(made) > 1
    if kernels == "triton":   # one step per batch bucket, over all the cache's slots
        assert {s for _, s in made} == {cache.shape[1]} and len(made) == len({b for b, _ in made})
    assert rollout.stats["capture_s"] > 0 and rollout.stats["graphs"] == len(cache.steps)
    again = rollout.generate(ROWS * 3, seed=1, **kw)
    assert rollout.stats["capture_s"] == 0 and rollout.stats["graphs"] == 0 and again == first
    fresh = ContinuousRollout(model, tok, config=cfg).generate(ROWS * 3, seed=1, **kw)
    assert fresh == first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the transient peak is measured on a GPU")
def test_the_measured_peak_covers_a_calls_memory_beside_its_cache_on_a_gpu(tmp_path):
    """The cache is sized beside a measured transient peak (a probe prefill of max(prefill_tokens, longest prompt)
    tokens, top-p sampling at the call's rows, a compaction's copies): a later call's own peak above the kept cache
    stays under it, for prefill groups at the budget and for a prompt longer than the budget (prefilled alone); a
    share of free memory smaller than that peak is refused by name before a cache is made."""
    from mfsdp_kit.config import ConfigError
    model, tok = load(tmp_path, "cuda", torch.bfloat16)
    cfg = DecodeConfig(max_batch_size=16, check_every=4, slot_bucket=16, prefill_tokens=256)
    rollout = ContinuousRollout(model, tok, config=cfg)
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.9)
    budget = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(16)]   # groups of 6 x 40 tokens
    beyond = [[(3 * i + j) % 200 + 3 for j in range(300 if i < 2 else 9)] for i in range(16)]   # 300 > 256, alone
    measured = []
    for prompts in (budget, beyond):
        rollout.generate(prompts, seed=0, **kw)
        transient, probes = rollout.stats["transient_bytes"], dict(rollout.runner.probes)
        measured.append(transient)
        assert transient > 0 and rollout.stats["rows"] == 16
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()   # the model, the kept cache and its graphs' outputs
        torch.cuda.reset_peak_memory_stats()
        rollout.generate(prompts[::-1], seed=1, **kw)
        assert rollout.stats["graphs"] == 0 and rollout.runner.probes == probes   # the kept cache: no new probe
        assert torch.cuda.max_memory_allocated() - before <= transient
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    small = ContinuousRollout(model, tok, config=replace(cfg, cache_memory_fraction=measured[0] / 2 / free))
    with pytest.raises(ConfigError, match=r"cache_memory_fraction.*measured peak"):
        small.generate(budget, seed=0, **kw)
    assert small.runner.cache is None
