"""rl.rollout.engine: the engine computes the HF model's function (greedy tokens equal `generate`'s for every
architecture it allows, written by transformers itself) also while rows are refilled from the queue and moved to a
smaller batch, returns the log-probs the model gives its samples, and is reproducible. fp32 on CPU."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.config import ConfigError
from mfsdp_kit.train.generate import cut_at_stop
from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig, RolloutBackend
from mfsdp_kit.rl.rollout.scheduler import prefill_groups
from mfsdp_kit.rl.rollout.decoder import SUPPORTED, layer_windows
from mfsdp_kit.rl.rollout.hf import HFRollout, left_padded

ROWS = [[5, 17, 42, 9, 77, 3, 120], [8, 8, 200], [31, 64, 11, 150, 151], [7], [90, 91, 92, 93, 94, 95, 96, 97, 98],
        [12, 13]]   # six lengths: rows of a batch start at different slots
SMALL = DecodeConfig(max_batch_size=4, check_every=3, slot_bucket=8)
"""Four cache rows for six prompts (two wait in the queue), a host read every 3 steps, 8-slot buckets."""


def load(arch, tmp_path):
    folder = write_tiny(arch, tmp_path / arch)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def hf_greedy(model, tok, rows, new):
    enc = left_padded(rows, pad_id=tok.eos_token_id, device="cpu")
    out = model.generate(**enc, do_sample=False, max_new_tokens=new, pad_token_id=tok.eos_token_id)
    return [cut_at_stop(r, [tok.eos_token_id]) for r in out[:, enc["input_ids"].shape[1]:].tolist()]


@pytest.mark.parametrize("arch", SUPPORTED)
def test_greedy_tokens_equal_transformers_generate(arch, tmp_path):
    model, tok = load(arch, tmp_path)
    theirs = hf_greedy(model, tok, ROWS, 32)
    rollout = ContinuousRollout(model, tok, config=SMALL)
    assert isinstance(rollout, RolloutBackend)
    ours, _ = rollout.generate(ROWS, max_new_tokens=32, temperature=0, top_p=1.0, seed=0)
    assert ours == theirs, arch


def test_rows_stop_at_stop_ids_and_free_rows_are_refilled(tmp_path):
    """A stop id that greedy decoding meets early: rows end at different steps, the queue refills their rows, and
    the tokens still equal generate's row by row (the batch is compacted once the queue is empty)."""
    model, tok = load("LlamaForCausalLM", tmp_path)
    free = ContinuousRollout(model, tok, config=SMALL).generate(ROWS * 3, max_new_tokens=24, temperature=0,
                                                                 top_p=1.0, seed=0)[0]
    stop = max({t for row in free for t in row[2:6]}, key=lambda t: sum(t in r for r in free))
    tok.eos_token_id = stop
    model.generation_config.eos_token_id = stop
    ours, lps = ContinuousRollout(model, tok, config=SMALL).generate(ROWS * 3, max_new_tokens=24, temperature=0,
                                                                      top_p=1.0, seed=0)
    assert ours == hf_greedy(model, tok, ROWS * 3, 24)
    assert len({len(r) for r in ours}) > 2 and [len(r) for r in ours] == [len(lp) for lp in lps]


@pytest.mark.parametrize("backend", ["continuous", "hf"])
def test_logprobs_are_the_models_at_the_sampling_temperature(backend, tmp_path):
    """Each returned log-prob equals log softmax(logits / T) of the sampled token under a plain forward of prompt +
    completion (teacher forcing, as the trainer scores it): <= 1e-5 in fp32."""
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    rollout = (ContinuousRollout(model, tok, config=SMALL) if backend == "continuous" else HFRollout(model, tok))
    prompts = ["ab", "hello there", "x"]
    out = rollout.sample(prompts, n=2, max_new_tokens=10, temperature=0.8, top_p=0.9, seed=3)
    assert len(out) == 6 and len(out.logprobs) == 6
    for i, (completion, lps) in enumerate(zip(out, out.logprobs)):
        prompt = tok(prompts[i // 2], add_special_tokens=False)["input_ids"]
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert (torch.tensor(lps) - want).abs().max() <= 1e-5, (i, lps, want)


def test_same_seed_same_samples_kept_or_fresh(tmp_path):
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    rollout = ContinuousRollout(model, tok, config=DecodeConfig(max_batch_size=5, check_every=4, keep_cache=True))
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.95)
    a, b = rollout.generate(ROWS * 2, seed=1, **kw), rollout.generate(ROWS * 2, seed=1, **kw)   # b: a's kept cache
    assert rollout.runner.cache is not None and a == b and a != rollout.generate(ROWS * 2, seed=2, **kw)
    rollout.release()
    assert rollout.runner.cache is None and a == rollout.generate(ROWS * 2, seed=1, **kw)
    rollout.config.keep_cache = False
    assert a == rollout.generate(ROWS * 2, seed=1, **kw) and rollout.runner.cache is None   # freed after the call


def test_bad_config_is_refused_by_name():
    with pytest.raises(ConfigError, match="cache_memory_fraction"):
        DecodeConfig(cache_memory_fraction=1.5)
    with pytest.raises(ConfigError, match="check_every"):
        DecodeConfig(check_every=0)
    with pytest.raises(ConfigError, match="max_batch_size"):
        DecodeConfig(max_batch_size=0)
    with pytest.raises(ConfigError, match="graph_mode='graphs' .*'capture' \\| 'reduce-overhead'"):
        DecodeConfig(graph_mode="graphs")
    with pytest.raises(ConfigError, match="kernels='triton' .*graph_mode=\"capture\""):
        DecodeConfig(kernels="triton", graph_mode="reduce-overhead")
    with pytest.raises(ConfigError, match="min_batch=0"):
        DecodeConfig(min_batch=0)
    with pytest.raises(ConfigError, match="fuse_rope=True .*kernels=\"torch\""):
        DecodeConfig(fuse_rope=True, kernels="torch")
    with pytest.raises(ConfigError, match="sampler='triton' .*graph_mode=\"reduce-overhead\""):
        DecodeConfig(sampler="triton", graph_mode="reduce-overhead")


def test_default_backend_is_the_engine_where_it_runs(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mfsdp_kit.rl.rollout import default_backend
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    assert type(default_backend(model, tok)) is ContinuousRollout
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert type(default_backend(gpt2, tok)) is HFRollout


def test_stats_split_the_call_by_batch_bucket_and_a_kept_cache_serves_a_smaller_call(tmp_path):
    """`stats["by_batch"]`: decode steps and seconds per batch bucket (the tail of small batches shows), summing to
    the call's steps; a kept cache with enough rows and slots serves a smaller call without new graphs or cache."""
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    rollout = ContinuousRollout(model, tok, config=SMALL)
    rollout.generate(ROWS * 2, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=0)
    by_batch = rollout.stats["by_batch"]
    assert set(by_batch) <= {2, 4} and sum(v["steps"] for v in by_batch.values()) == rollout.stats["steps"]
    assert all(v["seconds"] > 0 for v in by_batch.values())
    rollout.generate(ROWS[:1], max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    assert rollout.stats["rows"] == 4   # the kept 4-row cache, not a new 2-row one


SHAPE_CALLS = [(rows, prompt, new) for rows in (1, 2, 3, 5, 8, 13, 21, 40) for prompt, new in
               ((3, 4), (9, 20), (30, 40), (70, 90), (5, 130))]
"""40 calls of distinct shapes: 8 row counts (batch buckets 1..64) x 5 prompt / new-token lengths (slot buckets)."""


def shape_run(folder, *, engines: int = 2) -> list[list[list[int]]]:
    """Every call of SHAPE_CALLS on `engines` engines of the model at `folder` (bf16 on the GPU), sampled at T 1."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda()
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = DecodeConfig(check_every=4, slot_bucket=16, kernels="torch")   # the compiled glue (Triton's has no frame)
    kits = [ContinuousRollout(model, tok, config=cfg) for _ in range(engines)]
    out = []
    for i, (rows, prompt, new) in enumerate(SHAPE_CALLS):
        ids = torch.randint(10, 200, (rows, prompt), generator=torch.Generator().manual_seed(i)).tolist()
        ids = [r[:max(1, prompt - j % 3)] for j, r in enumerate(ids)]
        out.append(kits[i % engines].generate(ids, max_new_tokens=new, temperature=1.0, top_p=1.0, seed=i)[0])
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode glue compiles on a GPU only")
def test_glue_compiles_once_for_forty_call_shapes_on_a_gpu(tmp_path):
    """One process, two engines, 40 call shapes (many batch and slot buckets): the glue never falls back to eager
    (the compiled glue of `kernels="torch"`, which raises under fullgraph if it would; the Triton kernels have none;
    dynamo's counters show no recompile-limit hit, and at most two graphs per glue function: a batch of 1 and a
    symbolic one), and the tokens equal a fresh process's."""
    import json
    import subprocess
    import sys

    from torch._dynamo.utils import counters
    folder = write_tiny("Qwen2ForCausalLM", tmp_path / "qwen2")
    counters.clear()
    ours = shape_run(folder)
    assert not [k for k in counters["unimplemented"] if "recompile" in str(k).lower()], dict(counters["unimplemented"])
    assert counters["frames"]["ok"] <= 3 * 3, dict(counters["frames"])   # rope_store, gated, add_rms: <= 3 each
    code = ("import json, sys; from tests.rl.rollout.test_engine import shape_run; "
            "print(json.dumps(shape_run(sys.argv[1])))")
    fresh = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    assert json.loads(fresh.stdout.strip().splitlines()[-1]) == ours


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the draw's kernel runs beside the GPU's Triton kernels")
def test_the_kernel_sampler_draws_the_models_tokens_on_a_gpu(tmp_path):
    """`DecodeConfig(sampler="triton")` (the draw in one kernel: `draw.draw`) against the torch sampler on the same
    engine: the same greedy tokens; sampled at T 0.8, other tokens (the kernel drew them), the same for the same seed,
    each log-prob the model's teacher-forced log softmax(logits / T) (fp32, <= 1e-4)."""
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    model = model.cuda()
    small = dict(max_batch_size=4, check_every=3, slot_bucket=8)
    kit, plain = (ContinuousRollout(model, tok, config=DecodeConfig(**small, sampler=s)) for s in ("triton", "torch"))
    greedy = dict(max_new_tokens=16, temperature=0, top_p=1.0, seed=0)
    assert kit.generate(ROWS, **greedy)[0] == plain.generate(ROWS, **greedy)[0]
    kw = dict(max_new_tokens=12, temperature=0.8, top_p=1.0, seed=3)
    ours, lps = kit.generate(ROWS, **kw)
    assert kit.runner.kernel_draws() and (ours, lps) == kit.generate(ROWS, **kw)
    assert plain.generate(ROWS, **kw)[0] != ours
    for prompt, completion, lp in zip(ROWS, ours, lps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion], device="cuda")).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, torch.tensor(completion, device="cuda")[:, None])
        assert (torch.tensor(lp) - want[:, 0].cpu()).abs().max() <= 1e-4, (lp, want)


def test_a_re_pointed_weight_is_used_by_the_next_call(tmp_path):
    """A q_proj weight replaced by a new Parameter after the engine fused q/k/v (what `load_state_dict(assign=True)`
    does) is regrouped at the next call: greedy tokens equal generate's with the new weights, not the old views'."""
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    rollout = ContinuousRollout(model, tok, config=SMALL)
    before, _ = rollout.generate(ROWS, max_new_tokens=16, temperature=0, top_p=1.0, seed=0)
    attn = model.model.layers[0].self_attn
    attn.q_proj.weight = torch.nn.Parameter(torch.randn_like(attn.q_proj.weight) * 0.5, requires_grad=False)
    after, _ = rollout.generate(ROWS, max_new_tokens=16, temperature=0, top_p=1.0, seed=0)
    assert after == hf_greedy(model, tok, ROWS, 16) and after != before


@pytest.mark.parametrize("arch,window", [("MistralForCausalLM", dict(sliding_window=6)),
                                         ("Qwen2ForCausalLM", dict(sliding_window=5, use_sliding_window=True,
                                                                   max_window_layers=1))])
def test_a_sliding_window_decodes_with_the_window(arch, window, tmp_path):
    """Prompt + new tokens far past the window (Mistral: every layer; Qwen2: the layers past max_window_layers):
    greedy tokens equal transformers' generate, and each sampled token's log-prob equals a teacher-forced HF forward
    of prompt + completion, which applies the window (<= 1e-5, fp32)."""
    folder = write_tiny(arch, tmp_path / arch, **window)
    model, tok = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)
    assert any(layer_windows(model)) and model.config.sliding_window < 10
    rollout = ContinuousRollout(model, tok, config=SMALL)
    assert rollout.generate(ROWS, max_new_tokens=20, temperature=0, top_p=1.0, seed=0)[0] == hf_greedy(model, tok, ROWS, 20)
    tokens, lps = rollout.generate(ROWS[:3], max_new_tokens=16, temperature=1.0, top_p=1.0, seed=2)
    for prompt, completion, lp in zip(ROWS[:3], tokens, lps):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert (torch.tensor(lp) - want).abs().max() <= 1e-5


def test_prefill_groups_stay_under_the_budget_shortest_first():
    """The scheduling policy alone (no model): every group's rows x longest prompt <= the budget, each prompt once,
    and a prompt over the budget prefilled alone."""
    lengths = [30, 3, 7, 7, 100, 2, 12, 12, 12]
    groups = prefill_groups(lengths, budget_tokens=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= 40 or len(g) == 1 for g in groups)
    assert [lengths[g[0]] for g in groups] == sorted(lengths[g[0]] for g in groups) and [4] in groups


def test_prefill_under_a_small_budget_gives_the_same_tokens(tmp_path):
    """Prompts prefilled one or two at a time (budget 10 tokens) decode the tokens of one prefill of all."""
    model, tok = load("LlamaForCausalLM", tmp_path)
    one = ContinuousRollout(model, tok, config=DecodeConfig(max_batch_size=6)).generate(
        ROWS, max_new_tokens=12, temperature=0, top_p=1.0, seed=0)[0]
    many = ContinuousRollout(model, tok, config=DecodeConfig(max_batch_size=6, prefill_tokens=10))
    assert many.generate(ROWS, max_new_tokens=12, temperature=0, top_p=1.0, seed=0)[0] == one


@pytest.mark.parametrize("config", [DecodeConfig(max_batch_size=4, check_every=1, slot_bucket=4, prefill_tokens=10),
                                    DecodeConfig(max_batch_size=8, check_every=5, slot_bucket=16)])
def test_queue_stops_and_compaction_keep_the_models_tokens(config, tmp_path):
    """The scheduler's paths under one seed (rows > cache rows wait in the queue, a frequent stop id ends rows at
    different steps, the batch is compacted, one-step chunks and tight slot buckets): greedy tokens equal generate's
    row by row, and at T 1 every sampled token's log-prob equals a teacher-forced forward, each completion ending at
    its first stop id or at max_new_tokens."""
    model, tok = load("LlamaForCausalLM", tmp_path)
    free = ContinuousRollout(model, tok, config=config).generate(ROWS, max_new_tokens=16, temperature=0, top_p=1.0,
                                                                 seed=0)[0]
    stop = max({t for row in free for t in row[1:8]}, key=lambda t: sum(t in r for r in free))
    tok.eos_token_id = model.generation_config.eos_token_id = stop
    rollout = ContinuousRollout(model, tok, config=config)
    assert rollout.generate(ROWS * 2, max_new_tokens=16, temperature=0, top_p=1.0, seed=0)[0] == \
        hf_greedy(model, tok, ROWS * 2, 16)
    assert len(rollout.stats["by_batch"]) > 1, rollout.stats["by_batch"]   # the batch was compacted to a smaller bucket
    tokens, lps = rollout.generate(ROWS * 2, max_new_tokens=16, temperature=1.0, top_p=1.0, seed=5)
    assert any(stop in c for c in tokens) and any(len(c) == 16 for c in tokens)
    for prompt, completion, lp in zip(ROWS * 2, tokens, lps):
        assert completion == cut_at_stop(completion, [stop]) and (len(completion) == 16 or completion[-1] == stop)
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        assert (torch.tensor(lp) - want).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_a_row_continued_after_a_break_equals_one_sampled_without(arch, tmp_path):
    """Partial rollouts (`rl.partial`): a call ended by `enough_groups` (row 0 has a budget of 2 tokens, every row is
    a group of its own, one group is enough) leaves the other rows part-way or queued (`ended` False); continuing
    them from prompt + their tokens (re-prefilled: the break's weights are the same) with what is left of their
    budgets gives, greedy, the tokens of a call without the break, and each token's log-prob to fp32 rounding."""
    model, tok = load(arch, tmp_path)
    budgets = [2] + [16] * (len(ROWS) - 1)
    greedy = dict(temperature=0, top_p=1.0, seed=0)
    whole, whole_lp = ContinuousRollout(model, tok, config=SMALL).generate(ROWS, max_new_tokens=budgets, **greedy)
    rollout = ContinuousRollout(model, tok, config=SMALL)
    part, part_lp, _ = rollout.generate_turns(ROWS, max_new_tokens=budgets, groups=list(range(len(ROWS))),
                                              enough_groups=1, **greedy)
    todo = [i for i, e in enumerate(rollout.ended) if not e]
    assert rollout.ended[0] and all(len(part[i]) < 16 for i in todo)   # queued rows (4 cache rows) have none
    assert sum(len(part[i]) > 0 for i in todo) >= 3
    more, more_lp = rollout.generate([ROWS[i] + part[i] for i in todo],
                                     max_new_tokens=[budgets[i] - len(part[i]) for i in todo], **greedy)
    for j, i in enumerate(todo):
        part[i], part_lp[i] = part[i] + more[j], part_lp[i] + more_lp[j]
    assert part == whole
    assert max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(part_lp, whole_lp)) < 1e-4


def test_enough_groups_is_refused_with_tools(tmp_path):
    from mfsdp_kit.rl.rollout.tools import Tool, ToolConfig
    model, tok = load("LlamaForCausalLM", tmp_path)
    tools = ToolConfig(tools=[Tool(name="echo", stop="]", fn=lambda call: call)])
    with pytest.raises(ConfigError, match="enough_groups"):
        ContinuousRollout(model, tok, config=SMALL, tools=tools).generate_turns(
            ROWS, max_new_tokens=4, temperature=0, top_p=1.0, seed=0, groups=[0] * len(ROWS), enough_groups=1)


def test_a_row_continued_after_new_weights_is_prefilled_with_them(tmp_path):
    """Across an iteration's weight refresh: the continued rows (prompt + tokens so far) are prefilled with the new
    weights, so their greedy continuation is HF `generate`'s from prompt + tokens under the new weights."""
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    rollout = ContinuousRollout(model, tok, config=SMALL)
    part, _, _ = rollout.generate_turns(ROWS, max_new_tokens=[2] + [16] * (len(ROWS) - 1), temperature=0, top_p=1.0,
                                        seed=0, groups=list(range(len(ROWS))), enough_groups=1)
    todo = [i for i, e in enumerate(rollout.ended) if not e and part[i]]
    attn = model.model.layers[0].self_attn   # new weights, as a refresh that re-points them (`backend.refresh`)
    attn.q_proj.weight = torch.nn.Parameter(torch.randn_like(attn.q_proj.weight) * 0.5, requires_grad=False)
    rows = [ROWS[i] + part[i] for i in todo]
    more, _ = rollout.generate(rows, max_new_tokens=[16 - len(part[i]) for i in todo], temperature=0, top_p=1.0,
                               seed=0)
    want = hf_greedy(model, tok, rows, 16)
    assert len(todo) >= 3 and more == [w[:16 - len(part[i])] for w, i in zip(want, todo)]
