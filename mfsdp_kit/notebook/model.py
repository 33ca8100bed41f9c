"""Which model the notebooks train: one knob, read here and nowhere else.

    MFSDP_MODEL=<choice>   (environment variable; a notebook's first cell may set MODEL = <choice> instead)
        unset | "auto"     "xs" on CPU (the tiny model, fp32); "mw" (180.9 M params in 4 wide layers, bf16) when
                           CUDA is visible
        "xs" | "s" | "m" | "mw" | "l"   that size of `models.tiny` (~0.1 M, ~3 M, 180.7 M in 16 layers, 180.9 M
                           in 4, 1.70 B; written locally from a seed, no download), fp32 on CPU and bf16 on GPUs
        a directory        your own Hugging Face folder, used in place (fp32 on CPU, bf16 on GPUs)
    MFSDP_DTYPE=fp32|bf16|fp16 overrides the compute dtype of either.
    MFSDP_ATTENTION=local|sdpa overrides the core attention (`EngineConfig.kernels.attention_backend`): "sdpa" on GPUs
                           (unless the folder's config has an active sliding window, which only "local" maps),
                           "local" on CPU.

Why these GPU defaults: a notebook step (32 sequences x 16 tokens) is bound by the host, not the GPU: megatron
runs Python and launches kernels per layer, per micro-batch, so a step costs what its layers cost the host
(bench/sft_step.py, 02_sft's step in fp32, DDP and Megatron-FSDP; docs/benchmarks.md, notebooks, "Cutting the
host work"):
- m, megatron's local attention: the slowest (its 16 layers build a causal mask and copy host-to-device each);
- m, SDPA: faster, the GPU busy for a small part of the step;
- mw, SDPA: the same parameters in a quarter of the layers, a quarter of the host work: about a third of m's step.
With mw + SDPA every notebook passes, the suite in well under half the time it took with m and megatron's
attention (docs/benchmarks.md, notebooks).
`MFSDP_MODEL=l` (1.70 B) fills a GPU more and costs ~30 s to write its folder, once per machine
(`models.tiny.cached`). The notebooks' learning rates were tuned on xs; `NotebookModel.lr` scales them down for
larger models (the notebooks' SFT at 3e-3 on xs, 1e-3 on m, 6e-4 on mw, 3e-4 on l; bench/sft_grpo.py trains m at
3e-4 for 600 steps; 1e-2 of the xs rate for a user's folder).

`prepare()` is what a notebook's first cell calls; `throughput()` is the GPU report (tokens/s per GPU,
MFU, peak memory and model state against the ZeRO formula) that 06_memory prints.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import gpus
from ..config import DTYPES, EngineConfig, bad_value
from ..config.flat import nest

ENV_MODEL, ENV_DTYPE, ENV_ATTENTION = "MFSDP_MODEL", "MFSDP_DTYPE", "MFSDP_ATTENTION"
TINY_SIZES = ("xs", "s", "m", "mw", "l")
DEFAULT_SIZE = {False: "xs", True: "mw"}
"""by `on_gpu`"""
LR_SCALE = {"xs": 1.0, "s": 0.5, "m": 0.3, "mw": 0.2, "l": 0.1}
"""Factor on the notebooks' xs learning rates; a user's folder gets USER_LR_SCALE."""
USER_LR_SCALE = 0.01
BENCH_SEQ_LEN = 256
"""The tiny models' max_position_embeddings: the longest sequence their RoPE covers."""


@dataclass(kw_only=True)
class NotebookModel:
    """The model a notebook trains and how: where its HF folder is, in which dtype, on what."""

    choice: str
    """What was asked: a tiny size or the user's folder."""
    path: str
    """The HF folder the notebook loads (`models.hf.load(path, cfg)`)."""
    dtype: str
    on_gpu: bool
    workdir: str
    """A fresh directory for what the notebook writes (exports, checkpoints): never beside a user's folder."""
    lr_scale: float = 1.0
    attention_backend: str = "local"
    """`EngineConfig.kernels.attention_backend` for this model on this hardware (`attention_backend()`)."""

    @property
    def size(self) -> str | None:
        return self.choice if self.choice in TINY_SIZES else None

    def engine_config(self, **overrides) -> EngineConfig:
        """EngineConfig in this model's dtype and attention; `overrides` win (a parity check passes dtype="fp32"):
        fields, sections, or a section field by its name alone (`use_megatron_fsdp=True`, the notebooks' shorthand).
        A tiny size runs unfused: compiling RoPE and SwiGLU (`kernels.fused_kernels`, "auto" on a GPU) costs each
        notebook's engines seconds that a tiny model's few steps never win back; a folder of yours keeps "auto"."""
        tiny = {"fused_kernels": False} if self.size else {}
        return EngineConfig(**nest({"dtype": self.dtype, "attention_backend": self.attention_backend, **tiny,
                                    **overrides}))

    @property
    def packing_attention(self) -> str:
        """The attention of a notebook that trains packed (`mfsdp_kit.train.packing` needs the kit's SDPA): "sdpa" on any
        hardware, unless MFSDP_ATTENTION says otherwise or the folder's sliding window needs megatron's "local"
        (which trains padded)."""
        return attention_backend(self.path, on_gpu=True)

    def lr(self, xs_lr: float) -> float:
        """A learning rate tuned on the tiny xs model, scaled for this one."""
        return xs_lr * self.lr_scale

    def out(self, name: str) -> str:
        """A path under `workdir` for an output named `name`."""
        return str(Path(self.workdir) / name)

    def __str__(self) -> str:
        where = "GPU" if self.on_gpu else "CPU"
        return f"{self.choice} ({self.path}), {self.dtype} on {where}, {self.attention_backend} attention, " \
               f"lr x {self.lr_scale:g}"


def resolve(model: str | None = None, *, on_gpu: bool, env: dict | None = None) -> tuple[str, str]:
    """(choice, dtype) from the argument, else MFSDP_MODEL / MFSDP_DTYPE, else the defaults.

    A choice is a tiny size or an existing directory; anything else raises ConfigError naming the knob."""
    env = os.environ if env is None else env
    choice = model if model not in (None, "") else env.get(ENV_MODEL, "") or "auto"
    if choice == "auto":
        choice = DEFAULT_SIZE[on_gpu]
    if choice not in TINY_SIZES and not Path(choice).expanduser().is_dir():
        raise bad_value(ENV_MODEL, choice, "auto | " + " | ".join(TINY_SIZES) + " | an existing HF folder "
                        f"(a relative path is read from {os.getcwd()})")
    dtype = env.get(ENV_DTYPE, "") or ("bf16" if on_gpu else "fp32")
    if dtype not in DTYPES:
        raise bad_value(ENV_DTYPE, dtype, " | ".join(DTYPES))
    if choice not in TINY_SIZES:
        choice = str(Path(choice).expanduser().resolve())
    return choice, dtype


def pinned(env: dict | None = None) -> dict[str, str]:
    """{MFSDP_MODEL: its absolute path} when the knob names an existing folder (relative paths read from this
    process's directory), else {}. What `make lab` hands its kernels: they run in notebooks/, where
    `MFSDP_MODEL=models/mine` would name nothing."""
    env = os.environ if env is None else env
    choice = env.get(ENV_MODEL, "")
    if choice in ("", "auto", *TINY_SIZES) or not Path(choice).expanduser().is_dir():
        return {}
    return {ENV_MODEL: str(Path(choice).expanduser().resolve())}


def attention_backend(path: str, *, on_gpu: bool, env: dict | None = None) -> str:
    """MFSDP_ATTENTION if set, else "sdpa" on GPUs (host-bound small steps: module docstring) unless the HF
    folder at `path` has an active sliding window, which only megatron's "local" attention reproduces."""
    from ..config import ATTENTION_BACKENDS
    from ..models.support import active_window
    env = os.environ if env is None else env
    chosen = env.get(ENV_ATTENTION, "")
    if chosen:
        if chosen not in ATTENTION_BACKENDS:
            raise bad_value(ENV_ATTENTION, chosen, " | ".join(ATTENTION_BACKENDS))
        return chosen
    file = Path(path) / "config.json"   # a folder without one fails in models.hf.load, naming the file
    config = json.loads(file.read_text()) if file.is_file() else {}
    # the same reading of config.json as the load's own window check (support.check_config), so the choice made
    # here is never one that load refuses
    return "sdpa" if on_gpu and active_window(config) is None else "local"


def prepare(model: str | None = None, *, on_gpu: bool | None = None, workdir: str | None = None,
            seed: int = 0) -> NotebookModel:
    """Resolve the knob and find the model's folder: a tiny size is written (seeded) once per machine and
    reused (`models.tiny.cached`, under $MFSDP_KIT_CACHE or ~/.cache/mfsdp_kit); outputs go to `workdir`."""
    on_gpu = gpus.visible() > 0 if on_gpu is None else on_gpu
    choice, dtype = resolve(model, on_gpu=on_gpu)
    path = folder(choice, seed=seed)
    return NotebookModel(choice=choice, path=path, dtype=dtype, on_gpu=on_gpu,
                         workdir=workdir or tempfile.mkdtemp(prefix="mfsdp_nb_"),
                         lr_scale=LR_SCALE.get(choice, USER_LR_SCALE),
                         attention_backend=attention_backend(path, on_gpu=on_gpu))


def folder(choice: str, *, seed: int = 0) -> str:
    """The HF folder of a resolved choice: a tiny size's cached folder (written now if missing), else the choice."""
    if choice not in TINY_SIZES:
        return choice
    from ..models.tiny import cached
    return str(cached(size=choice, seed=seed))


def main(argv: list[str] | None = None) -> None:
    """`python -m mfsdp_kit.notebook.model [MODEL]`: find or write the notebooks' model now and print its folder.
    `make lab` runs it in the background while JupyterLab starts, so the first notebook finds the model written
    (tiny mw: 180.9 M params, 4-7 s on a GPU node, most of it importing transformers)."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="as MFSDP_MODEL (default: the knob, else the hardware's)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    choice, _ = resolve(args.model, on_gpu=gpus.visible() > 0)
    print(f"notebook model {choice}: {folder(choice)} ({time.perf_counter() - t0:.1f} s)", flush=True)


def gpt_spec(hf_path, *, seq_len_tokens: int):
    """The `models.gpt.GPTSpec` of an HF folder's config.json: what `perf.flops` counts FLOPs on."""
    from ..models.gpt import GPTSpec
    c = json.loads((Path(hf_path) / "config.json").read_text())
    c = c.get("text_config", c)
    return GPTSpec(num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                   num_attention_heads=c["num_attention_heads"],
                   num_query_groups=c.get("num_key_value_heads"), ffn_hidden_size=c["intermediate_size"],
                   vocab_size=c["vocab_size"], seq_len_tokens=seq_len_tokens)


def throughput(chunks, optimizer, *, nbm: NotebookModel, steps: int | None = None, warmup: int = 1,
               micro_batch_size: int | None = None, seq_len_tokens: int = BENCH_SEQ_LEN, seed: int = 0) -> dict:
    """Train `steps` timed steps (after `warmup`) on random tokens, one micro-batch per rank per step.

    Returns this rank's tokens/s (every position, not only loss tokens), MFU (bf16/fp16 on GPU only:
    `perf.flops`' peak is dense bf16), step time, peak memory and model state next to the ZeRO formula.
    Defaults: on GPU micro-batch 64 (8 for a user's folder) and 5 steps; on CPU, where the numbers only show that
    the path works, 2 and 1."""
    import torch
    from megatron.core import parallel_state as ps

    from ..train import data
    from .. import train
    from ..distributed import runtime
    from ..distributed.memory import memory_report, zero_formula_bytes
    from ..perf.flops import flops_per_token, matmul_params, mfu
    gpu = torch.cuda.is_available()
    steps = steps or (5 if gpu else 1)
    mbs = micro_batch_size or ((64 if nbm.size else 8) if gpu else 2)
    spec = gpt_spec(nbm.path, seq_len_tokens=seq_len_tokens)
    dp = ps.get_data_parallel_world_size()
    batches = data.random_token_batches(steps=steps + warmup, global_batch=mbs * dp, seq_len_tokens=seq_len_tokens,
                                        vocab_size=spec.vocab_size, seed=seed)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i, batch in enumerate(batches):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train.step(chunks, optimizer, batch, micro_batch_size=mbs, step_index=i)
        if gpu:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = mbs * seq_len_tokens / step_s   # per rank = per GPU (one GPU per rank)
    low_precision = gpu and nbm.dtype in ("bf16", "fp16")
    report = memory_report(chunks, optimizer)
    fsdp = runtime.current_config().wrapper.use_megatron_fsdp
    return dict(
        model=nbm.choice, dtype=nbm.dtype, fsdp=fsdp, dp_size=dp, micro_batch_size=mbs,
        seq_len_tokens=seq_len_tokens, steps=steps, step_s=step_s, tokens_per_s_per_gpu=tokens_per_s,
        flops_per_token=flops_per_token(spec), matmul_params=matmul_params(spec),
        mfu=mfu(tokens_per_s, spec) if low_precision else None,
        peak_bytes=torch.cuda.max_memory_allocated() if gpu else 0,
        model_state_bytes=report.model_state_bytes,
        formula_bytes=zero_formula_bytes(num_params=report.num_params, dp_size=dp, fsdp=fsdp, dtype=nbm.dtype),
        num_params=report.num_params)


def format_throughput(results: dict[str, dict]) -> str:
    """A text table, one column per run (as `throughput` returned it)."""
    gib = 2**30
    rows = [("tokens/s per GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"),
            ("MFU", lambda r: "-" if r["mfu"] is None else f"{r['mfu']:.1%}"),
            ("step s (median)", lambda r: f"{r['step_s']:.3f}"),
            ("micro-batch x seq", lambda r: f"{r['micro_batch_size']} x {r['seq_len_tokens']}"),
            ("peak GiB per rank", lambda r: f"{r['peak_bytes'] / gib:.2f}"),
            ("model state GiB", lambda r: f"{r['model_state_bytes'] / gib:.3f}"),
            ("ZeRO formula GiB", lambda r: f"{r['formula_bytes'] / gib:.3f}")]
    names = list(results)
    lines = [f"{'':<20}" + "".join(f"{n:>18}" for n in names)]
    lines += [f"{label:<20}" + "".join(f"{fmt(results[n]):>18}" for n in names) for label, fmt in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
