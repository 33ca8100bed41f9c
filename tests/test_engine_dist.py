"""FSDP vs DDP parity, sharding, TP x FSDP and multi-chunk sync on real gloo process groups."""
import pytest

from mfsdp_kit.parity import compare_curves
from tests.dist import launch


def same_training(a: dict, b: dict):
    """Every step compared tightly: these runs are a few steps long (mfsdp_kit.parity says why)."""
    report = compare_curves(a["losses"], b["losses"], exact_steps=len(a["losses"]),
                            reference_grad_norm=a["grad_norms"], candidate_grad_norm=b["grad_norms"])
    print(report)
    return report.check()


@pytest.fixture(scope="module")
def ddp_fsdp():
    return launch.run("train_losses", nproc=2, fsdp=False), launch.run("train_losses", nproc=2, fsdp=True)


@pytest.mark.parity
def test_fsdp_matches_ddp_losses(ddp_fsdp):
    ddp, fsdp = ddp_fsdp
    print("DDP losses ", ddp["losses"], "\nFSDP losses", fsdp["losses"])
    assert fsdp["wrapper"] == "FullyShardedDataParallel" and ddp["wrapper"] == "DistributedDataParallel"
    assert len(fsdp["losses"]) == 5
    same_training(ddp, fsdp)
    assert fsdp["losses"][-1] < fsdp["losses"][0]  # it trains


def test_fsdp_shards_parameters(ddp_fsdp):
    ddp, fsdp = ddp_fsdp
    total = fsdp["spec_params"]
    print("FSDP local params per rank", fsdp["local_numel"], "of", total, "; DDP", ddp["local_numel"])
    assert fsdp["global_numel"] == total == ddp["global_numel"]
    assert ddp["local_numel"] == [total, total]
    for n in fsdp["local_numel"]:
        assert abs(n / total - 0.5) < 0.05, fsdp["local_numel"]


@pytest.mark.parity
def test_tp2_fsdp_matches_tp1(capsys):
    tp1 = launch.run("train_losses", nproc=4, fsdp=True, tp=1, steps=3)
    tp2 = launch.run("train_losses", nproc=4, fsdp=True, tp=2, steps=3)
    print("TP1xDP4", tp1["losses"], "\nTP2xDP2", tp2["losses"])
    same_training(tp1, tp2)


def test_sync_covers_every_chunk():
    full = launch.run("sync_two_chunks", nproc=2)
    assert full["synced"] == 2 and full["dtensor_chunks"] == [True, True]
    assert full["restored"] == 2 and full["raw_after_restore"] == [True, True]
    buggy = launch.run("sync_two_chunks", nproc=2, first_only=True)  # verl's first version
    assert buggy["dtensor_chunks"] == [True, False]


def test_release_lets_a_dropped_fsdp_model_be_freed():
    assert launch.run("release_frees", nproc=2, release=True)["freed"]
    # megatron-core 0.16.1 leaks it otherwise; when this fails upstream fixed it and release() can go
    assert not launch.run("release_frees", nproc=2, release=False)["freed"]


def test_no_all_gather_left_in_flight_on_cpu():
    settled = launch.run("pending_gathers", nproc=2, settle=True)
    assert settled == dict(after_step=0, after_forward=0)
    raw = launch.run("pending_gathers", nproc=2, settle=False)  # what Megatron-FSDP leaves by itself
    assert raw["after_step"] > 0 and raw["after_forward"] > 0
