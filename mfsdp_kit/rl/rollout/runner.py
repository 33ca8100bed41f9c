"""The rollout engine's device state across calls (nano-vllm's model runner): the KV cache, the rotary table, each
row's next token and position (the static buffers every decode step reads), and the decode steps themselves, one per
batch and slot bucket.

On a GPU the steps are CUDA graphs in one memory pool, all captured when the cache is made (`Runner.cache_for`), for
the fixed set of buckets a call on that cache can ask for (`buckets`; with the Triton attention kernels one per batch
bucket, `Runner.step_slots`): a call never captures inside its decode loop, and a kept cache's later calls capture
nothing. Elsewhere, or for MoE models (their routing syncs the host),
a step is the same code run eagerly, so CPU tests cover it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...models import triton_launch
from ...models.support import triton_available
from .decoder import EAGER, Glue, decode, is_moe, prefill, rope_table
from .sampling import pick
from .schedule import batch_bucket


@dataclass
class Cache:
    """The device state of one cache shape: KV per layer, rotary table, each row's next token and position, steps."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    rope: tuple[torch.Tensor, torch.Tensor]
    tok: torch.Tensor
    pos: torch.Tensor
    steps: dict = field(default_factory=dict)
    """(batch, slots) -> the step: a graph's replay on a GPU, else the eager decode."""
    pool: object = None
    """The graphs' memory pool (made with the first graph)."""
    transient_bytes: int = 0
    """The measured peak the rows were sized beside (`Runner.transient_bytes`; 0 off a GPU)."""

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, slots)."""
        return self.kv[0][0].shape[0], self.kv[0][0].shape[2]


def buckets(*, rows: int, slots: int, slot_bucket: int, min_batch: int = 2,
            per_doubling: int = 2) -> list[tuple[int, int]]:
    """Every (batch, slots) a decode step on a `rows` x `slots` cache can run: the batch buckets of 1..rows live rows
    (`schedule.batch_bucket`, at least `min_batch`, `per_doubling` as there) times the multiples of `slot_bucket` up to
    `slots`, largest first (the pool's biggest buffers are made first and the smaller graphs reuse them)."""
    batches = sorted({batch_bucket(n, rows=rows, least=min_batch, per_doubling=per_doubling)
                      for n in range(1, rows + 1)}, reverse=True)
    return [(b, s) for b in batches for s in range(slots, 0, -slot_bucket)]


class Runner:
    """The model's decode state and steps (module docstring); `ContinuousRollout` owns one."""

    def __init__(self, model, *, config, head_dim: int, clip_qkv, windows):
        self.model, self.config, self.head_dim, self.clip_qkv, self.windows = model, config, head_dim, clip_qkv, windows
        self.cache: Cache | None = None
        self.capture_s, self.made = 0.0, 0
        """Seconds spent making steps (graph warm-ups and captures, the glue's compile in the first) and the steps
        made, summed over the runner's life."""
        self.kernels_s = 0.0
        """Of `capture_s`: seconds compiling the Triton kernels ahead of the captures (`compile_kernels`)."""
        self._glue: Glue | None = None
        self._compiled = None
        self.probes: dict[tuple[int, int, int], int] = {}
        """(rows, slots, prefill tokens) -> the measured peak of `transient_bytes`: one probe per shape."""

    def transient_bytes(self, *, rows: int, slots: int, longest: int) -> int:
        """Peak device bytes a call on a `rows` x `slots` cache needs beside the cache, its prompts at most `longest`
        tokens (a GPU; 0 elsewhere), measured once per shape; the largest of:
          - a prefill group (`schedule.prefill_groups`: rows x their longest <= `prefill_tokens`, a longer prompt
            alone): max(prefill_tokens, longest) tokens in rows of the call's longest possible length, run on a
            scratch cache whose own bytes are not counted (activations, the attention mask, logits);
          - one decode step's sampling at `rows` rows (logits, the top-p sort, the exponential draws);
          - a compaction's copies (`run.Run.move`: one layer's K and V of half the rows), by their size.
        Not counted: the graphs' pool (a decode step's activations, a few MB) and a tool output's `extend`.
        `ContinuousRollout.fitting_rows` sizes the cache beside it. Resets torch's peak counter, as `perf.peaks`
        does at its phase boundaries."""
        p = next(self.model.parameters())
        if p.device.type != "cuda":
            return 0
        tokens = max(self.config.prefill_tokens, longest)
        if (rows, slots, tokens) not in self.probes:
            moved = (rows + 1) // 2 * self.row_bytes(slots) // len(self.model.model.layers)
            self.probes[(rows, slots, tokens)] = max(
                _peak(p.device, lambda: self._probe_prefill(tokens=tokens, slots=slots)),
                _peak(p.device, lambda: self._probe_sampling(rows)), moved)
        return self.probes[(rows, slots, tokens)]

    @torch.no_grad()
    def _probe_prefill(self, *, tokens: int, slots: int) -> int:
        """A prefill of at least `tokens` tokens in rows of min(slots, tokens) into a scratch cache; its bytes."""
        p = next(self.model.parameters())
        length = min(slots, tokens)
        rows = -(-tokens // length)
        kv = self._zero_kv(rows, length)
        rope = rope_table(self.model, slots=length, like=kv[0][0])
        ids = torch.zeros(rows, length, dtype=torch.long, device=p.device)
        prefill(self.model, ids, torch.full((rows,), length, device=p.device), kv, torch.arange(rows, device=p.device),
                rope, head_dim=self.head_dim, clip_qkv=self.clip_qkv, windows=self.windows)
        return sum(t.nbytes for pair in kv for t in pair) + sum(t.nbytes for t in rope)

    @torch.no_grad()
    def _probe_sampling(self, rows: int) -> int:
        """One decode step's head and top-p sampling at `rows` rows (the sort's worst case: top_p < 1)."""
        p = next(self.model.parameters())
        hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=p.dtype, device=p.device)
        pick(self.model.lm_head(hidden), temperature=1.0, top_p=0.5,
             generator=torch.Generator(device=p.device).manual_seed(0))
        return 0

    def row_bytes(self, slots: int) -> int:
        """Bytes of one cache row: layers x (K + V) x kv_heads x slots x head_dim x element size."""
        c, p = self.model.config, next(self.model.parameters())
        return len(self.model.model.layers) * 2 * c.num_key_value_heads * slots * self.head_dim * p.element_size()

    @torch.no_grad()   # decode is inference: a graph captured with grad on would record autograd's bookkeeping
    def cache_for(self, rows: int, slots: int, *, transient_bytes: int = 0) -> Cache:
        """The cache for `rows` x `slots`: the kept one when it has these rows and at least these slots (its steps
        replay at once), else a new one (sized beside `transient_bytes`), the old freed first, with every step of
        `buckets` made now. Stale slots are harmless: a slot is read only once this call's prefill or decode has
        written it."""
        if self.cache is not None and self.cache.shape[0] == rows and self.cache.shape[1] >= slots:
            return self.cache
        self.cache = None
        p = next(self.model.parameters())
        kv = self._zero_kv(rows, slots)
        idx = torch.zeros(rows, dtype=torch.long, device=p.device)
        self.cache = Cache(kv=kv, rope=rope_table(self.model, slots=slots, like=kv[0][0]), tok=idx, pos=idx.clone(),
                           transient_bytes=transient_bytes)
        if self.graphed():
            steps = buckets(rows=rows, slots=slots, slot_bucket=self.config.slot_bucket, min_batch=self.min_batch(),
                            per_doubling=self.config.buckets_per_doubling)
            self.compile_kernels(steps=steps)
            for batch, s in steps:
                self.step(batch, s)
        return self.cache

    def compile_kernels(self, *, steps: list[tuple[int, int]]) -> None:
        """Compile the Triton kernels of every step in `steps` at once, before any is captured
        (`models.triton_launch`: each distinct step runs once with its kernel launches recorded instead of run, then
        a thread per CPU core compiles them); nothing with the torch glue or `DecodeConfig.compile_ahead` False.
        Counted in `capture_s` and `kernels_s`."""
        if not (self.config.compile_ahead and self.glue(True).kernel_attention):
            return
        t0 = time.perf_counter()
        with triton_launch.ahead() as launches:
            for batch, slots in dict.fromkeys((b, self.step_slots(s)) for b, s in steps):
                hidden = self.eager(batch, slots)()
            if self.kernel_draws():   # the draw's kernels too, sampling at T > 0: a batch's split picks its merge
                from .draw import draw
                vocab = self.model.lm_head.weight.shape[0]   # only the logits' shape and dtype count: nothing runs
                for batch in sorted({b for b, _ in steps}):
                    draw(hidden.new_empty(batch, vocab), temperature=1.0, seed=0, step=0)
        triton_launch.compile_all(launches, device=self.cache.tok.device)
        seconds = time.perf_counter() - t0
        self.kernels_s, self.capture_s = self.kernels_s + seconds, self.capture_s + seconds

    def _zero_kv(self, rows: int, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V per layer, each [rows, kv_heads, slots, head_dim] in the model's dtype and device."""
        p = next(self.model.parameters())
        shape = (rows, self.model.config.num_key_value_heads, slots, self.head_dim)
        return [(torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device))
                for _ in self.model.model.layers]

    def release(self) -> None:
        """Free the KV cache and its steps; the next call makes them again."""
        self.cache = None

    def min_batch(self) -> int:
        """The smallest batch bucket: `DecodeConfig.min_batch` where steps are graphs, else 2 (an eager step costs
        what its rows cost)."""
        return self.config.min_batch if self.graphs() else 2

    def kernel_draws(self) -> bool:
        """Whether a step's draw is `draw.draw`'s kernel (`DecodeConfig.sampler` "triton" where the Triton kernels
        run: `glue_mode`), else `sampling.pick`."""
        return self.config.sampler == "triton" and self.glue(self.cache.tok.device.type == "cuda").mode == "triton"

    def graphs(self) -> bool:
        """Whether steps are CUDA graphs (`DecodeConfig.cuda_graphs`, a dense model on a GPU: MoE routing syncs)."""
        return self.config.cuda_graphs and self.cache.tok.device.type == "cuda" and not is_moe(self.model)

    def graphed(self) -> bool:
        """Whether steps are CUDA graphs captured by hand ("capture" mode): those are made up front; eager and
        reduce-overhead steps are made when first asked for."""
        return self.graphs() and self.config.graph_mode == "capture"

    def eager(self, batch: int, slots: int):
        """The decode step over the first `batch` rows and `slots` slots as plain calls (`decoder.decode` with the
        glue): what a graph records, and the step itself where there are no graphs."""
        state = self.cache
        tok, pos, glue = state.tok[:batch], state.pos[:batch], self.glue(state.tok.device.type == "cuda")
        return lambda: decode(self.model, tok, pos, state.kv, state.rope, slots=slots, head_dim=self.head_dim,
                              clip_qkv=self.clip_qkv, glue=glue, windows=self.windows)

    def step_slots(self, slots: int) -> int:
        """The slots a step asked for `slots` is made for: all the cache's when the Triton kernels attend (a row reads
        its own keys up to its position whatever the bucket, so one step per batch bucket serves every slot bucket:
        11 graphs at 512 x 576 instead of 99), else `slots` (SDPA reads the whole bucket under a mask)."""
        state = self.cache
        return state.shape[1] if self.glue(state.tok.device.type == "cuda").kernel_attention else slots

    @torch.no_grad()
    def step(self, batch: int, slots: int):
        """A decode step over the first `batch` rows and `slots` slots (`step_slots`): reads `tok`/`pos`, writes
        the rows' K, V, returns the final hidden states [batch, hidden] (`decoder.decode`). Idempotent (it rewrites
        the same slots with the same values), so its warm-up and capture leave the cache as they found it."""
        state = self.cache
        slots = self.step_slots(slots)
        if (batch, slots) in state.steps:
            return state.steps[(batch, slots)]
        t0 = time.perf_counter()
        fn = self.eager(batch, slots)
        if self.graphs():
            if self.config.graph_mode == "reduce-overhead":
                fn = self.compiled_step(state.tok[:batch], state.pos[:batch], slots)
            else:
                fn = captured(fn, pool=state.pool)
                state.pool = fn.pool
        state.steps[(batch, slots)] = fn
        self.capture_s += time.perf_counter() - t0
        self.made += 1
        return fn

    def compiled_step(self, tok: torch.Tensor, pos: torch.Tensor, slots: int):
        """The step through `torch.compile(decode, mode="reduce-overhead")` (`graph_mode`): one compile per batch
        and slot bucket; the cache tensors are marked static so inductor's graphs may write them in place."""
        from torch import _dynamo
        state = self.cache
        if self._compiled is None:
            self._compiled = torch.compile(decode, mode="reduce-overhead", dynamic=False)
        for t in (*[x for kv in state.kv for x in kv], *state.rope):
            _dynamo.mark_static_address(t)

        def run():
            torch.compiler.cudagraph_mark_step_begin()
            # one graph per batch and slot bucket (at most ~100): dynamo's limit raised for this call only
            with _dynamo.config.patch(recompile_limit=128, accumulated_recompile_limit=1024):
                return self._compiled(self.model, tok, pos, state.kv, state.rope, slots=slots,
                                      head_dim=self.head_dim, clip_qkv=self.clip_qkv, glue=EAGER,
                                      windows=self.windows)
        run()   # compiles and records now, not inside the timed loop
        return run

    def glue(self, gpu: bool) -> Glue:
        """The decode step's functions between the GEMMs (`decoder.Glue`), made once per runner in `glue_mode`;
        eager off a GPU."""
        if not gpu:
            return EAGER
        if self._glue is None:
            self._glue = Glue(mode=glue_mode(self.config, self.cache.tok.device), fuse_rope=self.config.fuse_rope)
        return self._glue


def glue_mode(config: DecodeConfig, device: torch.device) -> str:
    """`decoder.Glue`'s mode for `config` on `device`: "triton" where `config.kernels` is "triton", or "auto" with
    captured steps, and the kernels run on `device` (`models.support.triton_available`: Triton, an NVIDIA GPU
    of sm80 or newer); else "compiled" (`compile_glue`) or "eager"."""
    wants = config.kernels == "triton" or (config.kernels == "auto" and config.graph_mode == "capture")
    if wants and triton_available(device):
        return "triton"
    return "compiled" if config.compile_glue and device.type == "cuda" else "eager"


def _peak(device: torch.device, fn) -> int:
    """Bytes allocated on `device` at `fn()`'s peak beyond what was allocated before it, less what `fn` returns
    (the bytes of its own buffers still held at the peak)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before - held)


def captured(fn, *, pool=None):
    """`fn()` recorded as one CUDA graph (after a warm-up on a side stream: allocator, cuBLAS, compiles) in the
    memory pool `pool` (None: a new one, then kept in `.pool`). Returns the replay, whose output tensor is
    rewritten by the next replay of any graph of the pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay():
        graph.replay()
        return out
    replay.pool = pool
    return replay
