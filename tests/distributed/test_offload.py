"""Offload/reload of the model state: bitwise round trip, identical training, clear misuse errors."""
import pytest
import torch

from mfsdp_kit.distributed import offload
from mfsdp_kit.config import ConfigError, EngineConfig, Offload, Wrapper
from tests.dist import launch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The four 2-rank runs in one job, one after another (each inits and shuts down its own layout)."""
    workdir = str(tmp_path_factory.mktemp("offload"))
    calls = [["scenarios_offload:roundtrip", dict(fsdp=True, workdir=workdir)],
             ["scenarios_offload:roundtrip", dict(fsdp=False, workdir=workdir)],
             ["scenarios_offload:losses", dict(fsdp=True, workdir=workdir, steps=6)],
             ["scenarios_offload:grpo_offload", dict(workdir=workdir)]]
    return dict(zip([True, False, "losses", "grpo"], launch.run("sequence", calls=calls)))


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "ddp"])
def test_roundtrip_is_bitwise_and_frees_the_storages(runs, fsdp):
    r = runs[fsdp]
    print(r)
    assert r["mismatched"] == []
    assert all(r["counts"][k] > 0 for k in ("model_weights", "main_grads", "optimizer_states"))
    assert all(v > 0 for k, v in r["by_kind"].items() if k != "main_weights" or fsdp)
    assert r["storage_bytes_offloaded"] == 0  # every device storage was really released
    assert r["grad_copies"][0] > 0 and r["grad_copies"][1] == 0  # and the last step's grad copies dropped
    assert r["step_after_reload"] > 0
    for key in ("step_offloaded", "forward_offloaded", "optimizer_step_offloaded", "assert_resident"):
        assert r[key].startswith("OffloadedError") and "offload.reload(chunks, optimizer)" in r[key], key
    assert r["offload_twice"].startswith("OffloadedError: already offloaded")
    for key in ("reload_first", "reload_twice"):
        assert r[key].startswith("NotOffloadedError: reload: not offloaded"), key


def test_training_continues_with_identical_losses(runs):
    r = runs["losses"]
    print(r)
    assert r["plain"] == r["between"]  # bitwise: offload + reload between every step
    assert r["plain"] == r["stream"]  # optimizer state streamed to the device for each step
    assert r["final_state_equal"]
    assert len(r["plain"]) == 6 and all(b > 0 for b in r["streamed_bytes"])


def test_grpo_offload_during_rollout_changes_nothing(runs):
    r = runs["grpo"]
    print(r)
    assert r["False"] == r["True"]
    assert r["weights_equal"] and r["resident_after_True"]


def test_unsupported_wrapper_and_reload_without_offload():
    with pytest.raises(offload.UnsupportedWrapperError, match="FullyShardedDataParallel"):
        offload.offload([torch.nn.Linear(2, 2)], object())
    with pytest.raises(offload.NotOffloadedError, match="not offloaded"):
        offload.reload([], object())


def test_optimizer_offload_field_is_validated():
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), offload=Offload(optimizer_offload=True))
    assert cfg.validate(on_gpu=False).offload.optimizer_offload
    with pytest.raises(ConfigError, match="^offload.optimizer_offload='yes'"):
        EngineConfig(offload=Offload(optimizer_offload="yes"))   # refused when made
