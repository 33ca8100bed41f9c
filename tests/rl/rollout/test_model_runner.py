"""rl.rollout.model_runner: the bucket set covers every step the scheduler can ask for, a kept cache serves later calls
with the steps it has, and on a GPU every graph is captured when the cache is made: a second call captures nothing,
and its tokens equal a fresh engine's; the cache is sized beside a measured transient peak that covers a call. A
shared prefill (a prompt's samples prefilled once, `DecodeConfig.share_prefill`) samples what a prefill per row samples
(tokens, log-probs to fp32 rounding, MoE routes), running each distinct prompt once, in GRPO's, mixed and partial
rollouts' calls (fp32 on CPU)."""
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


TEXTS = ["ab", "hello there", "x y z w"]
"""Three prompts of 1, 2 and 4 tokens under the tiny models' tokenizers (each word is one unknown token): distinct."""


def tiny(arch, tmp_path):
    folder = write_tiny(arch, tmp_path / arch)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def both(model, tok, call, **config):
    """`call(rollout)` with `share_prefill` on and off: {True: (its result, the call's stats), False: ...}."""
    out = {}
    for share in (True, False):
        rollout = ContinuousRollout(model, tok, config=DecodeConfig(share_prefill=share, **config))
        out[share] = (call(rollout), rollout.stats)
    return out


def same_logprobs(a, b, *, atol: float = 1e-6) -> bool:
    """Equal to fp32 rounding: a prefill of fewer rows rounds its GEMMs otherwise (1 ulp of a log-prob on CPU)."""
    return len(a) == len(b) and all(torch.allclose(torch.tensor(x), torch.tensor(y), rtol=0, atol=atol)
                                    for x, y in zip(a, b))


def compare_shared(arch: str, tmp_path, *, device: str, atol: float) -> None:
    """GRPO's n samples of a prompt prefilled once (`share_prefill`, the default) against a prefill per row, 12 rows
    on 8 cache rows (the queue splits the last prompt's samples over later admissions), T 1 and top-p 0.9, one seed:
    the same tokens, log-probs within `atol`, the same MoE routes (copied with the KV); the prefills ran each prompt
    once per admission, against once per row."""
    model, tok = tiny(arch, tmp_path)
    model, moe = model.to(device), "Moe" in arch
    runs = both(model, tok, lambda r: r.sample(TEXTS, n=4, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3,
                                               routes=moe), max_batch_size=8, check_every=3, slot_bucket=8)
    (on, on_stats), (off, off_stats) = runs[True], runs[False]
    assert list(on) == list(off) and same_logprobs(on.logprobs, off.logprobs, atol=atol)
    if moe:
        assert len(on.routes) == 12 and all(torch.equal(a, b) for a, b in zip(on.routes, off.routes))
    lengths = [len(ids) for ids in tok(TEXTS, add_special_tokens=False)["input_ids"]]
    assert off_stats["prefill_tokens"] == 4 * sum(lengths)
    assert sum(lengths) <= on_stats["prefill_tokens"] <= lengths[0] + lengths[1] + 4 * lengths[2]


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_shared_prefill_samples_what_a_prefill_per_row_samples(arch, tmp_path):
    """`compare_shared` in fp32 on CPU: log-probs within 1e-6 (a prefill of fewer rows rounds its GEMMs otherwise)."""
    compare_shared(arch, tmp_path, device="cpu", atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU")
@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM"])
def test_a_shared_prefill_samples_what_a_prefill_per_row_samples_on_a_gpu(arch, tmp_path):
    """`compare_shared` in fp32 on a GPU (the dense model's steps CUDA graphs of the Triton kernels): within 1e-5."""
    compare_shared(arch, tmp_path, device="cuda", atol=1e-5)


def test_a_shared_prefill_runs_each_prompt_once(tmp_path):
    """The issue's shape on a tiny model: 2 prompts of 1,024 tokens x 8 samples in one admission; the model's
    embedding sees 2,048 prompt tokens in prefills (16,384 with a prefill per row), as `stats["prefill_tokens"]` says,
    and the samples are the same."""
    model, tok = tiny("Qwen2ForCausalLM", tmp_path)
    ids = torch.randint(3, 200, (2, 1024), generator=torch.Generator().manual_seed(0)).tolist()
    seen = []   # tokens of each prefill ([k, L] ids; a decode step embeds [b])
    hook = model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: seen.append(args[0].numel()) if args[0].dim() == 2 else None)

    def call(rollout):
        seen.clear()
        out = rollout.generate([p for p in ids for _ in range(8)], max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0)
        return out, sum(seen)
    try:
        runs = both(model, tok, call, max_batch_size=16, check_every=2)
    finally:
        hook.remove()
    ((on, on_seen), on_stats), ((off, off_seen), off_stats) = runs[True], runs[False]
    assert on_seen == on_stats["prefill_tokens"] == 2048 and off_seen == off_stats["prefill_tokens"] == 8 * 2048
    assert on[0] == off[0] and same_logprobs(on[1], off[1])


def test_repeated_prompts_among_others_and_single_samples(tmp_path):
    """Prompts repeated apart from each other beside prompts alone, under a prefill budget (12 tokens) that a group of
    a prompt's copies passes (they cost one prompt): greedy and at T 1, the same tokens and log-probs on and off, each
    distinct prompt run once. n = 1 (nothing repeats) runs today's path: the same tokens, log-probs bit for bit and
    prefill tokens."""
    model, tok = tiny("LlamaForCausalLM", tmp_path)
    a, b, c = ROWS[0], ROWS[1], ROWS[2]
    rows = [a, b, a, c, c, a, ROWS[3]]
    for temperature in (0, 1.0):
        runs = both(model, tok, lambda r: r.generate(rows, max_new_tokens=12, temperature=temperature, top_p=1.0,
                                                     seed=1), max_batch_size=8, check_every=3, slot_bucket=8,
                    prefill_tokens=12)
        (on, on_stats), (off, off_stats) = runs[True], runs[False]
        assert on[0] == off[0] and same_logprobs(on[1], off[1]), temperature
        assert on_stats["prefill_tokens"] == len(a) + len(b) + len(c) + 1
        assert off_stats["prefill_tokens"] == sum(map(len, rows))
    single = both(model, tok, lambda r: r.sample(TEXTS, n=1, max_new_tokens=10, temperature=1.0,
                                                 top_p=0.9, seed=3), max_batch_size=4, check_every=3, slot_bucket=8)
    (on, on_stats), (off, off_stats) = single[True], single[False]
    assert list(on) == list(off) and on.logprobs == off.logprobs
    assert on_stats["prefill_tokens"] == off_stats["prefill_tokens"]


def test_partial_rollouts_are_unchanged_by_a_shared_prefill(tmp_path):
    """`generate_turns` as `rl.partial` calls it: 3 prompts x 3 samples on 4 cache rows, a budget per row, a group per
    prompt, the call ended once one group is complete; then the unfinished rows continued (prompt + tokens so far:
    distinct rows). On and off: the same tokens, log-probs, masks and ended rows in both calls."""
    model, tok = tiny("Qwen2ForCausalLM", tmp_path)
    rows = [p for p in ROWS[:3] for _ in range(3)]
    budgets, groups = [2] * 3 + [16] * 6, [i // 3 for i in range(9)]

    def call(rollout):
        first = rollout.generate_turns(rows, max_new_tokens=budgets, temperature=1.0, top_p=1.0, seed=4, groups=groups,
                                       enough_groups=1)
        todo = [i for i, e in enumerate(rollout.ended) if not e]
        more = rollout.generate_turns([rows[i] + first[0][i] for i in todo], temperature=1.0, top_p=1.0, seed=5,
                                      max_new_tokens=[budgets[i] - len(first[0][i]) for i in todo])
        return first, more, todo
    runs = both(model, tok, call, max_batch_size=4, check_every=3, slot_bucket=8)
    (on, _), (off, _) = runs[True], runs[False]
    assert on[2] == off[2] and len(on[2]) >= 3   # the same rows left unfinished
    for mine, theirs in zip(on[:2], off[:2]):
        assert mine[0] == theirs[0] and mine[2] == theirs[2] and same_logprobs(mine[1], theirs[1])
