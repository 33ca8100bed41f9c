"""Tiny Hugging Face models built locally from a seed: a real HF folder, no download.

`tiny(path, arch="qwen2", size="xs", seed=0)` writes config.json, model.safetensors,
generation_config.json and a character-level tokenizer (tokenizer.json and friends), so
`AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)` load it.

The naive way, `Qwen2ForCausalLM(config).save_pretrained(path)`, runs HF's per-module init
(minutes for the 180 M "m" model on CPU) and its values depend on the global RNG. Here the
model is built on the meta device only to learn the parameter names and shapes, and each
tensor is drawn from its own `torch.Generator` seeded by (seed, name): same seed ->
bitwise-identical model.safetensors, in seconds.
"""
from __future__ import annotations

import pathlib
import zlib

import torch

from .. import folders
from ..config import bad_value
from . import archs

ARCHS = ("qwen2", "llama")
"""The model types (`models.archs` families) the kit's own tiny model is written as."""

SIZES: dict[str, dict[str, int]] = {
    # xs: trains in seconds on 2 CPU cores. ~0.1 M params.
    "xs": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128),
    # s: ~3 M params.
    "s": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
              num_key_value_heads=2, intermediate_size=768),
    # m: for GPU runs. per layer: attention 1024*(1024+2*256) + 1024*1024 = 2.62 M,
    # MLP 3 * 1024 * 2816 = 8.65 M -> 11.3 M * 16 layers = 180 M (+0.26 M embeddings).
    "m": dict(num_hidden_layers=16, hidden_size=1024, num_attention_heads=16,
              num_key_value_heads=4, intermediate_size=2816),
    # mw: m's parameters in 4 wide layers (the notebooks' GPU default). per layer: attention 2048*(2048+2*512)
    # + 2048*2048 = 10.5 M, MLP 3 * 2048 * 5632 = 34.6 M -> 45.1 M * 4 = 180.4 M (+0.52 M embeddings). A
    # notebook's 512-token step waits on megatron's per-layer host work, not on the GPU: a quarter of the
    # layers is a quarter of that work for the same FLOPs.
    "mw": dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=16,
               num_key_value_heads=4, intermediate_size=5632),
    # l: the ~1.7 B model of the GPU benchmarks (offload, sync). per layer: attention
    # 2048*(2048+2*512) + 2048*2048 = 10.5 M, MLP 3 * 2048 * 8192 = 50.3 M -> 60.8 M * 28 = 1.70 B.
    "l": dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16,
              num_key_value_heads=4, intermediate_size=8192),
}
"""Shapes per size; every head count divides by 2 so tensor parallel 2 works."""

MAX_POSITION_EMBEDDINGS = 256
INIT_STD = 0.02
"""Weights ~ normal(0, INIT_STD); norm weights = 1."""

# ---- tokenizer: one token per character --------------------------------------------------
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, USER, ASSISTANT)
"""Ids 0..5 in this order: pad=0, bos=1, eos=2, unk=3, <|user|>=4, <|assistant|>=5."""
CHARACTERS = ("0123456789" + "+-*=()" + " " + "abcdefghijklmnopqrstuvwxyz"
              + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + ".,?:!'" + "\n")
VOCAB_MULTIPLE = 128
"""Vocab padded with <|reserved_i|> to a multiple of this (megatron pads anyway), so the HF
config's vocab_size equals megatron's padded size and logits compare 1:1."""

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}" + EOS
    + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)
"""system -> "content\\n", user -> "<|user|>content", assistant -> "<|assistant|>content</s>";
the generation prompt is "<|assistant|>", the end of a turn eos. The kit renders all chat text
through a tokenizer's template (`mfsdp_kit.train.chat`), this one for the tiny model, a user's own for
theirs: one code path."""


def vocab() -> list[str]:
    """Token strings by id: special tokens, characters, then reserved padding tokens."""
    base = list(SPECIAL_TOKENS) + list(CHARACTERS)
    padded = -(-len(base) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return base + [f"<|reserved_{i}|>" for i in range(padded - len(base))]


def build_tokenizer():
    """A `PreTrainedTokenizerFast`: WordLevel over single characters, chat markers as specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab())}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT], chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False, model_max_length=MAX_POSITION_EMBEDDINGS)


# ---- model ---------------------------------------------------------------------------------
def _check(field: str, value: str, allowed) -> None:
    if value not in allowed:
        raise bad_value(field, value, ", ".join(map(repr, allowed)))


def hf_config(*, arch: str = "qwen2", size: str = "xs", positions: int = MAX_POSITION_EMBEDDINGS):
    """The transformers config of a tiny model (fp32, untied embeddings, padded vocab); `positions`: its
    max_position_embeddings in tokens (longer rollouts need more)."""
    _check("arch", arch, ARCHS)
    _check("size", size, tuple(SIZES))
    if not (isinstance(positions, int) and positions > 0):
        raise bad_value("positions", positions, "a positive integer (tokens)")
    import transformers
    cls = getattr(transformers, archs.spec_for(arch).config_class)
    return cls(**SIZES[size], vocab_size=len(vocab()), max_position_embeddings=positions,
               tie_word_embeddings=False, torch_dtype="float32", rms_norm_eps=1e-6,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model_class(arch: str):
    import transformers
    return getattr(transformers, archs.spec_for(arch).architecture)


def param_count(size: str, *, arch: str = "qwen2") -> int:
    """Parameters of a tiny model, counted on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = _model_class(arch)(hf_config(arch=arch, size=size))
    return sum(p.numel() for p in model.parameters())


def _tensor(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """Norm weights = 1; every other weight and bias ~ normal(0, INIT_STD).

    Biases (Qwen2's q/k/v) are random rather than HF's zeros, so a conversion that drops
    them fails a parity test instead of passing by luck."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).mul_(INIT_STD)


def state_dict(*, arch: str = "qwen2", size: str = "xs", seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights by HF parameter name (persistent buffers excluded)."""
    with torch.device("meta"):
        model = _model_class(arch)(hf_config(arch=arch, size=size))
    return {name: _tensor(name, p.shape, seed) for name, p in model.state_dict().items()}


def tiny(path, *, arch: str = "qwen2", size: str = "xs", seed: int = 0,
         positions: int = MAX_POSITION_EMBEDDINGS) -> pathlib.Path:
    """Write a loadable HF folder at `path` (created if missing) and return it as a Path; `positions` as
    `hf_config`'s (the weights do not depend on it: RoPE has none)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    config = hf_config(arch=arch, size=size, positions=positions)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.architectures = [_model_class(arch).__name__]
    config.save_pretrained(path)
    save_file(state_dict(arch=arch, size=size, seed=seed), path / "model.safetensors",
              metadata={"format": "pt"})
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False,
                     max_new_tokens=16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def cache_key(*, arch: str, size: str, seed: int) -> str:
    """Folder name of one tiny model: what it is, plus a digest of everything its bytes depend on (this module's
    source: shapes, init, tokenizer; torch's RNG; transformers' file formats), so a change writes a new one."""
    digest = zlib.crc32(pathlib.Path(__file__).read_bytes())
    digest = zlib.crc32(f"{torch.__version__} {_version('transformers')}".encode(), digest)
    return f"tiny-{arch}-{size}-seed{seed}-{digest:08x}"


def _version(package: str) -> str:
    """An installed package's version from its metadata: importing transformers to read `__version__` costs
    ~1.2 s, and every notebook's first cell looks its model up here."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:   # importable without metadata (a source checkout on sys.path)
        return __import__(package).__version__


def cached(*, arch: str = "qwen2", size: str = "xs", seed: int = 0, root=None) -> pathlib.Path:
    """The folder `tiny(...)` writes, written once per machine (under `cache.root()`, or `root`) and reused:
    the 180 M "m" model takes seconds to draw and write, and every notebook asks for it. The folder appears
    whole or not at all (written aside, then renamed into place); a reader must not write into it."""
    _check("arch", arch, ARCHS)
    _check("size", size, tuple(SIZES))
    from .. import cache
    root = pathlib.Path(root) if root is not None else cache.root()
    final = root / cache_key(arch=arch, size=size, seed=seed)
    if (final / "model.safetensors").is_file():
        return final
    try:
        tmp = folders.aside(final)
    except OSError as e:
        raise OSError(f"cannot write tiny models under {root} ({e.strerror}); set ${cache.CACHE_ENV} to a writable "
                      "folder") from e
    try:
        tiny(tmp, arch=arch, size=size, seed=seed)
        folders.place(tmp, final, replace=False)   # fails if another process put a (non-empty) one there first
    except OSError:
        if not (final / "model.safetensors").is_file():   # that one is as good as ours
            raise
    finally:
        folders.discard(tmp)
    return final
