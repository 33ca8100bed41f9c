"""A rollout backend with its own decode loop: a preallocated KV cache and, on a GPU, one CUDA graph per
batch size. The weights are the HF model's own modules, refreshed in place as `HFRollout` refreshes them.

The naive loop (HF `generate`, as `HFRollout` calls it) grows a dynamic cache and launches every kernel
of every layer from Python at each step: measured on 1 H200 (1.84 B qwen2 shape, 256 sequences) that is
~90 ms a step whatever the batch, while the same step replayed as one CUDA graph of this module's loop
takes 6.4 ms (shared/RESEARCH.md, 2026-12-02). What differs here:
  - the cache is one tensor per layer [rows, kv_heads, slots, head_dim], kept with its CUDA graphs across
    calls of one shape (`kept_state`; `release` frees them); prompts are right-aligned (left-padded), so
    every row writes the same slot at a step and a boolean slot mask hides the padding; a step reads the
    cache only up to the next SLOT_BUCKET past its token;
  - grouped-query attention without `repeat_kv`: the G query heads of one KV head become G query rows
    of one SDPA head over that KV head's cache (no copy of K or V);
  - the projections, the MLP (dense or MoE), the norms' weights and the rotary tables are the HF
    modules' own (an RMSNorm runs as one `F.rms_norm`), so this loop computes the HF model's function
    (tests/rl/test_static.py compares greedy tokens with `generate` for every allowed architecture);
  - sampling (temperature, top-p) runs on the device from one seeded generator; temperature 0 is greedy;
  - no host sync inside a step: whether every row has stopped is read every `check_every` steps.
Not yet (issue 37): continuous batching (a finished row's slot refilled from a queue), a cache sized from
free memory and released around the policy update by the RL loop itself, sliding windows shorter than a
row (refused by name), PP/TP-sharded rollouts (each rank holds the whole HF model, as HFRollout does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import chat
from ...config import ConfigError
from ...generate import cut_at_stop
from .hf import HFRollout, left_padded

SLOT_BUCKET = 64
"""A decode step reads the cache up to the next multiple of this past its token, not all of it (one graph per
bucket): at 128 + 256 slots the average step reads 2/3 of the cache."""

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
"""Architectures whose decoder layer this loop reproduces: pre-norm attention with q/k/v/o projections
(optional biases, optional q/k norms) and RoPE from the model's rotary module, then the layer's MLP."""


def check_model(hf_model, *, max_len_tokens: int) -> None:
    """ConfigError naming what this backend cannot run, before anything is allocated."""
    arch = type(hf_model).__name__
    if arch not in SUPPORTED:
        raise ConfigError(f"StaticCacheRollout does not run {arch}; allowed: {', '.join(SUPPORTED)} "
                          "(HFRollout runs any causal LM)")
    window = getattr(hf_model.config, "sliding_window", None)
    if window is not None and getattr(hf_model.config, "use_sliding_window", True) and window < max_len_tokens:
        raise ConfigError(f"sliding_window={window} is not allowed below the prompt + max_new_tokens length "
                          f"({max_len_tokens}): StaticCacheRollout attends to every earlier slot")


class StaticCacheRollout(HFRollout):
    """`HFRollout`'s model and refresh, sampled by this module's decode loop (see the module docstring)."""

    def __init__(self, hf_model, tokenizer, *, cuda_graphs: bool = True, check_every: int = 16):
        super().__init__(hf_model, tokenizer)
        self.cuda_graphs, self.check_every = cuda_graphs, check_every
        c = hf_model.config
        self.kv_heads = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.group = c.num_attention_heads // c.num_key_value_heads
        self.clip_qkv = getattr(c, "clip_qkv", None)   # OLMoE's optional clamp of q, k, v
        self._kept = None
        """((rows, slots), cache, rope table, decode steps by slot bucket) of the last call: see `kept_state`."""

    def sample(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> list[list[int]]:
        """n completions per prompt, prompt-major, each cut after its first stop id; temperature 0: greedy."""
        if not prompts:
            return []
        rows = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        rows = [r for r in rows for _ in range(n)]
        out = self.generate(rows, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        stops = chat.stop_ids(self.tokenizer)
        return [cut_at_stop(row, stops) for row in out.tolist()]

    @torch.no_grad()   # else each step's in-place cache write chains its graph onto the last: every step kept
    def generate(self, rows: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int) -> torch.Tensor:
        """New tokens [len(rows), <= max_new_tokens]. A row that stopped goes on sampling until every row has
        (read every `check_every` steps): callers cut each row at its first stop id."""
        device = self.model.device
        enc = left_padded(rows, pad_id=chat.pad_id(self.tokenizer), device=device)
        real = enc["attention_mask"].bool()
        batch, width = real.shape
        check_model(self.model, max_len_tokens=width + max_new_tokens)
        slots = bucketed(width + max_new_tokens)   # rounded up: more calls share a shape
        cache, rope, steps = self.kept_state(batch, slots)
        # slot s is visible to a row if it holds one of the row's real tokens (pads never are)
        visible = torch.cat([real, torch.ones(batch, slots - width, dtype=torch.bool, device=device)], 1)
        positions = real.long().cumsum(1) - 1   # HF's position ids for left padding
        causal = torch.ones(width, slots, dtype=torch.bool, device=device).tril()
        itself = torch.eye(width, slots, dtype=torch.bool, device=device)   # a pad query sees its own slot:
        mask = (visible[:, None, None, :] & causal) | itself   # an all-masked row would give NaN, and cache it
        gen = torch.Generator(device=device).manual_seed(seed)
        stops = torch.tensor(chat.stop_ids(self.tokenizer) or [-1], device=device)
        logits = self.forward(enc["input_ids"], positions.clamp(min=0), mask, cache, start=0, rope=rope)
        tokens = [pick(logits, temperature=temperature, top_p=top_p, generator=gen)]
        pos = positions[:, -1:] + 1
        done = torch.isin(tokens[0], stops)
        for t in range(1, max_new_tokens):
            end = min(slots, bucketed(width + t))
            if end not in steps:
                steps[end] = self.decode_step(batch, end, [(k[:, :, :end], v[:, :, :end]) for k, v in cache], rope)
            step_mask = visible[:, None, None, :end] & (torch.arange(end, device=device) <= width + t - 1)
            logits = steps[end](tokens[-1][:, None], pos, step_mask, width + t - 1)
            tokens.append(pick(logits, temperature=temperature, top_p=top_p, generator=gen))
            pos = pos + 1
            done |= torch.isin(tokens[-1], stops)
            if t % self.check_every == 0 and bool(done.all()):   # the loop's only host sync
                break
        return torch.stack(tokens, 1)

    def kept_state(self, batch: int, slots: int):
        """(cache, rope, steps) for `batch` rows of `slots` slots: the last call's when its shape was the same,
        so its CUDA graphs (captured over that cache) replay at once; else new ones, the old freed first.
        Stale entries are harmless: a slot is masked until this call writes it, and the prefill rewrites the
        prompt slots, pads included. `rope`: the model's rotary module's (cos, sin) for positions 0..slots-1.
        `steps`: decode steps by the slots they read (the cache up to the next SLOT_BUCKET past the token)."""
        if self._kept is None or self._kept[0] != (batch, slots):
            self._kept = None
            cache = self.new_cache(batch, slots)
            rope = self.model.model.rotary_emb(cache[0][0], torch.arange(slots, device=cache[0][0].device)[None])
            self._kept = ((batch, slots), cache, rope, {})
        return self._kept[1:]

    def release(self) -> None:
        """Free the kept KV cache and CUDA graphs (before a policy update that needs the memory, say); the next
        call makes them again."""
        self._kept = None

    def new_cache(self, batch: int, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per layer, each [batch, kv_heads, slots, head_dim] in the model's dtype (zeros: a masked
        slot must not hold NaN, or 0 * NaN would reach the output)."""
        p = next(self.model.parameters())
        shape = (batch, self.kv_heads, slots, self.head_dim)
        return [(torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device))
                for _ in self.model.model.layers]

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache, *, start, rope) -> torch.Tensor:
        """Logits of the last position [B, vocab] for tokens `ids` [B, T] written to slots start..start+T-1;
        `mask` [B, 1, T, slots] says which slots each query sees. `start` may be a 0-d tensor (graphs);
        `rope` is the model's rotary module's (cos, sin) for positions 0..slots-1, [1, slots, head_dim] each."""
        m = self.model.model
        x = m.embed_tokens(ids)
        cos, sin = (t[0][pos].unsqueeze(1) for t in rope)
        gmask = mask.repeat(1, 1, self.group, 1)
        where = start + torch.arange(ids.shape[1], device=ids.device)
        for layer, (k_cache, v_cache) in zip(m.layers, cache):
            x = x + self.attention(layer.self_attn, rms(layer.input_layernorm, x), cos, sin, gmask, k_cache, v_cache,
                                   where)
            out = layer.mlp(rms(layer.post_attention_layernorm, x))
            x = x + (out[0] if isinstance(out, tuple) else out)   # MoE blocks also return router logits
        return self.model.lm_head(rms(m.norm, x[:, -1]))

    def attention(self, attn, h, cos, sin, gmask, k_cache, v_cache, where) -> torch.Tensor:
        B, T, _ = h.shape
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is not None and q_norm.weight.numel() != self.head_dim:   # OLMoE: over all heads at once
            q, k = rms(q_norm, q), rms(k_norm, k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        if q_norm is not None and q_norm.weight.numel() == self.head_dim:   # Qwen3: per head
            q, k = rms(q_norm, q), rms(k_norm, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache.index_copy_(2, where, k)
        v_cache.index_copy_(2, where, v)
        # G query heads per KV head -> G*T query rows of one head; gmask repeats the T rows G times to match
        q = q.reshape(B, self.kv_heads, self.group * T, self.head_dim)
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=gmask,
                                             scale=getattr(attn, "scaling", self.head_dim ** -0.5))
        return attn.o_proj(out.view(B, -1, T, self.head_dim).transpose(1, 2).reshape(B, T, -1))

    def decode_step(self, batch: int, slots: int, cache, rope):
        """step(tokens [B, 1], pos [B, 1], mask [B, 1, 1, slots], slot) -> logits over `cache` (views of the
        first `slots` slots); replayed from one CUDA graph on a GPU (eager elsewhere, or cuda_graphs=False)."""
        eager = lambda tok, pos, mask, slot: self.forward(tok, pos, mask, cache, start=slot, rope=rope)   # noqa: E731
        device = self.model.device
        if not (self.cuda_graphs and device.type == "cuda") or is_moe(self.model):   # MoE routing syncs the host
            return eager
        tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        mask = torch.zeros(batch, 1, 1, slots, dtype=torch.bool, device=device)
        slot = torch.zeros((), dtype=torch.long, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up outside the graph (allocator, cuBLAS handles)
            eager(tok, pos, mask, slot)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = eager(tok, pos, mask, slot)

        def replay(t, p, m, s):
            tok.copy_(t), pos.copy_(p), mask.copy_(m), slot.fill_(s)
            graph.replay()
            return logits.clone()
        return replay


def bucketed(slots: int) -> int:
    """`slots` rounded up to a multiple of SLOT_BUCKET."""
    return -(-slots // SLOT_BUCKET) * SLOT_BUCKET


def rms(norm, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module's function in one fused kernel (`F.rms_norm`) instead of its ~7 (fp32 upcast,
    pow, mean, rsqrt, mul, cast, mul); the same arithmetic, rounded once. Other norms: the module itself."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm(x) if eps is None else F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's `apply_rotary_pos_emb` applies it (rotate_half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def is_moe(hf_model) -> bool:
    return type(hf_model).__name__ in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM")


def pick(logits: torch.Tensor, *, temperature: float, top_p: float, generator) -> torch.Tensor:
    """One token per row: argmax at temperature 0, else a draw from softmax(logits / T) cut to the smallest
    set of tokens whose probability reaches top_p (HF's TopPLogitsWarper: the top token always stays)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p   # mass of the tokens ranked above each one
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
