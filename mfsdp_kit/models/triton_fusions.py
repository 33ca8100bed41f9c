"""RoPE's rotation and SwiGLU, forward and backward, in the kit's own Triton kernels
(`EngineConfig.kernels.fusion_kernels`: "auto", the default, takes them on a GPU that runs them,
`models.support.triton_available`; "torch" takes `models.fusions`' torch.compile of the same math).

Why not torch.compile: on a fresh machine most of the first GRPO update went to torch.compile (dynamo, AOT autograd
and inductor for the rotation of q and of k and for SwiGLU, each forward and backward), and seconds again in every
new process with inductor's cache warm (measured: docs/benchmarks.md, "The first update's compile" and "Figures that
used to live in docstrings"). A Triton kernel has no graph to trace: Triton compiles each of the six below once per
dtype and head count (not per token count) and keeps it in its disk cache, so a new process loads them in
milliseconds.

The math is `models.fusions`' and megatron's:
  - RoPE (megatron's `_rotate_half`, not interleaved): out = [lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi]
    of each head's halves, dims past cos's width passed through. It is linear in t, so its backward is the
    transposed map, the same kernel with the signs of sin swapped (BACKWARD): no saved activation, only cos and sin.
  - SwiGLU (megatron's `swiglu` / `swiglu_back`): out = silu(gate) * up of the [..., 2 * ffn] input's halves;
    d gate = g * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))) * up, d up = g * silu(gate).
Arithmetic in fp32, one rounding to the input's dtype at each store, as inductor's fused kernels round.

Until a backward has run, each forward also asks for its backward's kernel to be compiled on a background thread
(`triton_launch.compile_soon`: the gradient is shaped like the forward's output), so a first update's backward finds
it compiled instead of compiling it in turn.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import next_power_of_2

from .triton_launch import compile_soon, launch

SWIGLU_BLOCK = 1024
"""Elements of one row's ffn half per program."""


def _rope_launch(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backward: bool,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple, tuple, dict]:
    """(out, grid, args, kwargs) of `_rope_kernel` for the rotation (or its transpose, `backward`) of `t`
    [s, b, heads, dim] (any strides, the last dim dense) by `cos` / `sin` [s or 1, rot_dim] (rot_dim <= dim, even)
    into `out` (default: a new contiguous tensor of t's shape and dtype)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    s, b, heads, dim = t.shape
    half = cos.shape[-1] // 2
    if 2 * half > dim or cos.shape[-1] % 2 or cos.numel() // cos.shape[-1] not in (1, s):
        raise ValueError(f"RoPE's cos/sin {tuple(cos.shape)} do not fit t {tuple(t.shape)}: one row of an even width "
                         f"<= {dim} per position (or one for all)")
    cos, sin = (x.reshape(-1, 2 * half).contiguous().expand(s, -1) for x in (cos, sin))   # rows dense, as read
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device) if out is None else out
    block_h = min(next_power_of_2(heads), max(1, 4096 // next_power_of_2(dim)))   # at most ~4k elements a program
    args = (t, cos, sin, out, b, heads, t.stride(0), t.stride(1), t.stride(2), cos.stride(0), sin.stride(0))
    return out, (s * b, triton.cdiv(heads, block_h)), args, dict(
        BACKWARD=backward, HALF=half, HALF_PAD=next_power_of_2(half), DIM=dim,
        PASS_PAD=next_power_of_2(max(1, dim - 2 * half)), BLOCK_H=block_h, num_warps=4)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backward: bool) -> torch.Tensor:
    """The rotation (or its transpose, `backward`) of `t` by cos / sin (`_rope_launch`): a new contiguous tensor."""
    out, grid, args, kwargs = _rope_launch(t, cos, sin, backward=backward)
    launch(_rope_kernel, grid, *args, **kwargs)
    return out


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        out = _rope(t, cos, sin, backward=False)
        if ctx.needs_input_grad[0] and "rope" not in _BACKWARD_RAN:   # its backward's kernel, for a grad like out
            _, grid, args, kwargs = _rope_launch(out, cos, sin, backward=True, out=out)
            ctx.compiled = compile_soon(_rope_kernel, grid, *args, **kwargs)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        _ready(ctx, "rope")
        return _rope(grad, cos, sin, backward=True), None, None


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`models.fusions._rotate` (not interleaved) in one Triton kernel per direction: `t` [s, b, heads, dim] rotated
    by `cos` / `sin` [s or 1, 1, 1, rot_dim] in t's dtype (megatron's layout)."""
    return _Rotate.apply(t, cos, sin)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        y = y.contiguous()
        ctx.save_for_backward(y)
        rows, ffn = y.numel() // y.shape[-1], y.shape[-1] // 2
        out = torch.empty(*y.shape[:-1], ffn, dtype=y.dtype, device=y.device)
        grid = (rows, triton.cdiv(ffn, SWIGLU_BLOCK))
        launch(_swiglu_kernel, grid, y, out, ffn, BLOCK=SWIGLU_BLOCK, num_warps=4)
        if ctx.needs_input_grad[0] and "swiglu" not in _BACKWARD_RAN:   # its backward's kernel, for a grad like out
            ctx.compiled = compile_soon(_swiglu_back_kernel, grid, out, y, y, ffn, BLOCK=SWIGLU_BLOCK, num_warps=4)
        return out

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        _ready(ctx, "swiglu")
        grad = grad.contiguous()
        rows, ffn = y.numel() // y.shape[-1], y.shape[-1] // 2
        dy = torch.empty_like(y)
        launch(_swiglu_back_kernel, (rows, triton.cdiv(ffn, SWIGLU_BLOCK)), grad, y, dy, ffn, BLOCK=SWIGLU_BLOCK,
               num_warps=4)
        return dy


_BACKWARD_RAN: set[str] = set()
"""The functions ("rope", "swiglu") whose backward has run in this process: their forward stops asking for background
compiles (host work on every call: docs/benchmarks.md, "Figures that used to live in docstrings"), since the shapes a
model uses are compiled by then (a new one compiles at its launch)."""


def _ready(ctx, name: str) -> None:
    """In `name`'s backward: wait for the background compile its forward asked for, if any (compiling the kernel here
    too would race the background thread to fill Triton's cache)."""
    compiled = getattr(ctx, "compiled", None)
    if compiled is not None:
        compiled.result()
    _BACKWARD_RAN.add(name)


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of `y` [..., 2 * ffn] (gate first, megatron's `swiglu`), forward and backward one Triton
    kernel each: [..., ffn] in y's dtype."""
    return _SwiGLU.apply(y)


@triton.jit
def _rope_kernel(T, COS, SIN, OUT, B, HEADS, st_s, st_b, st_h, scos, ssin, BACKWARD: tl.constexpr,
                 HALF: tl.constexpr, HALF_PAD: tl.constexpr, DIM: tl.constexpr, PASS_PAD: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)   # s * B + b; 64-bit: strides of a fused qkv output times 16k tokens
    pos, row = tok // B, tok % B
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    cos_lo = tl.load(COS + pos * scos + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(COS + pos * scos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(SIN + pos * ssin + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(SIN + pos * ssin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    ok = (h[:, None] < HEADS) & d_ok[None, :]
    src = T + pos * st_s + row * st_b + h[:, None] * st_h + d[None, :]
    lo = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:   # the transpose of [[cos_lo, -sin_lo], [sin_hi, cos_hi]]
        new_lo, new_hi = lo * cos_lo + hi * sin_hi, hi * cos_hi - lo * sin_lo
    else:
        new_lo, new_hi = lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi
    dst = OUT + (tok * HEADS + h[:, None]) * DIM + d[None, :]
    tl.store(dst, new_lo.to(OUT.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, new_hi.to(OUT.dtype.element_ty), mask=ok)
    if DIM > 2 * HALF:   # dims past the rotary width pass through
        p = tl.arange(0, PASS_PAD)
        ok = (h[:, None] < HEADS) & (p[None, :] < DIM - 2 * HALF)
        rest = T + pos * st_s + row * st_b + h[:, None] * st_h + 2 * HALF + p[None, :]
        tl.store(OUT + (tok * HEADS + h[:, None]) * DIM + 2 * HALF + p[None, :], tl.load(rest, mask=ok), mask=ok)


@triton.jit
def _swiglu_kernel(Y, OUT, FFN, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < FFN
    gate = tl.load(Y + r * 2 * FFN + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(Y + r * 2 * FFN + FFN + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + r * FFN + c, (gate * tl.sigmoid(gate) * up).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_back_kernel(G, Y, DY, FFN, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < FFN
    g = tl.load(G + r * FFN + c, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(Y + r * 2 * FFN + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(Y + r * 2 * FFN + FFN + c, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    tl.store(DY + r * 2 * FFN + c, (g * sig * (1 + gate * (1 - sig)) * up).to(DY.dtype.element_ty), mask=ok)
    tl.store(DY + r * 2 * FFN + FFN + c, (g * gate * sig).to(DY.dtype.element_ty), mask=ok)
