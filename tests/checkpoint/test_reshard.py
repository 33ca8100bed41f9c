"""Resuming at another data-parallel size (issue 51): Megatron-FSDP 1 -> 2 -> 1 ranks equals the straight run;
DDP's per-rank optimizer state at another world size is refused by name (tests/dist/scenarios_ckpt_reshard.py)."""
from __future__ import annotations

import pytest

from tests.dist import launch

SCEN = "scenarios_ckpt_reshard:"


@pytest.fixture(scope="module")
def fsdp_1_2_1(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    straight = launch.run(SCEN + "straight", nproc=1, root=root)
    two = launch.run(SCEN + "leg", nproc=2, root=root, load_step=2, save_step=4, stop=4)
    one = launch.run(SCEN + "leg", nproc=1, root=root, load_step=4, save_step=6, stop=6)
    return straight, two, one


def test_fsdp_resumes_1_to_2_to_1_ranks_with_the_straight_losses(fsdp_1_2_1):
    straight, two, one = fsdp_1_2_1
    assert two["saved_world"] == 1 and one["saved_world"] == 2
    assert "optimizer" in two["restored"] and "optimizer" in one["restored"]
    resumed = two["losses"] + one["losses"]
    print("straight", straight["losses"][2:], "\nresumed ", resumed)
    assert resumed == pytest.approx(straight["losses"][2:], rel=1e-5, abs=1e-6)


def test_ddp_optimizer_at_another_world_size_is_refused_by_name(tmp_path):
    launch.run(SCEN + "straight", nproc=1, root=str(tmp_path), fsdp=False)
    r = launch.run(SCEN + "ddp_refused", nproc=2, root=str(tmp_path))
    assert "optimizer state was saved with fsdp=False, world_size=1" in r["refusal"]
    assert "DDP optimizer state is per rank" in r["refusal"] and "optimizer=None" in r["refusal"]
    assert r["weights_only"] == ["model", "rng"]
