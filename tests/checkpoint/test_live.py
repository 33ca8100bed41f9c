"""A checkpoint loaded into the model that is training, in place (a notebook going back to an earlier step)."""
import pytest

from tests.dist import launch


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "ddp"])
def test_a_load_in_place_takes_effect_after_forwards(tmp_path, fsdp):
    """Megatron-FSDP prefetches the next forward's all-gathers: a load must drop them, or the model keeps computing
    with the weights it had before the load (the loaded shards sit unused until the next optimizer step)."""
    r = launch.run("scenarios_ckpt_live:load_in_place", nproc=2, workdir=str(tmp_path), fsdp=fsdp)
    assert r["moved"] > 1e-3 and r["loaded"] == 0.0, r
