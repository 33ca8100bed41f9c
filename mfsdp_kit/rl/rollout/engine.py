"""The kit's rollout engine (nano-vllm's `LLMEngine`): continuous batching over a slot KV cache, one CUDA graph per
batch and slot bucket. Three roles, one verb each:

    scheduler.Scheduler       host only: which sequences run, where each stops (admit, resume, compact, next_chunk)
    model_runner.ModelRunner  device: weights, KV cache, graphs; launches what the scheduler decided (prefill, decode)
    ContinuousRollout         the public face (`sample`, `generate`, `refresh`, `release`, `stats`) and `step`,
                              one check point of the loop that joins the two

The naive loop (HF `generate`, as `HFRollout` calls it) pads every prompt of a call into one batch, grows a
dynamic cache and launches every kernel of every step from Python: a step costs the same whatever the batch
(docs/benchmarks.md, rollout), and a batch runs until its longest row ends, however many rows have stopped. Here:
  - the KV cache holds `rows` sequences of `slots` slots (`kv_cache.py`); rows are sized from the device's free
    memory (`DecodeConfig.cache_memory_fraction`, vLLM's gpu_memory_utilization) less the call's measured transient
    peak (a probe prefill and sampling, nano-vllm's warm-up: `kv_cache.Sizer`), and the cache is kept
    between calls (`keep_cache`; the training passes' token budget counts it) or freed after each;
  - a queue feeds the rows: a prompt is prefilled into a free row while the others wait, and every
    `check_every` decode steps the host reads what the steps sampled (the loop's only sync), cuts each row
    at its first stop id (`chat.stop_ids`) or at `max_new_tokens`, and refills finished rows from the queue;
  - the n samples of a prompt (`sample`) share one prefill: the prompt runs once and its KV is copied into the
    other rows (`DecodeConfig.share_prefill`), where the naive batch computes the same prompt n times;
  - once the queue is empty and the rows still running fit a smaller batch bucket (powers of two and 3/4 of each:
    `buckets_per_doubling`), they move to the front and the steps run that bucket: the long tail of a GRPO batch
    costs what its live rows cost;
  - a decode step reads the cache up to the next `slot_bucket` past the longest live row, and runs as one
    CUDA graph per (batch bucket, slot bucket) on a GPU (all graphs share one memory pool, all captured when the
    cache is made: `model_runner.ModelRunner`); elsewhere, or for MoE models (their routing syncs the host), it runs
    eagerly: the same code, so CPU tests cover it;
  - sampling (temperature, top-p, `kernels.sampling.pick`) runs on the device from one seeded generator, and each
    sampled token's log-prob at the sampling temperature comes back with it (the train-inference mismatch).
  - with tools (`tools.ToolConfig`), a row that writes a tool's stop string pauses at the check point, its tool
    runs, and its output is prefilled into the row's own cache slots (`decoder.extend`) before it resumes: the
    naive multi-turn loop re-prefills prompt + every earlier turn as a new prompt each turn (`scheduler.py`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from ...config import bad_value
from ...fieldtypes import COUNT, check_fields, number_in
from ...train import chat
from . import backend, fp8_weights
from .backend import Completions
from .kernels.sampling import Sampler
from .model_runner import ModelRunner
from .routes import RouteTable
from .scheduler import Scheduler, bucketed
from .timing import CallTimer
from .tools import ToolConfig


@dataclass(kw_only=True)
class DecodeConfig:
    """How `ContinuousRollout` uses the device."""

    max_batch_size: int = 512
    """Sequences in flight at most (cache rows); more prompts wait in the queue for a free row."""
    cache_memory_fraction: float = 0.5
    """Share of the device's free memory (when the cache is made; blocks torch's allocator holds unused count as
    free) a call may take (GPUs only): its KV cache plus its measured transient peak (the largest prefill under
    `prefill_tokens`, a decode step's sampling at the call's rows, a compaction's copies: `Sizer.transient_bytes`).
    Rows are the fewest of `max_batch_size`, the sequences of the call, and what fits."""
    check_every: int = 16
    """Decode steps between the host's reads of the sampled tokens (its only sync): stopped rows are refilled
    then, and a row may sample up to this many tokens past its stop id (cut on the host)."""
    min_batch: int = 16
    """The smallest decode batch bucket (rows) where steps are CUDA graphs: once fewer rows live, the step still runs
    this many (idle rows decode junk). Below it a step should cost about the same (a small step is mostly work that
    does not shrink with rows: the weights' read and each layer's fixed kernels; smaller batches were not timed:
    docs/benchmarks.md, "grpo_iteration: where a fresh machine's first iteration and a decode step go", "One decode
    step's kernels"), so smaller buckets only add graphs to capture (at 512 rows, 16 against 2 makes
    54 graphs instead of 81). Eager steps (a CPU, MoE models) keep buckets down to 2:
    there a step costs what its rows cost."""
    buckets_per_doubling: Literal[1, 2] = 2
    """Decode batch buckets per doubling of the live rows (`scheduler.batch_bucket`): 2 (the default) adds 3/4 of each
    power of two (16, 24, 32, 48, ..., 384, 512 rows: 11 graphs at 512 rows and `min_batch` 16), so a step idles at
    most a third of its rows as sequences end; 1: the powers of two (6 graphs), up to half idle. A step at 512 rows
    costs about 1.4x one at 256 (docs/benchmarks.md, "Batch buckets at 3/4 steps"), so idle rows there are time."""
    slot_bucket: int = 64
    """A step reads the cache up to the next multiple of this past its longest live row (one graph each)."""
    cuda_graphs: bool = True
    """Replay each decode step as a CUDA graph on a GPU (dense models)."""
    graph_mode: Literal["capture", "reduce-overhead"] = "capture"
    """How a step becomes a CUDA graph: "capture" (the step recorded with torch.cuda.CUDAGraph, one graph per
    batch and slot bucket in one memory pool) | "reduce-overhead" (the whole step through
    `torch.compile(mode="reduce-overhead")`: inductor's kernels and its CUDA-graph trees; the two are compared in
    docs/benchmarks.md, rollout)."""
    kernels: Literal["auto", "torch", "triton"] = "auto"
    """The decode step's attention and elementwise work on a GPU: "auto" ("triton" with `graph_mode="capture"` on a GPU
    that runs the kernels: `models.support.triton_available`, NVIDIA sm80+ with Triton; else "torch") | "torch" (SDPA
    over the masked slot bucket, cuDNN's kernel there, and the elementwise work through `compile_glue`; one CUDA graph
    per batch and slot bucket) | "triton" (the kit's Triton kernels, `kernels.attention` and `.elementwise`: a row
    reads its own keys, once per KV head, so one graph per batch bucket; no cuDNN plan per shape and no dynamo compile).
    Measured at 1.7 B, 512 rows: a fresh machine's first GRPO rollout about a third of "torch"'s, later ones about a
    tenth faster (docs/benchmarks.md, "The Triton kernels by default"). Off a GPU the torch ops
    run eagerly either way. "triton" needs `graph_mode="capture"`."""
    compile_ahead: bool = True
    """With the Triton kernels: compile every kernel a new cache's steps launch at once, on a thread per CPU core,
    before the graphs are captured (`ModelRunner.compile_kernels`, `models.triton_launch`). False: each compiles at its
    first launch, one after another (for comparison)."""
    compile_glue: bool = True
    """Where the glue is torch ops on a GPU (`kernels="torch"`, or a GPU the Triton kernels do not run on):
    `torch.compile` them (`decoder.Glue`)."""
    sampler: Literal["torch", "triton"] = "torch"
    """A decode step's draw where the Triton kernels run (`kernels`): "torch" (`sampling.pick`: about ten torch ops
    over [rows, vocab] fp32 after the head) | "triton" (`draw.draw`, in `kernels/`: one kernel reads each row's logits
    once; Philox draws, so other tokens than "torch" draws for the same seed; top_p 1 only: a top-p cut takes
    "torch"'s sort).
    Elsewhere "torch". At a 152k vocabulary it made a decode step faster at 256 rows and slower at 32 (a program a row
    left most SMs idle; since then fewer rows than SMs split each row over programs, not yet timed), so "torch" stays
    the default (docs/benchmarks.md, "RoPE inside decode attention and the draw kernel, first timed")."""
    fuse_rope: bool = False
    """Where the Triton kernels run (`kernels`): RoPE and the cache write of a step's k and v inside the attention
    kernel (`attention.decode_attention` with `new`), one launch a layer instead of two, and the rotated q kept in
    registers. Off (two kernels: `elementwise.rope_store`, then attention) until it is timed faster on a GPU
    (gpu_sections `decode_levers`). Elsewhere no effect."""
    prefill_tokens: int = 16384
    """Most tokens one prefill computes (its rows x its longest prompt; with `share_prefill`, its distinct prompts x
    its longest): queued prompts are prefilled in groups of similar length under it (`prefill_groups`), so a wave of
    long prompts never needs one [rows, longest] batch."""
    share_prefill: bool = True
    """Prefill each distinct prompt of a prefill group once (GRPO's n samples of a prompt, which `sample` queues
    together) and copy its KV into the other rows (`ModelRunner.prefill`): 8 samples of a 1,024-token prompt cost
    one prefill of 1,024 tokens and a copy of its KV, not 8,192 tokens. The same tokens and log-probs as a prefill
    of every row for the same seed (the sampler draws over every row's logits). False: every row its own prefill
    (for comparison)."""
    weights: Literal["model", "fp8"] = "model"
    """The projections' weights a call reads (each layer's q/k/v, o, gate/up, down; the LM head stays the model's):
    "model" (the HF model's own tensors, in its dtype) | "fp8" (e4m3 copies with a fp32 scale per output channel,
    the activations quantized per token, `torch._scaled_mm` with row-wise scales: `fp8_weights`; re-quantized
    before a call whenever the model's weights changed, so each `refresh` is picked up). A decode step then reads
    about half the weight bytes; the sampled log-probs are the FP8 model's, so the train-rollout mismatch grows (the
    kit's `rollout_correction` is made for it). Needs a CUDA GPU of compute capability 8.9+, a dense bf16 model and
    `graph_mode="capture"`; refused by name elsewhere."""
    keep_cache: bool = True
    """Keep the KV cache and its graphs between calls: a later call that fits the kept rows and slots starts at once
    (re-capturing every graph each call costs a GRPO iteration more: docs/benchmarks.md, "grpo_iteration"); the
    training passes' token budget counts the kept cache (`train.token_budget.memory_budget`). False: free them
    after each call (`release`) for the policy update."""

    def __post_init__(self):
        check_fields(self, max_batch_size=COUNT, min_batch=COUNT, check_every=COUNT, slot_bucket=COUNT,
                     prefill_tokens=COUNT, cache_memory_fraction=number_in(0, 1, low_open=True))
        if self.kernels == "triton" and self.graph_mode == "reduce-overhead":   # its compiled step is torch's own
            raise bad_value("kernels", self.kernels, '"torch" with graph_mode="reduce-overhead" (inductor compiles '
                            'the whole step from torch ops), or graph_mode="capture" for "triton"')
        torch_step = self.kernels == "torch" or self.graph_mode == "reduce-overhead"   # no Triton decode kernels
        if self.sampler == "triton" and torch_step:
            raise bad_value("sampler", self.sampler, '"torch" with kernels="torch" or graph_mode="reduce-overhead" '
                            '(the draw\'s kernel runs beside the Triton decode kernels)')
        if self.weights == "fp8":
            if self.graph_mode == "reduce-overhead":   # inductor would trace the copies' Triton launches: untested
                raise bad_value("weights", self.weights, '"model" with graph_mode="reduce-overhead", or '
                                'graph_mode="capture" for "fp8"')
            fp8_weights.refuse_device()
        if self.fuse_rope and torch_step:
            raise bad_value("fuse_rope", self.fuse_rope, 'False with kernels="torch" or graph_mode="reduce-overhead" '
                            '(it is a mode of the Triton attention kernel)')


class ContinuousRollout:
    """The kit's engine (module docstring): an HF model on this rank, refreshed in place as `HFRollout`'s is
    (`backend.refresh`), sampled by continuous batching through its `runner` (which regroups the model's q/k/v and
    gate/up in place: `decoder.fuse_projections`)."""

    def __init__(self, hf_model, tokenizer, *, config: DecodeConfig | None = None, tools: ToolConfig | None = None):
        self.model, self.tokenizer = hf_model.eval(), tokenizer
        self.config = config or DecodeConfig()
        self.tools = tools
        """Tools every row may call (`tools.ToolConfig`; the scheduler pauses and resumes a row, the runner prefills
        the tool's output)."""
        self.runner = ModelRunner(self.model, config=self.config)
        """The device state across calls: weights' view, KV cache, the decode steps' graphs (`model_runner.py`)."""
        self.ended: list[bool] = []
        """The last call's rows: True where the row ended (stop id or budget), False where `enough_groups` ended
        the call first (partial rollouts: a later call continues it)."""
        self.routes: list | None = None
        """The last call's MoE routes per row when it asked for them (`generate_turns(routes=True)`), else None."""
        self.stats: dict = {}
        """The last call's: sequences, rows, transient_bytes (the measured peak its cache was sized beside: 0 off a
        GPU), steps (decode), prefill_s, prefill_tokens (prompt tokens the prefills ran: a prompt shared by rows once,
        `share_prefill`), capture_s and graphs (steps made: on a GPU all
        of a new cache's graphs, in the call that makes it), kernels_s (of capture_s: the Triton kernels compiled
        ahead of the graphs, `ModelRunner.compile_kernels`), seconds, tokens
        (the model's), tokens_per_s, by_batch (`timing.CallTimer.by_batch`); with tools: tool_calls, tool_tokens,
        tool_s (in the tools), tool_wait_s (rows paused, summed over rows), extend_s (their outputs prefilled)."""

    def refresh(self, chunks, bridge) -> dict:
        """Copy the current training weights in (every chunk: `backend.refresh`); returns {"seconds", "bytes",
        "tensors", ...}."""
        return backend.refresh(self.model, chunks, bridge)

    def sample(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
               seed: int, routes: bool = False) -> Completions:
        """n completions per prompt, prompt-major, each cut after its first stop id, with their log-probs (of the
        model's tokens), with tools `model_mask`, and with `routes` each one's MoE routes (`routes.py`)."""
        if not prompts:
            return Completions([], logprobs=[], routes=[] if routes else None)
        rows = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        tokens, logprobs, mask = self.generate_turns([r for r in rows for _ in range(n)], max_new_tokens=max_new_tokens,
                                                     temperature=temperature, top_p=top_p, seed=seed, routes=routes)
        return Completions(tokens, logprobs=logprobs, model_mask=mask if self.tools else None,
                           routes=self.routes if routes else None)

    def generate(self, rows: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int) -> tuple[list[list[int]], list[list[float]]]:
        """(token ids, log-probs at the sampling temperature) of each row's completion: at most `max_new_tokens`,
        cut after the first stop id. Temperature 0: greedy. With tools, the log-probs are the model's tokens' only
        (`generate_turns` says which)."""
        return self.generate_turns(rows, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   seed=seed)[:2]

    @torch.no_grad()
    def generate_turns(self, rows: list[list[int]], *, max_new_tokens: int | list[int], temperature: float,
                       top_p: float, seed: int, routes: bool = False, groups: list[int] | None = None,
                       enough_groups: int | None = None) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """`generate` and each completion's model mask: 1 per token the model sampled, 0 per token a tool wrote
        (`max_new_tokens` counts both, so the training sequence length does not change with tools). `routes`: also
        keep each row's MoE routes in `self.routes` ([prompt + completion tokens, moe_layers, k] int16 per row).

        Partial rollouts (`rl.partial`): `max_new_tokens` per row (a continued row is prompt + its tokens so far,
        prefilled with the current weights, and what is left of its budget); with `groups` (an id per row) and
        `enough_groups`, the call ends at the first check point where that many groups have every row ended, and
        `self.ended` says which rows did (the others keep what they sampled so far)."""
        if enough_groups is not None and (routes or self.tools):
            raise bad_value("enough_groups", enough_groups, "None with tools or MoE routes (a row cut mid-call keeps "
                            "neither its tool turn nor its routes)")
        cfg, runner = self.config, self.runner
        runner.check_weights()
        longest = max(map(len, rows))
        each = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(rows)
        reach = max(len(r) + b for r, b in zip(rows, each))   # the longest row's prompt and budget
        slots = bucketed(reach + cfg.check_every, cfg.slot_bucket)   # a stopped row runs on
        t0, made, prefilled = time.perf_counter(), runner.made, runner.prefilled
        captured_s, kernels_s = runner.capture_s, runner.kernels_s
        state = runner.prepare(len(rows), slots=slots, longest=longest)
        self.stats = dict(sequences=len(rows), rows=state.shape[0], steps=0, prefill_s=0.0,
                          transient_bytes=state.transient_bytes)
        scheduler = Scheduler(rows, rows=state.shape[0], slots=state.shape[1], max_new_tokens=max_new_tokens,
                              stops=set(chat.stop_ids(self.tokenizer)), check_every=cfg.check_every,
                              slot_bucket=cfg.slot_bucket, min_batch=runner.min_batch(),
                              buckets_per_doubling=cfg.buckets_per_doubling,
                              prefill_tokens=cfg.prefill_tokens, tools=self.tools,
                              tokenizer=self.tokenizer, stats=self.stats,
                              on_finish=self._keep_routes if routes else None, groups=groups,
                              enough_groups=enough_groups, share_prefill=cfg.share_prefill)
        if routes:
            runner.routes = RouteTable(self.model, rows=state.shape[0], slots=state.shape[1], device=state.tok.device)
        sample = Sampler(temperature=temperature, top_p=top_p, seed=seed, device=state.tok.device,
                         kernel=runner.kernel_draws())
        timer = CallTimer(state.tok.device, self.stats)
        try:
            out = loop(scheduler, runner, sample, timer)
            self.ended = [s.done for s in scheduler.seqs]
            self.routes = [s.routes for s in scheduler.seqs] if routes else None
            return out
        finally:
            if runner.routes is not None:
                runner.routes.close()
                runner.routes = None
            self.stats["capture_s"] = runner.capture_s - captured_s
            self.stats["kernels_s"] = runner.kernels_s - kernels_s
            self.stats["graphs"] = runner.made - made
            self.stats["prefill_tokens"] = runner.prefilled - prefilled
            self.stats["by_batch"] = timer.by_batch()
            self.stats["seconds"] = time.perf_counter() - t0
            self.stats["tokens"] = sum(map(sum, scheduler.results()[2]))
            self.stats["tokens_per_s"] = self.stats["tokens"] / self.stats["seconds"]
            if not cfg.keep_cache:
                self.release()

    def _keep_routes(self, s) -> None:
        """A finished sequence's routes, read from its cache row before the row is reused."""
        s.routes = self.runner.routes.take(s.row, len(s.prompt) + len(s.tokens))

    def release(self) -> None:
        """Free the KV cache and its CUDA graphs (`ModelRunner.release`); the next call makes them again."""
        self.runner.release()


def step(scheduler: Scheduler, runner: ModelRunner, sample: Sampler, timer: CallTimer) -> None:
    """One check point of a call (nano-vllm's `LLMEngine.step`): the scheduler decides on the host, the runner
    launches on the device, the scheduler takes back what was sampled. In this order, as each decision reads the
    tokens of the last: rows back from their tools extended, queued prompts prefilled into free rows, the live rows
    moved to the front of a smaller batch, then one chunk of decode steps, whose read of its tokens is the only sync."""
    if resumed := scheduler.resume():
        with timer.phase("extend_s"):
            scheduler.record([s for s, _, _ in resumed], *runner.extend(resumed, sample))
    for group in scheduler.admit():
        with timer.phase("prefill_s"):
            scheduler.record(group, *runner.prefill(group, sample))
    if (move := scheduler.compact()) is not None:
        runner.move(move)
    if (chunk := scheduler.next_chunk()) is not None:
        tokens, logprobs = runner.decode(chunk, sample)
        timer.chunk(chunk.batch, len(chunk.slots))
        scheduler.decoded(chunk, tokens, logprobs)


def loop(scheduler: Scheduler, runner: ModelRunner, sample: Sampler,
         timer: CallTimer) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
    """A whole call: `step` while sequences are queued, decoding or waiting on a tool (the tool threads joined
    however it ends); returns the scheduler's `results()`."""
    try:
        while scheduler.busy():
            step(scheduler, runner, sample, timer)
    finally:
        scheduler.close()
    return scheduler.results()
