"""notebook_model: the one knob (MFSDP_MODEL / MFSDP_DTYPE or a first-cell argument) that picks the
notebooks' model. throughput() itself runs in notebooks/06_memory (nbval)."""
import json
from pathlib import Path

import pytest

from mfsdp_kit.notebook import model as nm
from mfsdp_kit.config import ConfigError
from mfsdp_kit.cache import CACHE_ENV
from mfsdp_kit.models.tiny import SIZES, param_count, tiny


def test_defaults_follow_the_hardware():
    assert nm.resolve(on_gpu=False, env={}) == ("xs", "fp32")
    assert nm.resolve(on_gpu=True, env={}) == ("mw", "bf16")
    assert nm.resolve("auto", on_gpu=True, env={}) == ("mw", "bf16")


def test_environment_then_argument(tmp_path):
    env = {nm.ENV_MODEL: "l", nm.ENV_DTYPE: "fp32"}
    assert nm.resolve(on_gpu=True, env=env) == ("l", "fp32")
    assert nm.resolve("s", on_gpu=True, env=env) == ("s", "fp32")          # the first cell's MODEL wins
    assert nm.resolve(str(tmp_path), on_gpu=False, env={}) == (str(tmp_path.resolve()), "fp32")
    assert nm.resolve(on_gpu=True, env={nm.ENV_MODEL: ""}) == ("mw", "bf16")  # empty = unset


@pytest.mark.parametrize("env, field", [({nm.ENV_MODEL: "xxl"}, nm.ENV_MODEL),
                                        ({nm.ENV_MODEL: "/no/such/folder"}, nm.ENV_MODEL),
                                        ({nm.ENV_DTYPE: "fp8"}, nm.ENV_DTYPE)])
def test_bad_values_name_the_knob(env, field):
    with pytest.raises(ConfigError, match=field):
        nm.resolve(on_gpu=False, env=env)


def test_prepare_writes_the_tiny_folder_once(tmp_path, monkeypatch):
    monkeypatch.delenv(nm.ENV_MODEL, raising=False)
    monkeypatch.delenv(nm.ENV_DTYPE, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    m = nm.prepare(on_gpu=False, workdir=str(tmp_path))
    assert (m.choice, m.dtype, m.size, m.lr_scale) == ("xs", "fp32", "xs", 1.0)
    weights = Path(m.path) / "model.safetensors"
    assert Path(m.path).parent == tmp_path / "cache" and weights.is_file()
    written = weights.stat().st_mtime_ns
    again = nm.prepare(on_gpu=False, workdir=str(tmp_path / "other"))
    assert again.path == m.path and weights.stat().st_mtime_ns == written   # reused, not rewritten
    assert m.lr(3e-3) == 3e-3 and m.out("sft") == str(tmp_path / "sft")
    cfg = m.engine_config(use_megatron_fsdp=True)
    assert cfg.dtype == "fp32" and cfg.wrapper.use_megatron_fsdp
    assert m.engine_config(dtype="bf16").dtype == "bf16"                   # an override wins


def test_attention_is_sdpa_on_gpus_unless_a_sliding_window_needs_local(tmp_path):
    path = tiny(tmp_path / "xs", size="xs")
    assert nm.attention_backend(path, on_gpu=True, env={}) == "sdpa"
    assert nm.attention_backend(path, on_gpu=False, env={}) == "local"
    assert nm.attention_backend(path, on_gpu=False, env={nm.ENV_ATTENTION: "sdpa"}) == "sdpa"
    with pytest.raises(ConfigError, match=nm.ENV_ATTENTION):
        nm.attention_backend(path, on_gpu=True, env={nm.ENV_ATTENTION: "flash"})
    # a Qwen2 config whose sliding window is on in every layer, as transformers writes it: only "local" maps it
    from transformers import Qwen2Config
    config = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k != "layer_types"}
    windowed = tmp_path / "windowed"
    Qwen2Config.from_dict({**config, "use_sliding_window": True, "sliding_window": 4,
                           "max_window_layers": 0}).save_pretrained(windowed)
    assert nm.attention_backend(windowed, on_gpu=True, env={}) == "local"
    m = nm.NotebookModel(choice="xs", path=str(path), dtype="fp32", on_gpu=True, workdir=str(tmp_path),
                         attention_backend="sdpa")
    assert m.engine_config().kernels.attention_backend == "sdpa" and "sdpa attention" in str(m)


def test_a_user_folder_is_used_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv(nm.ENV_MODEL, str(tmp_path))
    m = nm.prepare(on_gpu=True, workdir=str(tmp_path / "work"))
    assert m.path == str(tmp_path.resolve()) and m.size is None and m.dtype == "bf16"
    assert m.lr_scale == nm.USER_LR_SCALE and not list(tmp_path.glob("tiny_*"))
    assert m.engine_config().kernels.fused_kernels == "auto"   # a folder of yours gets the kit's default


def test_a_tiny_size_runs_unfused_unless_asked():
    """Compiling RoPE/SwiGLU costs a notebook's engines seconds a tiny model never wins back."""
    m = nm.NotebookModel(choice="xs", path="/nowhere", dtype="bf16", on_gpu=True, workdir="/tmp",
                         attention_backend="sdpa")
    assert m.engine_config().kernels.fused_kernels is False
    assert m.engine_config(fused_kernels=True).kernels.fused_kernels is True


def test_gpt_spec_counts_the_folders_parameters(tmp_path):
    path = tiny(tmp_path / "xs", size="xs")
    spec = nm.gpt_spec(path, seq_len_tokens=256)
    s = SIZES["xs"]
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    qkv_biases = s["num_hidden_layers"] * (s["hidden_size"] + 2 * s["num_key_value_heads"] * head_dim)
    assert spec.param_count() + qkv_biases == param_count("xs")   # GPTSpec has no biases; Qwen2 has q/k/v ones
    assert spec.seq_len_tokens == 256 and spec.vocab_size == 128


def test_format_throughput_table():
    r = dict(tokens_per_s_per_gpu=12345.6, mfu=None, step_s=0.25, micro_batch_size=4, seq_len_tokens=256,
             peak_bytes=0, model_state_bytes=2**30, formula_bytes=2**29)
    table = nm.format_throughput({"FSDP N=2": r, "DDP N=2": {**r, "mfu": 0.4123}})
    assert "12,346" in table and "41.2%" in table and "1.000" in table and "0.500" in table


def test_main_writes_the_knobs_model_and_prints_its_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    nm.main(["xs"])
    line = capsys.readouterr().out.strip()
    folder = Path(line.split(": ", 1)[1].rsplit(" (", 1)[0])
    assert line.startswith("notebook model xs: ") and (folder / "model.safetensors").is_file()
    assert folder.parent == tmp_path / "cache"


def test_a_relative_folder_is_pinned_for_kernels_that_run_elsewhere(tmp_path, monkeypatch):
    """`MFSDP_MODEL=models/mine make lab`: the kernels run in notebooks/, so lab hands them the absolute path;
    the knob's other values pass through untouched, and a path that names nothing says where it was looked for."""
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert nm.pinned({"MFSDP_MODEL": "models/mine"}) == {"MFSDP_MODEL": str(tmp_path / "models" / "mine")}
    for untouched in ("", "auto", "mw", str(tmp_path / "models" / "mine"), "models/nothing"):
        expected = {"MFSDP_MODEL": untouched} if untouched.startswith("/") else {}
        assert nm.pinned({"MFSDP_MODEL": untouched}) == expected
    monkeypatch.chdir(tmp_path / "models")
    with pytest.raises(ConfigError, match=rf"read from {tmp_path / 'models'}"):
        nm.resolve("models/mine", on_gpu=False, env={})
