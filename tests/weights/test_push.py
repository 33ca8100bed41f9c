"""weights.push (tests/dist/scenarios_push.py): a trainer in a world of its own pushes its weights to a rollout
process outside it, bit for bit, with the version; a receiver that lacks the names fails by name and the sender
returns; a closed link frees a receiver waiting in a broadcast with the reason."""
from mfsdp_kit.models import archs
from tests.dist import launch


def test_push_lands_bitwise_with_its_version_across_two_worlds(tmp_path):
    src = str(tmp_path / "tiny")
    archs.write_tiny("Qwen2ForCausalLM", src, vocab_size=256)
    r = launch.run("scenarios_push:two_worlds", src=src, link_port=launch.free_port(), world_port=launch.free_port())
    print(r)
    for version in (1, 2):
        push = r[f"push{version}"]
        assert push["equal"] and push["version"] == version and push["moved"], push
        assert push["tensors"] == push["names"] > 5 and push["bytes"] > 0
    assert r["bad_send"] == r["push1"]["tensors"]
    assert "has no counterpart in Linear" in r["bad_receive"], r["bad_receive"]
    # close: the receiver waiting in a broadcast returns at once with the reason, the first reason stays
    assert r["closed"]["error"] == "LinkClosed" and r["closed"]["reason"] == "the trainer stopped after iteration 3"
    assert r["closed"]["seconds"] < 30 and r["first_reason_kept"], r["closed"]


def test_connect_refuses_bad_arguments_by_name():
    import pytest
    from mfsdp_kit.weights import push
    with pytest.raises(ValueError, match="backend='mpi'.*gloo \\| nccl"):
        push.connect(host="127.0.0.1", port=1, rank=0, size=2, backend="mpi")
    with pytest.raises(ValueError, match="rank=2"):
        push.connect(host="127.0.0.1", port=1, rank=2, size=2)
