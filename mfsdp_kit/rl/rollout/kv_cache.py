"""The rollout engine's KV cache: its tensors (`Cache`) and how many rows of it a call gets (`Sizer`).

The cache is one K and one V tensor per layer, [rows, kv_heads, slots, head_dim]; row r holds one sequence from slot
0, so rows of different lengths share a decode step (continuous batching). Its rows are sized as vLLM's
gpu_memory_utilization and nano-vllm's warm-up size theirs: a share of the device's free memory
(`DecodeConfig.cache_memory_fraction`) less the call's transient peak, measured once per shape by running the
largest prefill and a decode step's sampling (`Sizer.transient_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...config import bad_value
from .context import ModelConstants
from .decoder import prefill, rope_table
from .kernels.sampling import pick


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
    """The measured peak the rows were sized beside (`Sizer.transient_bytes`; 0 off a GPU)."""

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, slots)."""
        return self.kv[0][0].shape[0], self.kv[0][0].shape[2]


def zero_kv(model, constants: ModelConstants, rows: int, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V per layer, each [rows, kv_heads, slots, head_dim] in the model's dtype and device."""
    p = next(model.parameters())
    shape = (rows, constants.kv_heads, slots, constants.head_dim)
    return [(torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype, device=p.device))
            for _ in range(constants.layers)]


class Sizer:
    """How many cache rows a call gets, and the measurements behind it (module docstring)."""

    def __init__(self, model, constants: ModelConstants, config):
        self.model, self.constants, self.config = model, constants, config
        self.probes: dict[tuple[int, int, int], int] = {}
        """(rows, slots, prefill tokens) -> the measured peak of `transient_bytes`: one probe per shape."""
        self.last: dict = {}
        """The last sizing's free bytes, measured peak and row bytes (`rows`; empty when none was made)."""

    def row_bytes(self, slots: int) -> int:
        """Bytes of one cache row: layers x (K + V) x kv_heads x slots x head_dim x element size."""
        c, p = self.constants, next(self.model.parameters())
        return c.layers * 2 * c.kv_heads * slots * c.head_dim * p.element_size()

    def transient_bytes(self, *, rows: int, slots: int, longest: int) -> int:
        """Peak device bytes a call on a `rows` x `slots` cache needs beside the cache, its prompts at most `longest`
        tokens (a GPU; 0 elsewhere), measured once per shape; the largest of:
          - a prefill group (`scheduler.prefill_groups`: rows x their longest <= `prefill_tokens`, a longer prompt
            alone): max(prefill_tokens, longest) tokens in rows of the call's longest possible length, run on a
            scratch cache whose own bytes are not counted (activations, the attention mask, logits);
          - one decode step's sampling at `rows` rows (logits, the top-p sort, the exponential draws);
          - a compaction's or a shared prefill's copies (`ModelRunner.copy_rows`: one layer's K and V of half the
            rows), by their size (a shared prefill samples at most the call's rows, as a decode step does).
        Not counted: the graphs' pool (a decode step's activations, a few MB) and a tool output's `extend`.
        `rows` sizes the cache beside it. Resets torch's peak counter, as `perf.peaks` does at its phase
        boundaries."""
        p = next(self.model.parameters())
        if p.device.type != "cuda":
            return 0
        tokens = max(self.config.prefill_tokens, longest)
        if (rows, slots, tokens) not in self.probes:
            moved = (rows + 1) // 2 * self.row_bytes(slots) // self.constants.layers
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
        kv = zero_kv(self.model, self.constants, rows, length)
        rope = rope_table(self.model, slots=length, like=kv[0][0])
        ids = torch.zeros(rows, length, dtype=torch.long, device=p.device)
        prefill(self.model, ids, torch.full((rows,), length, device=p.device), kv, torch.arange(rows, device=p.device),
                rope, **self.constants.decoder_kwargs())
        return sum(t.nbytes for pair in kv for t in pair) + sum(t.nbytes for t in rope)

    @torch.no_grad()
    def _probe_sampling(self, rows: int) -> int:
        """One decode step's head and top-p sampling at `rows` rows (the sort's worst case: top_p < 1)."""
        p = next(self.model.parameters())
        hidden = torch.zeros(rows, self.constants.hidden_size, dtype=p.dtype, device=p.device)
        pick(self.model.lm_head(hidden), temperature=1.0, top_p=0.5,
             generator=torch.Generator(device=p.device).manual_seed(0))
        return 0

    def rows(self, want: int, *, slots: int, longest: int) -> int:
        """Of `want` rows, those that fit in `cache_memory_fraction` of the device's free memory beside the call's
        measured transient peak (`transient_bytes`); 0 when not one does. Call it with no cache held: the free
        memory is then what a new cache may take."""
        device = self.model.device
        transient = self.transient_bytes(rows=want, slots=slots, longest=longest)
        # the driver's free memory and the blocks torch's allocator holds unused (the freed cache's among them)
        free = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                - torch.cuda.memory_allocated(device))
        self.last = dict(free=free, transient=transient, row=self.row_bytes(slots))
        return max(0, min(want, int((self.config.cache_memory_fraction * free - transient) // self.last["row"])))

    def agreed(self, rows: int, *, slots: int) -> int:
        """`rows`, agreed by the model-parallel peers (their minimum): the ranks of one replica sample the same
        prompts with the same seed, and draw the same tokens only with the same rows (every peer calls it). Where not
        one row fits on some peer, every peer raises (none is left waiting in the agreement)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        if dist.is_initialized() and ps.model_parallel_is_initialized():
            group = ps.get_model_parallel_group()
            if dist.get_world_size(group) > 1:
                agreed = torch.tensor([rows], device=self.model.device if dist.get_backend(group) == "nccl" else "cpu")
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
                rows = int(agreed.item())
        if rows < 1:
            s = self.last
            here = (f" (here: {s['free'] / 2**30:.1f} GiB free, a row {s['row'] / 2**20:.0f} MiB, the peak "
                    f"{s['transient'] / 2**30:.2f} GiB)" if s else "")
            raise bad_value("cache_memory_fraction", self.config.cache_memory_fraction,
                            f"a share of the free memory that holds one row of {slots} slots beside the call's "
                            f"measured peak (the largest prefill under `prefill_tokens` {self.config.prefill_tokens}, "
                            f"a decode step's sampling or a compaction's copies) on every model-parallel rank{here}")
        return rows


def _peak(device: torch.device, fn) -> int:
    """Bytes allocated on `device` at `fn()`'s peak beyond what was allocated before it, less what `fn` returns
    (the bytes of its own buffers still held at the peak)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before - held)
