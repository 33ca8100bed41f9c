"""The rollout engine's model runner (nano-vllm's `ModelRunner`): the model on the device and what runs on it. It holds
across calls the weights' fused view (`decoder.fuse_projections`), the model's constants (`context.ModelConstants`),
the KV cache with each row's next token and position (`kv_cache.Cache`, sized by `kv_cache.Sizer`) and the decode
steps, one per batch and slot bucket; in a call it carries out the scheduler's decisions: prefills and extends (a
tool's output into a paused row's own cache slots) from a `context.Context`, row copies (`scheduler.Move`) and chunks
of decode steps (`scheduler.Chunk`), each sampled on the device (`kernels.sampling.Sampler`), the tokens handed back
on the host.

On a GPU the steps are CUDA graphs in one memory pool, all captured when the cache is made (`ModelRunner.cache_for`),
for the fixed set of buckets a call on that cache can ask for (`buckets`; with the Triton attention kernels one per
batch bucket, `ModelRunner.step_slots`): a call never captures inside its decode loop, and a kept cache's later calls
capture nothing. Elsewhere, or for MoE models (their routing syncs the host), a step is the same code run eagerly, so
CPU tests cover it.
"""
from __future__ import annotations

import time

import torch

from ...models import triton_launch
from ...models.support import triton_available
from . import fp8_weights
from .routes import RouteTable
from .context import Context, ModelConstants
from .decoder import EAGER, Glue, check_model, decode, extend, fuse_projections, is_moe, prefill, rope_table
from .kernels.sampling import Sampler
from .kv_cache import Cache, Sizer, zero_kv
from .scheduler import Chunk, Move, Sequence, batch_bucket, first_copies


def buckets(*, rows: int, slots: int, slot_bucket: int, min_batch: int = 2,
            per_doubling: int = 2) -> list[tuple[int, int]]:
    """Every (batch, slots) a decode step on a `rows` x `slots` cache can run: the batch buckets of 1..rows live rows
    (`scheduler.batch_bucket`, at least `min_batch`, `per_doubling` as there) times the multiples of `slot_bucket` up to
    `slots`, largest first (the pool's biggest buffers are made first and the smaller graphs reuse them)."""
    batches = sorted({batch_bucket(n, rows=rows, least=min_batch, per_doubling=per_doubling)
                      for n in range(1, rows + 1)}, reverse=True)
    return [(b, s) for b in batches for s in range(slots, 0, -slot_bucket)]


class ModelRunner:
    """The model's device state and launches (module docstring); `ContinuousRollout` owns one."""

    def __init__(self, model, *, config):
        self.model, self.config = model, config
        if config.weights == "fp8":   # refused by name before the weights are touched
            fp8_weights.check(model, moe=is_moe(model))
        fuse_projections(model)
        self.fp8 = (fp8_weights.Fp8Weights(model, kernel=config.kernels != "torch" and triton_available(model.device))
                    if config.weights == "fp8" else None)
        """The projections' FP8 copies (`DecodeConfig.weights="fp8"`), made and kept current by `check_weights`."""
        self.constants = ModelConstants.of(model)
        """What the launches need of the model beyond its weights, read once."""
        self.sizer = Sizer(model, self.constants, config)
        """How many cache rows a call gets (`kv_cache.Sizer`)."""
        self.cache: Cache | None = None
        self.capture_s, self.made = 0.0, 0
        """Seconds spent making steps (graph warm-ups and captures, the glue's compile in the first) and the steps
        made, summed over the runner's life."""
        self.kernels_s = 0.0
        """Of `capture_s`: seconds compiling the Triton kernels ahead of the captures (`compile_kernels`)."""
        self.prefilled = 0
        """Prompt tokens run through the model by `prefill` (a shared prefill counts a prompt once; padding not
        counted), summed over the runner's life."""
        self._glue: Glue | None = None
        self._compiled = None
        self.routes: RouteTable | None = None
        """Where the MoE layers' choices are recorded during a call that asks for them (`routes.py`), else None."""

    @property
    def probes(self) -> dict[tuple[int, int, int], int]:
        """(rows, slots, prefill tokens) -> the measured transient peak (`kv_cache.Sizer.transient_bytes`)."""
        return self.sizer.probes

    # ---- the cache of a call ----------------------------------------------------------------------
    def check_weights(self) -> None:
        """Before a call: the weights' fused view made again where a weight was re-pointed since the last call
        (`fuse_projections`; the cache goes, as its graphs read the old tensors), a model the decoder cannot run
        refused by name before anything is allocated, and the FP8 copies quantized again where a weight changed."""
        remade = fuse_projections(self.model)
        if remade:
            self.release()
        check_model(self.model)
        if self.fp8 is not None:   # into the same tensors: the kept graphs read the new weights
            self.fp8.update(remake=remade)

    def prepare(self, sequences: int, *, slots: int, longest: int) -> Cache:
        """The cache for a call of `sequences` sequences, prompts at most `longest` tokens, `slots` slots a row: the
        rows that fit (`fitting_rows`) agreed by the model-parallel peers (`Sizer.agreed`, which raises where not one
        fits), then `cache_for` them."""
        rows = self.sizer.agreed(self.fitting_rows(sequences, slots=slots, longest=longest), slots=slots)
        return self.cache_for(rows, slots, transient_bytes=self.sizer.last.get("transient", 0))

    def fitting_rows(self, sequences: int, *, slots: int, longest: int) -> int:
        """Cache rows for a call: the fewest of the sequences, `max_batch_size` and what fits beside the call's
        measured transient peak (`Sizer.rows`); 0 when not one row does. A kept cache too small for the call is
        freed first: its bytes count as free, and the probe may use them."""
        want = max(2, min(sequences, self.config.max_batch_size))   # a batch of 1 would compile its own glue
        kept, self.sizer.last = self.cache, {}
        if kept is not None and kept.shape[0] >= want and kept.shape[1] >= slots:
            return kept.shape[0]   # the kept cache holds the call: its graphs replay
        if self.model.device.type != "cuda":
            return want
        self.release()
        return self.sizer.rows(want, slots=slots, longest=longest)

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
        kv = zero_kv(self.model, self.constants, rows, slots)
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
                from .kernels.draw import draw
                vocab = self.model.lm_head.weight.shape[0]   # only the logits' shape and dtype count: nothing runs
                for batch in sorted({b for b, _ in steps}):
                    draw(hidden.new_empty(batch, vocab), temperature=1.0, seed=0, step=0)
        triton_launch.compile_all(launches, device=self.cache.tok.device)
        seconds = time.perf_counter() - t0
        self.kernels_s, self.capture_s = self.kernels_s + seconds, self.capture_s + seconds

    def release(self) -> None:
        """Free the KV cache and its steps; the next call makes them again."""
        self.cache = None

    # ---- one call's launches ----------------------------------------------------------------------
    def prefill(self, group: list[Sequence], sample: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """One padded prefill of the group's prompts into their cache rows (`run`). With `DecodeConfig.share_prefill`
        each distinct prompt runs once (GRPO's n samples of a prompt: `scheduler.first_copies`): its KV and MoE routes
        are copied into its copies' rows (`copy_rows`) and its last logits stand for each copy's, so the sampler draws
        over the same [rows, vocab] as a prefill of every row would, and the same seed gives the same tokens."""
        prompts, device = [s.prompt for s in group], self.cache.tok.device
        firsts = first_copies(prompts) if self.config.share_prefill else list(range(len(group)))
        ran = sorted(set(firsts))
        self.prefilled += sum(len(prompts[j]) for j in ran)
        ctx = Context.of(rows=[group[j].row for j in ran], tokens=[prompts[j] for j in ran], device=device)
        if len(ran) == len(group):
            return self.run(ctx, sample)
        logits = self.forward(ctx)
        copies = [j for j, f in enumerate(firsts) if f != j]
        self.copy_rows(src=[group[firsts[j]].row for j in copies], dst=[group[j].row for j in copies],
                       slots=ctx.ids.shape[1])
        at = {j: i for i, j in enumerate(ran)}   # a group row's first copy -> its logits row
        return self.sampled(torch.tensor([s.row for s in group], device=device),
                            torch.tensor([len(p) for p in prompts], device=device),
                            logits[torch.tensor([at[f] for f in firsts], device=device)], sample)

    def extend(self, items: list[tuple[Sequence, list[int], int]],
               sample: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """The resumed sequences' [last token] + tool output (`Scheduler.resume`'s items) prefilled from the slot of
        their last token on, in one `decoder.extend` (`run`)."""
        return self.run(Context.of(rows=[s.row for s, _, _ in items], tokens=[ids for _, ids, _ in items],
                                   starts=[start for *_, start in items], device=self.cache.tok.device), sample)

    def run(self, ctx: Context, sample: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill (`ctx.starts` None) or extend (`forward`), the token after each row's last one sampled and made
        the row's next input (`sampled`). Returns the sampled tokens and their log-probs [k, 1] on the host."""
        return self.sampled(ctx.rows, ctx.ends, self.forward(ctx), sample)

    def forward(self, ctx: Context) -> torch.Tensor:
        """The context's tokens through the model into its cache rows (and their MoE routes into `routes`); returns
        the logits after each row's last token [k, vocab]."""
        st, kw = self.cache, self.constants.decoder_kwargs()
        if self.routes is not None:
            self.routes.expect(*ctx.placed())
        if ctx.starts is None:
            return prefill(self.model, ctx.ids, ctx.lengths, st.kv, ctx.rows, st.rope, **kw)
        return extend(self.model, ctx.ids, ctx.starts, ctx.lengths, st.kv, ctx.rows, st.rope, **kw)

    def sampled(self, rows: torch.Tensor, ends: torch.Tensor, logits: torch.Tensor,
                sample: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """The token after `logits` [k, vocab] sampled for cache rows `rows` [k] and made each row's next input, at
        position `ends` [k]; the tokens and their log-probs [k, 1] on the host."""
        tok, logp = sample(logits)
        self.cache.tok[rows], self.cache.pos[rows] = tok, ends
        return tok[:, None].cpu(), logp[:, None].cpu()

    def move(self, move: Move) -> None:
        """Cache rows `move.rows` copied to rows 0..len(rows)-1 (`copy_rows`), from the first row not already in
        place, their first `move.slots` slots only. Piece by piece is safe in ascending order: the j-th row moved
        comes from a row >= j, so a piece writes no row that a later piece reads."""
        rows = move.rows
        first = next((j for j, r in enumerate(rows) if r != j), len(rows))   # rows already in place stay
        self.copy_rows(src=rows[first:], dst=list(range(first, len(rows))), slots=move.slots)

    def copy_rows(self, *, src: list[int], dst: list[int], slots: int) -> None:
        """Cache rows `src` (KV of their first `slots` slots, next token, position, MoE routes) copied to rows `dst`,
        pair by pair in order, at most half the cache's rows at a time (`Sizer.transient_bytes` holds one layer's
        copy of half the rows): the caller sees that no piece writes a row that a later piece reads."""
        st = self.cache
        piece = max(1, (st.tok.shape[0] + 1) // 2)
        for start in range(0, len(src), piece):
            frm, to = (torch.tensor(r[start:start + piece], device=st.tok.device) for r in (src, dst))
            for k, v in st.kv:
                k[to, :, :slots], v[to, :, :slots] = k[frm, :, :slots], v[frm, :, :slots]
            st.tok[to], st.pos[to] = st.tok[frm], st.pos[frm]
            if self.routes is not None:
                self.routes.move(frm, to, slots)

    def decode(self, chunk: Chunk, sample: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's decode steps over its first `chunk.batch` rows (`step`), each step's token sampled and made the
        rows' next input; returns the tokens and log-probs [batch, steps] on the host (the loop's only sync)."""
        st, b = self.cache, chunk.batch
        if chunk.idle:   # a free row in the batch decodes junk at slot 0 of its own row until it is refilled
            st.pos[torch.tensor(chunk.idle, device=st.pos.device)] = 0
        sampled, head = [], self.model.lm_head
        if self.routes is not None:   # row r's token goes to slot pos[r], read at each step's hook
            self.routes.expect(torch.arange(b, device=st.pos.device), st.pos[:b])
        for slots in chunk.slots:
            hidden = self.step(b, slots)()
            tok, logp = sample(head(hidden))
            st.tok[:b], st.pos[:b] = tok, st.pos[:b] + 1
            sampled.append((tok, logp))
        return torch.stack([t for t, _ in sampled], 1).cpu(), torch.stack([p for _, p in sampled], 1).cpu()

    # ---- the decode steps -------------------------------------------------------------------------
    def min_batch(self) -> int:
        """The smallest batch bucket: `DecodeConfig.min_batch` where steps are graphs, else 2 (an eager step costs
        what its rows cost)."""
        return self.config.min_batch if self.graphs() else 2

    def kernel_draws(self) -> bool:
        """Whether a step's draw is `kernels.draw.draw`'s kernel (`DecodeConfig.sampler` "triton" where the Triton
        kernels run: `glue_mode`), else `kernels.sampling.pick`."""
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
        return lambda: decode(self.model, tok, pos, state.kv, state.rope, slots=slots, glue=glue,
                              **self.constants.decoder_kwargs())

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
                return self._compiled(self.model, tok, pos, state.kv, state.rope, slots=slots, glue=EAGER,
                                      **self.constants.decoder_kwargs())
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
