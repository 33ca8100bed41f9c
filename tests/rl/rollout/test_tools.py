"""rl.rollout.tools and the engine's tool calls: the calculator on good and bad input, and rows that pause at a call,
get the tool's output prefilled into their own cache and resume: their tokens equal greedy decoding recomputed from
scratch over prompt + completion + tool output (no pause, no resume), the turn limit ends a row, and the training
batch keeps tool tokens out of the loss and the rollout log-probs of the model's tokens only. fp32 on CPU."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.config import ConfigError
from mfsdp_kit.train.generate import cut_at_stop
from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl import core
from mfsdp_kit.rl.correction import rollout_logprobs_like
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig, default_backend
from mfsdp_kit.rl.rollout.hf import left_padded
from mfsdp_kit.rl.rollout.tools import CALCULATOR, Tool, ToolConfig, ToolError, calculator, find_call
from tests.rl.rollout.test_scheduler import CharTokenizer

ROWS = [[5, 17, 42, 9, 77, 3, 120], [8, 8, 200], [31, 64, 11, 150, 151], [7], [90, 91, 92, 93, 94, 95, 96, 97, 98],
        [12, 13]]
SMALL = DecodeConfig(max_batch_size=4, check_every=3, slot_bucket=8)


# ---- the calculator --------------------------------------------------------------------------
@pytest.mark.parametrize("expr,want", [("1234+5678", "6912"), (" 2*(3+4) ", "14"), ("-7//2", "-4"), ("7/2", "3.5"),
                                       ("2**10", "1024"), ("10%4", "2"), ("1e3+1", "1001"), ("9999*9999", "99980001")])
def test_calculator_evaluates_arithmetic(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr,match", [("", "empty"), ("1+", "not an expression"), ("__import__('os')", "Call"),
                                        ("a+1", "Name"), ("1<2", "Compare"), ("'a'*3", "Constant"),
                                        ("1/0", "division by zero"), ("2**1000", "exponent 1000"),
                                        ("9" * 40 + "*" + "9" * 40, "more than 60 digits"), ("1" * 300, "300 characters"),
                                        ("[1][0]", "Subscript"), ("~1", "Invert"), ("1@2", "MatMult")])
def test_calculator_names_what_it_refuses(expr, match):
    with pytest.raises(ToolError, match=match):
        calculator(expr)


def test_a_tool_error_becomes_the_tools_output():
    assert CALCULATOR.output("1/0") == "error: division by zero"
    assert CALCULATOR.call_text("so <calc>2+2") == "2+2"
    with pytest.raises(ConfigError, match="max_output_tokens"):
        Tool(name="t", stop="x", fn=str, max_output_tokens=0)
    with pytest.raises(ConfigError, match="max_calls"):
        ToolConfig(tools=[CALCULATOR], max_calls=0)


def test_a_call_needs_its_start_before_the_stop():
    """A stop with no start earlier in the turn is text (a `)` in prose), not a call; a later stop after a start
    is; the start must be in the turn, not before it (an earlier turn's call)."""
    tok = CharTokenizer()
    ids = lambda text: tok(text)["input_ids"]
    calc = Tool(name="calc", start="calc(", stop=")", fn=calculator)
    prose = ids("so x) then calc(2+3)")
    assert find_call(tok, prose, turn_start=0, new=len(prose), tools=[calc]) == (len(prose), calc)
    assert find_call(tok, prose[:5], turn_start=0, new=5, tools=[calc]) is None   # "so x)": no start
    # the orphan `)` stays in the turn: the next check point finds the real call after it, and only that
    assert find_call(tok, prose, turn_start=0, new=len(prose) - 5, tools=[calc]) == (len(prose), calc)
    earlier = ids("calc(1+1)=2 and 3)")
    assert find_call(tok, earlier, turn_start=11, new=len(earlier) - 11, tools=[calc]) is None
    plain = Tool(name="plain", stop=")", fn=calculator)   # no start: any stop is a call
    assert find_call(tok, prose[:5], turn_start=0, new=5, tools=[plain]) == (5, plain)


# ---- the engine with a tool ------------------------------------------------------------------
def load(tmp_path, arch="Qwen2ForCausalLM"):
    folder = write_tiny(arch, tmp_path / arch)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def echo(call: str) -> str:
    """The tool of these tests: two words that depend on the call (its word count), so the call text must arrive."""
    return f"w{60 + len(call.split())} w61"


def reference(model, tok, prompt, *, stops: set[int], output, max_new: int, max_calls: int):
    """Greedy decoding with the tools (one per stop token), recomputed from scratch each turn (HF generate over
    prompt + everything so far): (tokens, model mask)."""
    tokens, mask, calls, turn = [], [], 0, 0
    while len(tokens) < max_new:
        enc = left_padded([prompt + tokens], pad_id=tok.eos_token_id, device="cpu")
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new - len(tokens), pad_token_id=tok.eos_token_id)
        new = cut_at_stop(out[0, enc["input_ids"].shape[1]:].tolist(), [tok.eos_token_id])
        at = next((j for j, t in enumerate(new) if t in stops), None)
        if at is None:
            return tokens + new, mask + [1] * len(new)
        stop, new = new[at], new[:at + 1]
        tokens, mask = tokens + new, mask + [1] * len(new)
        if calls == max_calls or len(tokens) >= max_new:
            break
        calls += 1
        words = tok.decode(tokens[turn:]).rpartition(f"w{stop}")[0]
        result = tok(output(words), add_special_tokens=False)["input_ids"][:max_new - len(tokens)]
        tokens, mask, turn = tokens + result, mask + [0] * len(result), len(tokens) + len(result)
    return tokens, mask


def stop_tokens(model, tok) -> set[int]:
    """Per row, the first token >= 100 (its text "wNNN" is in no other token's) that greedy decoding writes after
    its first: each becomes a tool's stop, so most rows call a tool, at different steps."""
    free = ContinuousRollout(model, tok, config=SMALL).generate(ROWS, max_new_tokens=24, temperature=0, top_p=1.0,
                                                                seed=0)[0]
    return {next(t for t in row[1:] if t >= 100) for row in free}


def echo_tools(stops, max_calls: int, workers: int = 0) -> ToolConfig:
    return ToolConfig(tools=[Tool(name=f"echo{s}", stop=f"w{s}", fn=echo) for s in sorted(stops)], max_calls=max_calls,
                      workers=workers)


@pytest.mark.parametrize("max_calls,workers", [(1, 0), (3, 2)])
def test_tool_rows_equal_greedy_recomputed_from_scratch(max_calls, workers, tmp_path):
    """Rows pause at the stop, the tool's output is prefilled into their cache and they resume, while other rows of
    the batch decode and the queue refills: each row's tokens and model mask equal the from-scratch reference's.
    max_calls=1: a row that writes a second call ends at its stop (the turn limit). Tools inline or on 2 threads."""
    model, tok = load(tmp_path)
    stops = stop_tokens(model, tok)
    engine = ContinuousRollout(model, tok, config=SMALL, tools=echo_tools(stops, max_calls, workers))
    tokens, logprobs, mask = engine.generate_turns(ROWS * 2, max_new_tokens=28, temperature=0, top_p=1.0, seed=0)
    want = [reference(model, tok, p, stops=stops, output=echo, max_new=28, max_calls=max_calls) for p in ROWS * 2]
    assert tokens == [t for t, _ in want] and mask == [m for _, m in want]
    assert [len(lp) for lp in logprobs] == [sum(m) for m in mask]
    calls = sum(sum(1 for a, b in zip([1] + m, m) if a == 1 and b == 0) for m in mask)
    assert calls >= 4 and engine.stats["tool_calls"] == calls and engine.stats["tool_tokens"] == mask_zeros(mask)
    assert engine.stats["tool_wait_s"] > 0 and engine.stats["tokens"] == sum(map(sum, mask))
    if max_calls == 1:   # the turn limit: a row never holds a second tool output
        assert all(calls_of(m) <= 1 for m in mask) and any(calls_of(m) == 1 and m[-1] == 1 for m in mask)


def mask_zeros(mask):
    return sum(len(m) - sum(m) for m in mask)


def calls_of(m):
    return sum(1 for a, b in zip([1] + m, m) if a == 1 and b == 0)


def test_tool_logprobs_are_the_models_given_the_tool_output(tmp_path):
    """Sampled at T 0.8: each log-prob belongs to a model token and equals log softmax(logits / T) of a teacher-forced
    forward over prompt + all tokens (tool output included), <= 1e-5; the same seed gives the same samples."""
    model, tok = load(tmp_path)
    engine = ContinuousRollout(model, tok, config=SMALL, tools=echo_tools(stop_tokens(model, tok), 2))
    out = engine.generate_turns(ROWS, max_new_tokens=20, temperature=0.8, top_p=1.0, seed=4)
    assert out == engine.generate_turns(ROWS, max_new_tokens=20, temperature=0.8, top_p=1.0, seed=4)
    calls = 0
    for prompt, completion, lps, mask in zip(ROWS, *out):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        all_lp = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        want = all_lp[torch.tensor(mask, dtype=torch.bool)]
        calls += calls_of(mask)
        assert len(lps) == len(want) and (torch.tensor(lps) - want).abs().max() <= 1e-5
    assert calls >= 1


def test_the_hf_backend_refuses_tools_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    _, tok = load(tmp_path)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="tools"):
        default_backend(gpt2, tok, tools=ToolConfig(tools=[CALCULATOR]))


# ---- the training batch ----------------------------------------------------------------------
def test_tool_tokens_leave_the_loss_and_logprobs_are_the_models_only():
    """prompt [10, 11], completion [20, 21 | 30, 31 (tool) | 22, 2]: the loss mask covers the model's 4 tokens at their
    positions, and the rollout's 4 log-probs land there (`correction.rollout_logprobs_like`)."""
    completion, model_mask = [20, 21, 30, 31, 22, 2], [1, 1, 0, 0, 1, 1]
    batch = core.rollout_batch([[10, 11]], [completion], torch.zeros(1), seq_len_tokens=8, pad_id=0,
                               model_mask=[model_mask])
    assert batch.labels[0, 1:7].tolist() == completion
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 1, 0]
    lps = rollout_logprobs_like([[-0.1, -0.2, -0.3, -0.4]], batch.loss_mask)
    assert lps[0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, -0.3, -0.4, 0])
    plain = core.rollout_batch([[10, 11]], [completion], torch.zeros(1), seq_len_tokens=8, pad_id=0)
    assert plain.loss_mask[0].tolist() == [0, 1, 1, 1, 1, 1, 1, 0]


def test_model_masks_follow_groups_through_select_and_concat():
    """DAPO keeps and joins groups: each completion's mask goes with it; a batch without tools joins as all-model."""
    def batch(names, completions, mask):
        n = len(completions)
        return core.RolloutBatch(prompts=[(x, "") for x in names], prompt_ids=[[0] for _ in names],
                                 completions=completions, rewards=torch.zeros(n), solved=torch.zeros(n, dtype=torch.bool),
                                 group_size=n // len(names), model_mask=mask)
    tools = batch("ab", [[1, 2], [3], [4, 5, 6], [7]], [[1, 0], [1], [1, 0, 1], [1]])
    plain = batch("c", [[8, 9], [9]], None)
    assert tools.select_groups([1]).model_mask == [[1, 0, 1], [1]]
    assert core.concat([tools, plain]).model_mask == [[1, 0], [1], [1, 0, 1], [1], [1, 1], [1]]
    assert core.concat([plain, plain]).model_mask is None
