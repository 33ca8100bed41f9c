"""The decoder of the architectures the kit's own rollout loop runs, computed from a slot KV cache.

Which architectures, and how each one's layer differs (q/k norms, a routed MoE MLP), is their spec's
(`models.archs`, `ArchSpec.decoder`): this module names none and asks `hooks(hf_model)`.

The naive way (HF `forward` with a `DynamicCache`) launches ~25 kernels per layer from Python at every token
and keeps q, k, v and gate, up as separate GEMMs. Here:
  - the weights are the HF model's own, regrouped once in place (`fuse_projections`): q/k/v of a layer
    become views of one [q + k + v, hidden] tensor and gate/up views of one [2 * ffn, hidden] tensor, so
    a step runs one GEMM for each group, not three or two;
    the HF modules still work and `sync.load_into` still copies into them by name, into the views;
  - the cache is one K and one V tensor per layer, [rows, kv_heads, slots, head_dim]; row r holds one
    sequence from slot 0, so rows of different lengths share a step (continuous batching, `engine.py`);
    a decode step writes each row's token at that row's position `pos[r]` and attends to slots <= pos[r];
  - a sliding-window layer (`layer_windows`, from the config: every layer, or those `layer_types` names) attends to
    the last `window` slots only, in prefill and decode alike;
  - decode attention is one SDPA per layer in the grouped-query layout (`enable_gqa`: no `repeat_kv` copy) with one
    additive mask per step, [b, 1, 1, slots]: on a GPU cuDNN's kernel, which reads every row up to the slot bucket,
    each KV head once per query head, and builds a plan per (batch, slots) shape. Tried and slower than cuDNN: a
    visibility-lane layout, flex_attention (its block mask alone cost more than the kernel), flash attention's
    varlen kernel with `seqused_k` (one query a row: it splits no row's keys over blocks), and q grouped per KV
    head as a 4-query sequence (docs/benchmarks.md). `DecodeConfig.kernels` "auto" (the default) runs
    `kernels/attention.py`'s Triton kernels instead: each row reads its own keys up to its position, once per KV head
    for its query group, split over the keys at small batch (flash-decoding);
  - the elementwise work between the GEMMs (RoPE + the cache write, act * up, residual add + RMSNorm) is a few
    functions (`Glue`): on a GPU three Triton kernels (`kernels/elementwise.py`; with `DecodeConfig.fuse_rope`, RoPE
    and the cache write inside the attention kernel instead), or with `kernels="torch"` compiled once with symbolic
    batch and cache sizes;
  - the logits are the LM head of the step's last hidden state, outside any CUDA graph (nano-vllm's split).
  - with `DecodeConfig.weights="fp8"` the four projections read e4m3 copies of their weights (`project`, `fp8_weights`).
  - a tool's output joins a paused row through `extend`: a prefill whose tokens start at the row's next slot and
    attend to its cached slots, where the naive way prefills the whole sequence again as a new prompt.
Every function computes the HF model's own function: tests/rl/rollout/test_engine.py compares greedy tokens
with `generate` for every architecture in SUPPORTED (those whose spec has decoder hooks), written by transformers
itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config import ConfigError
from ...models import archs
from ...models.archs import SUPPORTED  # noqa: F401 (importable here as before)


def hooks(hf_model) -> archs.Decoder:
    """How this decoder computes `hf_model`'s layers (its architecture's `ArchSpec.decoder`: pre-norm attention
    with q/k/v/o projections, optional biases and q/k norms, RoPE from the model's rotary module, then the MLP);
    a ConfigError naming what it cannot run."""
    spec = archs.spec_for(hf_model)
    if spec is None or spec.decoder is None:
        raise ConfigError(f"the kit's rollout loop does not run {type(hf_model).__name__}; allowed: "
                          f"{', '.join(archs.SUPPORTED)} (HFRollout runs any causal LM)")
    return spec.decoder


def check_model(hf_model) -> None:
    """ConfigError naming what this decoder cannot run, before anything is allocated."""
    hooks(hf_model)


def layer_windows(hf_model) -> list[int | None]:
    """Per layer, the sliding window HF attends with (a query at q sees keys q - w < k <= q), or None for full
    attention: the config's `sliding_window` on every layer; where the config lists `layer_types`, only on its
    "sliding_attention" layers; none when `use_sliding_window` is false (a default of some families)."""
    c = hf_model.config
    window = getattr(c, "sliding_window", None)
    if window is None or not getattr(c, "use_sliding_window", True):
        return [None] * len(hf_model.model.layers)
    types = getattr(c, "layer_types", None) or ["sliding_attention"] * len(hf_model.model.layers)
    return [window if t == "sliding_attention" else None for t in types]


def is_moe(hf_model) -> bool:
    """Whether the model's MLP routes tokens to experts (`Decoder.moe`): no CUDA graph captures its step."""
    return hooks(hf_model).moe


# ---- the weights -----------------------------------------------------------------------------
def fuse_projections(hf_model) -> bool:
    """Regroup each layer's q/k/v (and a dense MLP's gate/up) weights and biases into one tensor whose slices
    become the modules' parameters (module docstring). Idempotent; no extra memory once the old tensors go. Returns
    whether any group was (re)made: a Parameter re-pointed since (`load_state_dict(assign=True)`, an assignment)
    is no longer a view of its group, so the group is made again from the modules' current tensors, and CUDA graphs
    captured on the old group must be dropped."""
    made, dense = False, not hooks(hf_model).moe
    for layer in hf_model.model.layers:
        made |= _fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv")
        if dense:
            made |= _fuse(layer.mlp, ("gate_proj", "up_proj"), "gate_up")
    return made


def _fuse(parent: torch.nn.Module, names: tuple[str, ...], group: str) -> bool:
    modules = [getattr(parent, n) for n in names]
    made = False
    for kind in ("weight", "bias"):
        parts = [getattr(m, kind) for m in modules]
        fused = getattr(parent, f"kit_{group}_{kind}", None)
        if parts[0] is None or (fused is not None and _views_of(parts, fused)):
            continue
        whole = torch.cat([p.detach() for p in parts])
        start = 0
        for m, p in zip(modules, parts):
            setattr(m, kind, torch.nn.Parameter(whole[start:start + p.shape[0]], requires_grad=False))
            start += p.shape[0]
        object.__setattr__(parent, f"kit_{group}_{kind}", whole)   # a plain attribute: not in the state dict
        made = True
    return made


def _views_of(parts: list[torch.Tensor], fused: torch.Tensor) -> bool:
    """Is each of `parts` the next slice of `fused`, in order?"""
    offset = 0
    for p in parts:
        if p.data_ptr() != fused.data_ptr() + offset * fused.element_size() or not p.is_contiguous():
            return False
        offset += p.numel()
    return offset == fused.numel()


def projections(layer, h: torch.Tensor, *, head_dim: int, clip_qkv: float | None, qk_norm: str | None):
    """q [..., heads, D], k and v [..., kv_heads, D] of `h` [..., hidden], q/k norms applied where `qk_norm`
    (`Decoder.qk_norm`) says, and clamped to +-`clip_qkv` (config.clip_qkv; None: not clamped)."""
    attn = layer.self_attn
    lead = h.shape[:-1]
    sizes = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
    bias = getattr(attn, "kit_qkv_bias", None)
    q, k, v = project(attn, "qkv", h, lambda y: F.linear(y, attn.kit_qkv_weight, bias)).split(sizes, -1)
    if qk_norm == "heads":   # over all heads at once
        q, k = rms(attn.q_norm, q), rms(attn.k_norm, k)
    if clip_qkv is not None:
        q, k, v = (t.clamp(-clip_qkv, clip_qkv) for t in (q, k, v))
    q, k, v = (t.reshape(*lead, -1, head_dim) for t in (q, k, v))
    if qk_norm == "head":   # per head
        q, k = rms(attn.q_norm, q), rms(attn.k_norm, k)
    return q, k, v


def mlp(layer, x: torch.Tensor, glue: "Glue") -> torch.Tensor:
    """The layer's MLP of its normed input: gate/up as one GEMM when dense, the HF module when MoE."""
    m = layer.mlp
    fused = getattr(m, "kit_gate_up_weight", None)
    if fused is None:   # an MoE block wants [B, T, hidden] and may also return router logits
        out = m(x if x.dim() == 3 else x[:, None])
        out = out[0] if isinstance(out, tuple) else out
        return out if x.dim() == 3 else out[:, 0]
    gate_up = project(m, "gate_up", x, lambda y: F.linear(y, fused))
    return project(m, "down", glue.gated(gate_up, m.act_fn), m.down_proj)


def project(owner, group: str, x: torch.Tensor, plain) -> torch.Tensor:
    """`plain(x)` (the bf16 GEMM), or its FP8 twin where the runner keeps one on `owner` (`owner.kit_<group>_fp8`,
    `fp8_weights.Fp8Linear`: `DecodeConfig.weights="fp8"`); groups qkv and o of `self_attn`, gate_up and down of
    `mlp`."""
    fp8 = getattr(owner, f"kit_{group}_fp8", None)
    return plain(x) if fp8 is None else fp8(x)


def o_proj(layer, out: torch.Tensor) -> torch.Tensor:
    """The attention's output projection (`project`)."""
    return project(layer.self_attn, "o", out, layer.self_attn.o_proj)


def rms(norm, x: torch.Tensor) -> torch.Tensor:
    """An HF RMSNorm module's function in one fused kernel (`F.rms_norm`) instead of its ~7 (fp32 upcast,
    pow, mean, rsqrt, mul, cast, mul); the same arithmetic, rounded once. Other norms: the module itself."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm(x) if eps is None else F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF's `apply_rotary_pos_emb` applies it (rotate_half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rope_table(hf_model, *, slots: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary module's (cos, sin) for positions 0..slots-1, [slots, head_dim] each."""
    cos, sin = hf_model.model.rotary_emb(like, torch.arange(slots, device=like.device)[None])
    return cos[0], sin[0]


def head(hf_model, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, vocab] of the last hidden states `x` [B, hidden]."""
    return hf_model.lm_head(rms(hf_model.model.norm, x))


# ---- the elementwise glue between the GEMMs --------------------------------------------------
def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_rows: torch.Tensor, v_rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Rotary q and k of one token per row; k and v written into the cache's slot rows `k_rows`/`v_rows`
    ([rows * kv_heads * slots, D] views of the whole cache) at `where` [b * kv_heads]. Returns q [b, heads, 1, D]."""
    k_rows.index_copy_(0, where, rotate(k, cos, sin).flatten(0, 1))
    v_rows.index_copy_(0, where, v.flatten(0, 1))
    return rotate(q, cos, sin)[:, :, None]


def gated(gate_up: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up of the fused gate/up GEMM's output."""
    gate, up = gate_up.chunk(2, -1)
    return act(gate) * up


def add_rms(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): the residual add and the next RMSNorm in one pass when compiled."""
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


class Glue:
    """The decode step's functions between the GEMMs (RoPE + the cache write, attention, act * up, residual add +
    RMSNorm), in one of three `mode`s:
      - "triton" (`DecodeConfig.kernels` "auto" or "triton" on a GPU that runs them, `model_runner.glue_mode`):
        `elementwise`'s and `attention`'s Triton kernels; no dynamo frame;
      - "compiled" (on a GPU with `kernels="torch"`, or one the Triton kernels do not run on): the torch functions
        below, each `torch.compile`d once for every batch and cache size (the batch and cache dimensions symbolic:
        `maybe_mark_dynamic`; `fullgraph=True` raises instead of running eager glue in silence), attention through SDPA
        over an additive mask;
      - "eager": the same torch functions as they are (CPU tests run this).
    A model whose MLP is not SiLU-gated takes the torch function for act * up in every mode. `fuse_rope` (with
    "triton", `DecodeConfig.fuse_rope`): RoPE and the cache write inside the attention kernel (`rope_attend`)."""

    def __init__(self, *, mode: str, fuse_rope: bool = False):
        self.mode = mode
        self.fuse_rope = fuse_rope and mode == "triton"
        wrap = (lambda f: torch.compile(f, fullgraph=True)) if mode == "compiled" else (lambda f: f)
        self._rope_store, self._gated, self._add_rms = wrap(rope_store), wrap(gated), wrap(add_rms)
        if mode == "triton":   # imported here: Triton loads only for the engines that use it
            from .kernels import attention, elementwise
            self._rope_store, self._add_rms = elementwise.rope_store, elementwise.add_rms
            self._silu_gated, self._decode_attention = elementwise.gated, attention.decode_attention

    @property
    def kernel_attention(self) -> bool:
        """Whether attention runs in the Triton kernels (each row reads its own keys: no mask, no slot bucket)."""
        return self.mode == "triton"

    def _dynamic(self, *tensors: torch.Tensor) -> None:
        if self.mode == "compiled":
            for t in tensors:
                torch._dynamo.maybe_mark_dynamic(t, 0)

    def rope_store(self, q, k, v, cos, sin, k_rows, v_rows, where) -> torch.Tensor:
        self._dynamic(q, k, v, cos, sin, k_rows, v_rows, where)
        return self._rope_store(q, k, v, cos, sin, k_rows, v_rows, where)

    def gated(self, gate_up: torch.Tensor, act) -> torch.Tensor:
        if self.mode == "triton" and type(act).__name__ in ("SiLU", "SiLUActivation"):
            return self._silu_gated(gate_up)
        self._dynamic(gate_up)
        return self._gated(gate_up, act)

    def add_rms(self, x: torch.Tensor, delta: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms` with an HF RMSNorm module's weight and epsilon (another norm: its module, eagerly)."""
        eps = getattr(norm, "variance_epsilon", None)
        if eps is None:
            x = x + delta
            return x, norm(x)
        self._dynamic(x, delta)
        return self._add_rms(x, delta, norm.weight, eps)

    def rope_attend(self, q, k, v, cos, sin, k_cache, v_cache, pos, where, bias, *, slots: int, window: int | None,
                    scale: float) -> torch.Tensor:
        """`rope_store` then `attend`: q [b, heads, D], k and v [b, kv_heads, D] of the step's tokens as the q/k/v
        GEMM left them, cos/sin [b, 1, D]; k, v written into the cache's [rows, kv_heads, all slots, D] tensors at
        `where` (flat slot rows of their [-1, D] views). With `fuse_rope`, one kernel (`attention.decode_attention`
        with `new`; `where` unused). Returns [b, heads * D]."""
        if self.fuse_rope:
            return self._decode_attention(q, k_cache, v_cache, pos, slots=slots, window=window, scale=scale,
                                          new=(k, v, cos[:, 0], sin[:, 0])).reshape(q.shape[0], -1)
        dim = q.shape[-1]
        q = self.rope_store(q, k, v, cos, sin, k_cache.view(-1, dim), v_cache.view(-1, dim), where)
        return self.attend(q, k_cache, v_cache, pos, bias, slots=slots, window=window, scale=scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, bias, *,
               slots: int, window: int | None, scale: float) -> torch.Tensor:
        """Attention of `q` [b, heads, 1, D] (one query a row at `pos` [b]) over the first b rows of the cache's
        first `slots` slots: the Triton kernels (each row its own keys), or SDPA with `bias` [b, 1, 1, slots]
        (`decode` makes it only for SDPA). Returns [b, heads * D]."""
        b = q.shape[0]
        if self.kernel_attention:
            return self._decode_attention(q[:, :, 0], k_cache, v_cache, pos, slots=slots, window=window,
                                          scale=scale).reshape(b, -1)
        return F.scaled_dot_product_attention(q, k_cache[:b, :, :slots], v_cache[:b, :, :slots], attn_mask=bias,
                                              enable_gqa=True, scale=scale).reshape(b, -1)


EAGER = Glue(mode="eager")


# ---- prefill and decode ----------------------------------------------------------------------
def prefill(hf_model, ids: torch.Tensor, lengths: torch.Tensor, cache, rows: torch.Tensor, rope, *, head_dim: int,
            clip_qkv: float | None, windows: list[int | None]) -> torch.Tensor:
    """Run prompts `ids` [k, L] (left-aligned, `lengths` [k] real tokens each) and write their K, V into cache rows
    `rows` [k], slots 0..L-1 (a slot past a row's length holds junk that no step reads: `decode` masks it).
    Returns the logits of each prompt's last token [k, vocab]."""
    k_rows, L = ids.shape
    m, qk_norm = hf_model.model, hooks(hf_model).qk_norm
    x = m.embed_tokens(ids)
    cos, sin = (t[:L][None, :, None, :] for t in rope)
    keys = torch.arange(L, device=ids.device)
    # causal and inside the prompt; a pad query still sees slot 0, so no row is all-masked (NaN)
    mask = (keys[None, :] <= keys[:, None])[None, None] & (keys < lengths[:, None])[:, None, None, :]
    windowed = {w: mask & (keys[None, :] > keys[:, None] - w)[None, None] for w in set(windows) if w is not None}
    for layer, (k_cache, v_cache), window in zip(m.layers, cache, windows):
        h = rms(layer.input_layernorm, x)
        q, k, v = projections(layer, h, head_dim=head_dim, clip_qkv=clip_qkv, qk_norm=qk_norm)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k_cache[rows, :, :L], v_cache[rows, :, :L] = k, v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if window is None else windowed[window],
                                             enable_gqa=True, scale=_scale(layer, head_dim))
        x = x + o_proj(layer, out.transpose(1, 2).reshape(k_rows, L, -1))
        x = x + mlp(layer, rms(layer.post_attention_layernorm, x), EAGER)
    return head(hf_model, x[torch.arange(k_rows, device=ids.device), lengths - 1])


def extend(hf_model, ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, cache, rows: torch.Tensor, rope, *,
           head_dim: int, clip_qkv: float | None, windows: list[int | None]) -> torch.Tensor:
    """`prefill` continued: append `ids` [k, L] (`lengths` [k] real tokens each) to cache rows `rows` at slots
    starts[j] .. starts[j] + lengths[j] - 1, each token attending to its row's cached slots before it (a tool's
    output after the row's prompt and completion so far: nothing before `starts` is recomputed). Only real tokens
    are written. Returns the logits of each row's last new token [k, vocab]."""
    k_rows, L = ids.shape
    m, qk_norm = hf_model.model, hooks(hf_model).qk_norm
    last = rope[0].shape[0] - 1   # a pad token's slot may lie past the cache: clamped, it is never written
    pos = (starts[:, None] + torch.arange(L, device=ids.device)).clamp(max=last)   # [k, L] the tokens' slots
    real = torch.arange(L, device=ids.device)[None] < lengths[:, None]
    seen = int((starts + lengths).max())
    slot = torch.arange(seen, device=ids.device)
    mask = (slot <= pos[..., None])[:, None]                                     # [k, 1, L, seen]
    windowed = {w: mask & (slot > pos[..., None] - w)[:, None] for w in set(windows) if w is not None}
    cos, sin = (t[pos][:, :, None, :] for t in rope)
    where_rows, where_slots = rows[:, None].expand(k_rows, L)[real], pos[real]
    x = m.embed_tokens(ids)
    for layer, (k_cache, v_cache), window in zip(m.layers, cache, windows):
        h = rms(layer.input_layernorm, x)
        q, k, v = projections(layer, h, head_dim=head_dim, clip_qkv=clip_qkv, qk_norm=qk_norm)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache[where_rows, :, where_slots], v_cache[where_rows, :, where_slots] = k[real], v[real]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[rows, :, :seen], v_cache[rows, :, :seen],
                                             attn_mask=mask if window is None else windowed[window],
                                             enable_gqa=True, scale=_scale(layer, head_dim))
        x = x + o_proj(layer, out.transpose(1, 2).reshape(k_rows, L, -1))
        x = x + mlp(layer, rms(layer.post_attention_layernorm, x), EAGER)
    return head(hf_model, x[torch.arange(k_rows, device=ids.device), lengths - 1])


def decode(hf_model, tok: torch.Tensor, pos: torch.Tensor, cache, rope, *, slots: int, head_dim: int,
           clip_qkv: float | None, glue: Glue, windows: list[int | None]) -> torch.Tensor:
    """One token per row: `tok` [b] at position `pos` [b] written into slot pos[r] of cache row r (the first b
    rows of `cache`'s whole [rows, kv_heads, all slots, D] tensors), attending to slots <= pos[r] among the first
    `slots` (every row's pos < slots), or to the last `windows[i]` of them in a sliding-window layer i. Returns the
    final norm's output [b, hidden]: `hf_model.lm_head` of it is the logits, computed outside a CUDA graph so no
    graph keeps a [b, vocab] output of its own."""
    m, qk_norm = hf_model.model, hooks(hf_model).qk_norm
    b = tok.shape[0]
    k0 = cache[0][0]
    kv_heads, all_slots = k0.shape[1], k0.shape[2]
    where = None   # each row's K/V heads at its slot, as rows of the cache's [-1, D] views (the fused kernel: its own)
    if not glue.fuse_rope:
        heads = torch.arange(kv_heads, device=tok.device)
        where = ((torch.arange(b, device=tok.device)[:, None] * kv_heads + heads) * all_slots + pos[:, None]).flatten()
    biases = {} if glue.kernel_attention else masks(pos, slots=slots, windows=windows, dtype=k0.dtype)
    cos, sin = (t[pos][:, None, :] for t in rope)
    x = m.embed_tokens(tok)
    h = rms(m.layers[0].input_layernorm, x)
    for i, (layer, (k_cache, v_cache), window) in enumerate(zip(m.layers, cache, windows)):
        q, k, v = projections(layer, h, head_dim=head_dim, clip_qkv=clip_qkv, qk_norm=qk_norm)
        out = glue.rope_attend(q, k, v, cos, sin, k_cache, v_cache, pos, where, biases.get(window), slots=slots,
                               window=window, scale=_scale(layer, head_dim))
        x, h = glue.add_rms(x, o_proj(layer, out), layer.post_attention_layernorm)
        following = m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm
        x, h = glue.add_rms(x, mlp(layer, h, glue), following)
    return h


def masks(pos: torch.Tensor, *, slots: int, windows: list[int | None], dtype) -> dict:
    """SDPA's additive masks of a decode step, [b, 1, 1, slots] per window (None: full attention), shared by every
    layer and head: 0 where row r sees slot s (s <= pos[r], and s > pos[r] - window), -inf elsewhere."""
    slot = torch.arange(slots, device=pos.device)
    visible = slot <= pos[:, None]

    def bias_of(seen: torch.Tensor) -> torch.Tensor:
        return torch.zeros(seen.shape, dtype=dtype, device=pos.device).masked_fill_(~seen, float("-inf"))[:, None, None]
    out = {None: bias_of(visible)}
    out.update({w: bias_of(visible & (slot > pos[:, None] - w)) for w in set(windows) if w is not None})
    return out


def _scale(layer, head_dim: int) -> float:
    return getattr(layer.self_attn, "scaling", head_dim ** -0.5)
