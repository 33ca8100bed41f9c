"""`EngineConfig`'s old flat names (`config.flat`): every use warns naming the nested spelling and the release
that drops them, and still works until then."""
import dataclasses
import pickle
import warnings

import pytest

from mfsdp_kit.config import ConfigError, EngineConfig
from mfsdp_kit.config.flat import FLAT_NAMES, REMOVED_IN
from mfsdp_kit.config.sections import SECTIONS, Communication, Kernels, Offload, Parallelism, Wrapper


@pytest.mark.parametrize("flat", sorted(FLAT_NAMES))
def test_a_flat_keyword_warns_naming_its_new_field_and_still_works(flat):
    path = FLAT_NAMES[flat]
    section, name = path.split(".")
    value = getattr(getattr(EngineConfig(), section), name)   # the default
    value = {"tensor_model_parallel_size": 2, "use_megatron_fsdp": True, "attention_backend": "sdpa"}.get(flat, value)
    with pytest.warns(DeprecationWarning, match=rf"EngineConfig\({flat}=\.\.\.\) is deprecated: set {path} .*"
                                                rf"removed in mfsdp_kit {REMOVED_IN}") as w:
        cfg = EngineConfig(**{flat: value})
    assert w[0].filename == __file__   # the warning points at the caller's line
    assert getattr(getattr(cfg, section), name) == value
    assert cfg == EngineConfig(**{section: SECTIONS[section](**{name: value})})


@pytest.mark.parametrize("flat", sorted(FLAT_NAMES))
def test_reading_or_assigning_a_flat_name_warns_naming_its_new_field(flat):
    """Issue 52: reads did not warn, so both spellings lived on in tab completion."""
    path = FLAT_NAMES[flat]
    section, name = path.split(".")
    cfg = EngineConfig()
    with pytest.warns(DeprecationWarning, match=rf"EngineConfig\.{flat} is deprecated: read cfg\.{path} instead; "
                                                rf"removed in mfsdp_kit {REMOVED_IN}") as w:
        value = getattr(cfg, flat)
    assert w[0].filename == __file__ and value == getattr(getattr(cfg, section), name)
    assigned = rf"EngineConfig\.{flat} = \.\.\. is deprecated: assign cfg\.{path} "
    with pytest.warns(DeprecationWarning, match=assigned) as w:
        setattr(cfg, flat, value)
    assert w[0].filename == __file__ and cfg == EngineConfig()


def test_the_removal_release_is_the_next_minor_one_and_documented():
    import pathlib
    import re
    root = pathlib.Path(__file__).parents[2]
    major, minor = re.search(r'^version = "(\d+)\.(\d+)\.', (root / "pyproject.toml").read_text(), re.M).groups()
    assert REMOVED_IN == f"{major}.{int(minor) + 1}.0"
    for doc in ("CHANGELOG.md", "docs/design.md"):
        assert f"mfsdp_kit {REMOVED_IN}" in (root / doc).read_text(), doc


def test_the_sectioned_config_makes_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = EngineConfig(parallelism=Parallelism(tensor_model_parallel_size=2),
                           wrapper=Wrapper(use_megatron_fsdp=True),
                           kernels=Kernels(fused_kernels=True), communication=Communication(),
                           offload=Offload(optimizer_offload=True), dtype="bf16")
        assert (cfg.parallelism.tensor_model_parallel_size, cfg.wrapper.use_megatron_fsdp,
                cfg.offload.optimizer_offload) == (2, True, True)
        assert EngineConfig.from_yaml(cfg.to_yaml()) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg   # to engines
        assert cfg.to_dict()["parallelism"]["tensor_model_parallel_size"] == 2


def test_flat_assignment_and_replace_leave_the_original_alone():
    cfg = EngineConfig(parallelism=Parallelism(tensor_model_parallel_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        other = dataclasses.replace(cfg, attention_backend="sdpa")   # what scenarios and bench scripts do
    with pytest.warns(DeprecationWarning, match="assign cfg.parallelism.tensor_model_parallel_size"):
        other.tensor_model_parallel_size = 4                         # a new section, not a shared one
    assert (cfg.parallelism.tensor_model_parallel_size, cfg.kernels.attention_backend) == (2, "auto")
    assert (other.parallelism.tensor_model_parallel_size, other.kernels.attention_backend) == (4, "sdpa")


def test_a_flat_dict_written_before_the_sections_still_loads():
    old = {"tensor_model_parallel_size": 2, "use_megatron_fsdp": True, "nccl_max_ctas": None, "dtype": "bf16"}
    with pytest.warns(DeprecationWarning, match="parallelism.tensor_model_parallel_size"):
        cfg = EngineConfig.from_dict(old)
    assert cfg == EngineConfig(parallelism=Parallelism(tensor_model_parallel_size=2),
                               wrapper=Wrapper(use_megatron_fsdp=True), dtype="bf16")
    with pytest.raises(ConfigError, match=r"EngineConfig\.parallelism\.tensor_parallel_size=2 .*did you mean"):
        EngineConfig.from_dict({"parallelism": {"tensor_parallel_size": 2}})
