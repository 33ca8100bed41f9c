"""perf.floors: an RL iteration's floors by hand (FLOP-bound and bandwidth-bound rollouts, data-parallel GPUs
sharing the FLOPs), a GRPO history's per-iteration floors, and no floor claimed where the rates are unknown."""
import pytest
import torch

from mfsdp_kit.perf import floors
from mfsdp_kit.rl.grpo import GRPOHistory

HW = floors.Hardware(name="test", matmul_flops=1e12, memory_bytes_per_s=1e9)


def test_rl_iteration_by_hand():
    f = floors.rl_iteration(params=1_000_000, train_tokens=3_000, new_tokens=1_000, decode_steps=10,
                            sync_bytes=5e8, hw=HW)
    assert f["logprob_s"] == pytest.approx(2e6 * 3e3 / 1e12)
    assert f["update_s"] == pytest.approx(6e6 * 3e3 / 1e12) == pytest.approx(3 * f["logprob_s"])
    assert f["sync_s"] == pytest.approx(1.0)                         # read + write of 5e8 bytes at 1e9 B/s
    assert f["rollout_s"] == pytest.approx(10 * 2e6 / 1e9)           # 10 steps, each reading 2 MB of weights
    flop_bound = floors.rl_iteration(params=1_000_000, train_tokens=3_000, new_tokens=1e7, decode_steps=10,
                                     sync_bytes=0, hw=HW)
    assert flop_bound["rollout_s"] == pytest.approx(2e6 * 1e7 / 1e12)


def test_data_parallel_gpus_share_the_flops_and_the_sync():
    one = floors.rl_iteration(params=10**6, train_tokens=10**4, new_tokens=10**7, decode_steps=1, sync_bytes=1e9, hw=HW)
    four = floors.rl_iteration(params=10**6, train_tokens=10**4, new_tokens=10**7, decode_steps=1, sync_bytes=1e9,
                               hw=HW, world=4)
    assert all(four[k] == pytest.approx(one[k] / 4) for k in one)


def test_a_history_gets_one_floor_per_iteration_from_its_own_lengths():
    h = GRPOHistory(response_tokens=[10.0, 20.0], response_tokens_max=[30, 50], prompt_tokens=[5.0, 5.0],
                    sync_bytes=[100, 100])
    rows = floors.rl_iterations(h, params=10**6, hw=HW, samples=8)
    assert len(rows) == 2
    assert rows[1]["update_s"] == pytest.approx(6e6 * (5 + 20) * 8 / 1e12)
    assert rows[1]["rollout_s"] == pytest.approx(50 * 2e6 / 1e9)     # the longest response bounds the steps
    engine = floors.rl_iterations(h, params=10**6, hw=HW, samples=8, decode_steps=[60, 70])
    assert engine[1]["rollout_s"] == pytest.approx(70 * 2e6 / 1e9)
    assert floors.rl_iterations(h, params=10**6, hw=None, samples=8) is None
    lora = floors.rl_iterations(h, params=10**6, hw=HW, samples=8, lora=True)   # no weight gradients: 4N
    assert lora[1]["update_s"] == pytest.approx(4e6 * (5 + 20) * 8 / 1e12)
    others = lambda row: {k: v for k, v in row.items() if k != "update_s"}
    assert others(lora[1]) == others(rows[1])


def test_hardware_is_named_or_none(monkeypatch):
    if not torch.cuda.is_available():
        assert floors.hardware() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert floors.hardware() is floors.HARDWARE["H200"]
    assert floors.hardware("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert floors.hardware().memory_bytes_per_s == 3.35e12
    for other in ("NVIDIA A10", "NVIDIA H100 PCIe"):   # unlisted, or an H100 of other rates: no floor claimed
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=other: name)
        assert floors.hardware() is None


def test_mfu_from_a_floor():
    assert floors.mfu(2.0, 1.0, floors.HARDWARE["H200"]) == pytest.approx(0.5 * 790 / 989)
