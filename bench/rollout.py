"""Rollout speed: `HFRollout` (transformers `generate`) against `ContinuousRollout` (the kit's engine, a CUDA
graph per batch and slot bucket on a GPU; its elementwise glue compiled or eager) on one device, new tokens per second and ms per decode step, beside the floor
measured in the same run: (weight bytes + the KV bytes a step reads) / the device's copy bandwidth.

    python bench/rollout.py --shape qwen2-1.8b --batches 1,64,256,512 --out runs/bench/rollout.json   # 1 GPU
    python bench/rollout.py --shape tiny --batches 2,4 --new-tokens 8 --out /tmp/rollout.json        # CPU smoke

Random weights (a config.json of the shape, built on the device); prompts of --prompt-tokens random ids;
--new-tokens forced (HF: min_new_tokens; the kit's loop stops early only when every row sampled a stop id,
and random weights over a 32k vocabulary practically never do). Sampling at T 1, top_p 1 (top_k off), as
rl.rollout.hf calls generate. Both backends sample from the same HF model object. ms per step = a whole
call (prefill included) / its new tokens, after a warm-up call of the same shape (keep_cache: the cache and
CUDA graphs stay across calls of one shape); "first call" is the warm-up (allocation, compiles, captures).
Then bf16 correctness: the kit's greedy tokens against HF's and the kit's log-probs against HF's forward.

--variants compiled,fp8: the projections' weights in FP8 (`DecodeConfig.weights="fp8"`) beside bf16's, each row with
its weights' floor ("weights ms": `fp8_weights.step_weight_bytes` over the copy bandwidth: FP8 halves the projections'
bytes), and in the greedy check the FP8 engine's log-probs against the bf16 model's forward (the mismatch a trainer
sees). Off a GPU of sm89+ the variant is refused by name (JSON "refused") and the others still run.

    python bench/rollout.py --shape qwen2-7b --batches 64 --variants compiled,fp8 --out runs/bench/rollout_fp8.json

--tools: the same calls with a tool (rl.rollout.tools): the ids read as characters of a 64-letter alphabet, so a
random model writes the stop "!" about once in 64 tokens; the tool answers --tool-tokens tokens after sleeping
--tool-latency-ms. Printed: the model's tokens/s without and with the tool, calls, and the seconds rows waited on
the tool (summed over rows), in the tool, and prefilling its outputs (stats of `ContinuousRollout`).

    python bench/rollout.py --shape qwen2-1.8b --batches 64,256 --tools --variants compiled   # 1 GPU

--shared-prefill PROMPTS: the prefill of PROMPTS random prompts of --prompt-tokens tokens x --samples samples each
(GRPO's rows: a prompt's samples queued together), one new token (the call is its prefill), with
`DecodeConfig.share_prefill` off (every row prefilled) and on (each prompt once, its KV copied into its samples'
rows): the median `prefill_s` of --repeats calls after a warm-up call, the prompt tokens each ran, and whether both
sampled the same tokens. --batches "" skips the decode rows.

    python bench/rollout.py --shape qwen2-1.8b --batches "" --prompt-tokens 1024 --shared-prefill 16 --samples 8
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mfsdp_kit.distributed import clock
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig, Tool, ToolConfig
from mfsdp_kit.rl.rollout.fp8_weights import step_weight_bytes

SHAPES = {   # (layers, hidden, heads, kv heads, ffn, vocab)
    "qwen2-1.8b": (28, 2048, 16, 4, 8192, 32768),   # issue 37's model: 1.84 B
    "qwen2-1.5b": (28, 1536, 12, 2, 8960, 151936),   # a 152k vocabulary beside a small model: the head and the draw
    "qwen2-7b": (28, 3584, 28, 4, 18944, 152064),
    "tiny": (2, 64, 4, 2, 128, 256),
}


def build(shape: str, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    layers, hidden, heads, kv, ffn, vocab = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=vocab - 1)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


class NoTokenizer:
    """Just what the backends read: the ids to pad with and to stop at (a bench passes ids, not text)."""

    def __init__(self, eos: int):
        self.eos_token_id, self.pad_token_id, self.chat_template = eos, eos, None


class CharIds(NoTokenizer):
    """Ids read as the characters of a 64-letter alphabet (id % 64), and text back to ids: enough for a tool's stop
    string to be found in a random model's samples (about once in 64 tokens for a one-letter stop)."""

    LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !"

    def decode(self, ids) -> str:
        return "".join(self.LETTERS[i % 64] for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self.LETTERS.index(c) for c in text]}


def tool_rows(model, vocab: int, batches: list[int], *, prompt_tokens: int, new_tokens: int, tool_tokens: int,
              latency_ms: float, device: str) -> list[dict]:
    """Per batch: the engine's model tokens/s without and with a tool (`CharIds`' stop "!", an output of
    `tool_tokens` letters after `latency_ms`), its calls, and the seconds rows waited, the tool took, its outputs'
    prefill took (the second call of each shape: the first makes the cache and graphs)."""
    def slow(call: str) -> str:
        time.sleep(latency_ms / 1e3)
        return "x" * tool_tokens
    tools = ToolConfig(tools=[Tool(name="echo", stop="!", fn=slow, max_output_tokens=tool_tokens)], max_calls=8)
    out = []
    print(f"{'sequences':>9} {'tok/s':>9} {'tok/s tools':>12} {'calls':>6} {'wait s':>8} {'tool s':>8} "
          f"{'extend s':>9} {'seconds':>8}")
    for batch in batches:
        rows = torch.randint(0, vocab - 1, (batch, prompt_tokens), generator=torch.Generator().manual_seed(batch)).tolist()
        row = dict(sequences=batch, tool_tokens=tool_tokens, tool_latency_ms=latency_ms)
        for name, kw in (("plain", {}), ("tools", dict(tools=tools))):
            kit = ContinuousRollout(model, CharIds(vocab - 1), config=DecodeConfig(keep_cache=True), **kw)
            for _ in range(2):
                kit.generate(rows, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=0)
                clock.synchronize(device)
            row[name] = {k: v for k, v in kit.stats.items() if k != "by_batch"}
            kit.release()
        t = row["tools"]
        print(f"{batch:>9} {row['plain']['tokens_per_s']:>9.0f} {t['tokens_per_s']:>12.0f} {t['tool_calls']:>6} "
              f"{t['tool_wait_s']:>8.3f} {t['tool_s']:>8.3f} {t['extend_s']:>9.3f} {t['seconds']:>8.2f}")
        out.append(row)
    return out


def shared_prefill(model, vocab: int, *, prompts: int, samples: int, prompt_tokens: int, repeats: int,
                   device: str) -> dict:
    """The module docstring's --shared-prefill: per setting ("off", "on") the median prefill_s of `repeats` calls
    after a warm-up (the cache and its graphs), its first call's, and prefill_tokens; "on / off" and "same_tokens"."""
    ids = torch.randint(0, vocab - 1, (prompts, prompt_tokens), generator=torch.Generator().manual_seed(11)).tolist()
    rows = [r for r in ids for _ in range(samples)]
    out, tokens = dict(prompts=prompts, samples=samples, prompt_tokens=prompt_tokens), {}
    for name, share in (("off", False), ("on", True)):
        kit = ContinuousRollout(model, NoTokenizer(vocab - 1), config=DecodeConfig(keep_cache=True, share_prefill=share))
        seconds = []
        for _ in range(repeats + 1):
            tokens[name], _ = kit.generate(rows, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=0)
            clock.synchronize(device)
            seconds.append(kit.stats["prefill_s"])
        out[name] = dict(prefill_s=statistics.median(seconds[1:]), first_prefill_s=seconds[0],
                         prefill_tokens=kit.stats["prefill_tokens"])
        kit.release()
    out["on / off"] = out["on"]["prefill_s"] / out["off"]["prefill_s"]
    out["same_tokens"] = tokens["on"] == tokens["off"]
    print(f"{'prompts x samples':>17} {'prompt tokens':>13} {'ran off':>8} {'ran on':>7} {'prefill s off':>13} "
          f"{'on':>8} {'on / off':>8} {'same tokens':>11}")
    print(f"{f'{prompts} x {samples}':>17} {prompt_tokens:>13} {out['off']['prefill_tokens']:>8} "
          f"{out['on']['prefill_tokens']:>7} {out['off']['prefill_s']:>13.4f} {out['on']['prefill_s']:>8.4f} "
          f"{out['on / off']:>8.3f} {str(out['same_tokens']):>11}")
    return out


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = clock.mean_ms(lambda: y.copy_(x), repeats=5, warmup=1, device=device)
    return 2 * x.numel() / (ms / 1e3)


def timed_hf(model, rows, new: int, device: str) -> float:
    """Seconds of one `generate` of `new` forced tokens, as HFRollout.sample calls it."""
    from mfsdp_kit.rl.rollout.hf import left_padded
    enc = left_padded(rows, pad_id=model.config.eos_token_id, device=device)
    return clock.seconds(lambda: model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                                max_new_tokens=new, min_new_tokens=new,
                                                pad_token_id=model.config.eos_token_id), device=device)[0]


def timed_kit(rollout: ContinuousRollout, rows, new: int, device: str) -> tuple[float, int]:
    seconds, (out, _) = clock.seconds(lambda: rollout.generate(rows, max_new_tokens=new, temperature=1.0, top_p=1.0,
                                                               seed=0), device=device)
    return seconds, max(map(len, out))


def agreement(model, kit: ContinuousRollout, rows, new: int, device: str) -> dict:
    """Greedy `new` tokens of the kit against HF greedy `generate` on the same model: the share of positions
    whose tokens agree, and the max |kit log-prob - HF log-prob| of the kit's tokens (HF scoring them by a plain
    forward of prompt + completion, teacher-forced)."""
    from mfsdp_kit.rl.rollout.hf import left_padded
    ours, lps = kit.generate(rows, max_new_tokens=new, temperature=0, top_p=1.0, seed=0)
    enc = left_padded(rows, pad_id=model.config.eos_token_id, device=device)
    theirs = model.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                            pad_token_id=model.config.eos_token_id)[:, enc["input_ids"].shape[1]:].tolist()
    same = sum(a == b for mine, ref in zip(ours, theirs) for a, b in zip(mine, ref))
    diff = 0.0
    with torch.no_grad():
        for prompt, mine, lp in zip(rows, ours, lps):
            logits = model(torch.tensor([prompt + mine], device=device)).logits[0, len(prompt) - 1:-1]
            ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(mine, device=device)[:, None])[:, 0]
            diff = max(diff, (torch.tensor(lp, device=device) - ref).abs().max().item())
    return dict(token_agreement=same / sum(map(len, ours)), max_logprob_diff=diff)


@torch.no_grad()
def profile_decode(model, vocab: int, *, batch: int, prompt_tokens: int, new_tokens: int, device: str) -> dict:
    """Where a decode step's GPU time goes at `batch` rows: the engine run eagerly (its glue compiled, no graphs,
    so each kernel is seen) under torch.profiler, kernels summed over the call and divided by its decode steps;
    beside it the captured step alone (graph replays at one slot bucket) and `pick` alone, in ms."""
    from torch.profiler import ProfilerActivity, profile
    from mfsdp_kit.rl.rollout.kernels.sampling import pick
    rows = torch.randint(0, vocab - 1, (batch, prompt_tokens), generator=torch.Generator().manual_seed(3)).tolist()
    kit = ContinuousRollout(model, NoTokenizer(vocab - 1), config=DecodeConfig(cuda_graphs=False, keep_cache=True))
    kit.generate(rows, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)   # compiles, the cache
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        kit.generate(rows, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=0)
        clock.synchronize(device)
    steps = kit.stats["steps"]
    kernels = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
    table = [dict(kernel=e.key[:90], calls_per_step=e.count / steps, us_per_step=e.self_device_time_total / steps)
             for e in kernels]
    kit.release()
    graphed = ContinuousRollout(model, NoTokenizer(vocab - 1), config=DecodeConfig(keep_cache=True))
    graphed.generate(rows, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    state = graphed.runner.cache
    slots = min(state.shape[1], 64 * -(-(prompt_tokens + new_tokens // 2) // 64))   # the call's mean bucket
    step = graphed.runner.step(batch, slots)
    gen = torch.Generator(device=device).manual_seed(0)
    graph_ms = clock.mean_ms(step, repeats=50, warmup=1, device=device)
    logits = model.lm_head(step())
    pick_ms = clock.mean_ms(lambda: pick(logits, temperature=1.0, top_p=1.0, generator=gen), repeats=50, warmup=1,
                            device=device)
    graphed.release()
    total = sum(r["us_per_step"] for r in table) / 1e3
    print(f"profile at {batch} rows: kernels {total:.2f} ms/step (eager engine), graph replay {graph_ms:.2f} ms "
          f"at {slots} slots, pick {pick_ms:.3f} ms")
    print(f"{'us/step':>9} {'calls':>6}  kernel")
    for r in table[:30]:
        print(f"{r['us_per_step']:>9.1f} {r['calls_per_step']:>6.1f}  {r['kernel']}")
    return dict(batch=batch, kernel_ms_per_step=total, graph_ms=graph_ms, graph_slots=slots, pick_ms=pick_ms,
                kernels=table[:60])


@torch.no_grad()   # as the engine runs: with grad on, the glue recompiles and runs autograd's wrappers
def capture_split(model, vocab: int, *, rows: int, slots: int) -> dict:
    """What making a cache's graphs costs (`model_runner.ModelRunner.cache_for`: every bucket of
    `model_runner.buckets`), at `rows` x `slots` twice (the first with the glue's compile), then one bucket's parts: its
    eager step's host time (the launches) and device time, one capture, and cProfile's top functions of that capture."""
    import cProfile
    import io
    import pstats
    from mfsdp_kit.rl.rollout.model_runner import captured
    kit = ContinuousRollout(model, NoTokenizer(vocab - 1), config=DecodeConfig(keep_cache=True))
    r = kit.runner

    def made() -> float:
        t0 = time.perf_counter()
        r.cache_for(rows, slots)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    first_s, again_s = made(), (r.release(), made())[1]
    graphs, state = len(r.cache.steps), r.cache

    eager = r.eager(rows, slots)
    eager()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eager()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    eager_ms = (time.perf_counter() - t0) * 1e3
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(lambda: captured(eager, pool=state.pool))
    torch.cuda.synchronize()
    capture_ms = (time.perf_counter() - t0) * 1e3
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(25)
    kit.release()
    print(f"capture at {rows} rows x {slots} slots: {graphs} graphs, first {first_s:.2f} s (with compiles), again "
          f"{again_s:.2f} s ({again_s / graphs * 1e3:.1f} ms a graph); one bucket: eager step {eager_ms:.1f} ms "
          f"({host_ms:.1f} ms of launches), capture {capture_ms:.1f} ms\n" + text.getvalue()[:6000])
    return dict(rows=rows, slots=slots, graphs=graphs, first_s=first_s, again_s=again_s, eager_ms=eager_ms,
                eager_host_ms=host_ms, one_capture_ms=capture_ms)


VARIANTS = {"compiled": {}, "triton": dict(kernels="triton"), "eager": dict(compile_glue=False),
            "reduce-overhead": dict(graph_mode="reduce-overhead"), "sampler": dict(sampler="triton"),
            "fused_rope": dict(fuse_rope=True), "fp8": dict(weights="fp8")}
"""The kit's variants as DecodeConfig fields: compiled (the default: CUDA graphs captured by hand, with the kit's
Triton kernels on a GPU that runs them, else compiled glue and SDPA), triton (the Triton kernels asked for by name),
eager (glue eager), reduce-overhead (the whole step through torch.compile(mode="reduce-overhead")), sampler (the
default with the draw in one kernel: `sampler="triton"`), fused_rope (the default with RoPE and the cache write inside
the attention kernel: `fuse_rope=True`), fp8 (the default with the projections' weights in FP8: `weights="fp8"`;
refused off a GPU of sm89+, the refusal printed and written under "refused", the other variants still run)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2-1.8b", choices=sorted(SHAPES))
    p.add_argument("--batches", default="1,64,256,512", help="concurrent sequences, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-new-tokens", type=int, default=32, help="HF generate is ~70 ms a step: fewer steps")
    p.add_argument("--variants", default="compiled,eager",
                   help=f"the kit's variants, comma-separated of {','.join(VARIANTS)}")
    p.add_argument("--agreement-rows", type=int, default=64, help="rows of the bf16 greedy comparison with HF")
    p.add_argument("--profile-batch", type=int, default=0, help="also profile a decode step at this many rows")
    p.add_argument("--capture-split", default="", metavar="ROWS,SLOTS",
                   help="also time making every graph of a ROWS x SLOTS cache, and one capture's parts")
    p.add_argument("--tools", action="store_true", help="also the engine with a tool (module docstring)")
    p.add_argument("--tool-tokens", type=int, default=16, help="tokens of each tool output")
    p.add_argument("--tool-latency-ms", type=float, default=0.0, help="each tool call sleeps this long")
    p.add_argument("--shared-prefill", type=int, default=0, metavar="PROMPTS",
                   help="also time a shared prefill against a prefill per row (module docstring); 0: not")
    p.add_argument("--samples", type=int, default=8, help="--shared-prefill: samples per prompt")
    p.add_argument("--repeats", type=int, default=3, help="--shared-prefill: timed calls per setting")
    p.add_argument("--out", default="runs/bench/rollout.json")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(args.shape, device, dtype)
    layers, hidden, heads, kv, ffn, vocab = SHAPES[args.shape]
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    bandwidth = copy_bandwidth(device)
    if bad := [v for v in args.variants.split(",") if v not in VARIANTS]:
        raise SystemExit(f"--variants: {bad} not allowed; allowed: {','.join(VARIANTS)}")
    kits, refused = {}, {}
    for v in args.variants.split(","):
        try:
            kits[v] = ContinuousRollout(model, NoTokenizer(vocab - 1), config=DecodeConfig(keep_cache=True, **VARIANTS[v]))
        except ConfigError as e:   # fp8 off an sm89+ GPU: named, and the other variants' rows still made
            refused[v] = str(e)
            print(f"variant {v} refused: {e}")
    # the weights' bytes alone over the copy bandwidth: the floor that FP8 weights lower (the KV bytes apart)
    weights_floor_ms = {v: step_weight_bytes(model, fp8=VARIANTS[v].get("weights") == "fp8") / bandwidth * 1e3
                        for v in kits}
    results = []
    print(f"{args.shape} on {device} ({dtype}): weights {weight_bytes / 1e9:.2f} GB, copy {bandwidth / 1e9:.0f} GB/s")
    batches = [int(b) for b in args.batches.split(",") if b]
    if batches:
        print(f"{'sequences':>9} {'variant':>9} {'HF ms/step':>11} {'HF tok/s':>10} {'kit ms/step':>12} "
              f"{'kit tok/s':>10} {'kit decode ms':>14} {'floor ms':>9} {'weights ms':>10} {'x HF':>6}")
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        rows = torch.randint(0, vocab - 1, (batch, args.prompt_tokens), generator=g).tolist()
        timed_hf(model, rows, 2, device)
        hf_ms = timed_hf(model, rows, args.hf_new_tokens, device) / args.hf_new_tokens * 1e3
        kv_bytes = 2 * layers * batch * kv * (args.prompt_tokens + args.new_tokens) * (hidden // heads) * \
            torch.finfo(dtype).bits // 8
        floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
        for name, kit in kits.items():
            try:   # warm-up: the cache, compiles, every bucket's graph
                first_s, _ = timed_kit(kit, rows, args.new_tokens, device)
            except Exception as e:   # one variant's failure (a compile, say) must not cost the others' numbers
                print(f"{batch:>9} {name:>9} FAILED: {type(e).__name__}: {str(e)[:300]}")
                kit.release()
                continue
            if device == "cuda":   # peak_bytes: the timed calls' own (the warm-up's probe resets torch's counter)
                torch.cuda.reset_peak_memory_stats()
            whole, steps = timed_kit(kit, rows, args.new_tokens, device)
            one, _ = timed_kit(kit, rows, 1, device)   # prefill (and a small cache): the call less its decode
            kit.release()
            kit_ms, decode_ms = whole / steps * 1e3, (whole - one) / max(steps - 1, 1) * 1e3
            row = dict(sequences=batch, variant=name, hf_ms_per_step=hf_ms, hf_tokens_per_s=batch / hf_ms * 1e3,
                       kit_ms_per_step=kit_ms, kit_tokens_per_s=batch / kit_ms * 1e3, kit_decode_ms_per_step=decode_ms,
                       floor_ms=floor_ms, weights_floor_ms=weights_floor_ms[name], kit_steps=steps, first_call_s=first_s,
                       peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else 0)
            results.append(row)
            print(f"{batch:>9} {name:>9} {hf_ms:>11.2f} {row['hf_tokens_per_s']:>10.0f} {kit_ms:>12.2f} "
                  f"{row['kit_tokens_per_s']:>10.0f} {decode_ms:>14.2f} {floor_ms:>9.2f} {weights_floor_ms[name]:>10.2f} {hf_ms / kit_ms:>6.1f}"
                  f"   (first call {first_s:.1f} s)")
    rows = torch.randint(0, vocab - 1, (args.agreement_rows, args.prompt_tokens),
                         generator=torch.Generator().manual_seed(7)).tolist()
    checks = {name: agreement(model, kit, rows, 64, device) for name, kit in kits.items()
              if args.agreement_rows and any(r["variant"] == name for r in results)}
    for name, c in checks.items():
        print(f"greedy vs HF ({dtype}, {args.agreement_rows} rows x 64 tokens, {name}): token agreement "
              f"{c['token_agreement']:.4f}, max |log-prob diff| {c['max_logprob_diff']:.4f}")
    prof = (profile_decode(model, vocab, batch=args.profile_batch, prompt_tokens=args.prompt_tokens,
                           new_tokens=min(args.new_tokens, 64), device=device) if args.profile_batch else None)
    capture = (capture_split(model, vocab, **dict(zip(("rows", "slots"), map(int, args.capture_split.split(",")))))
               if args.capture_split else None)
    with_tools = (tool_rows(model, vocab, batches, prompt_tokens=args.prompt_tokens,
                            new_tokens=args.new_tokens, tool_tokens=args.tool_tokens, latency_ms=args.tool_latency_ms,
                            device=device) if args.tools else None)
    shared = (shared_prefill(model, vocab, prompts=args.shared_prefill, samples=args.samples,
                             prompt_tokens=args.prompt_tokens, repeats=args.repeats, device=device)
              if args.shared_prefill else None)
    write_json(args.out, dict(refused=refused, tools=with_tools, profile=prof, capture=capture, shared_prefill=shared, shape=args.shape,
                              device=device, dtype=str(dtype), weight_bytes=weight_bytes,
                              copy_bytes_per_s=bandwidth, prompt_tokens=args.prompt_tokens,
                              new_tokens=args.new_tokens, results=results, agreement=checks))


if __name__ == "__main__":
    main()
