"""The kit's instance and module patches outside compat's import-time rows: each is a registry row whose upstream
problem is still there (a failure here means upstream fixed it: delete the patch and its row), written for the
installed version, and recorded when applied."""
import pytest

from mfsdp_kit import compat
from mfsdp_kit.compat import registry
from mfsdp_kit.compat.patches import bridge_load, cross_entropy, fsdp_gather_hold, main_grads, rope, swiglu, \
    value_loss

ROWS = {
    "grad_upcast: update_main_grads deferred": main_grads.DEFERRED,
    "grad_upcast: the grad norm from the bf16 shards": main_grads.GRADS_FOR_NORM,
    "keep_gathered: release_bucket held": fsdp_gather_hold.PATCH,
    "models.vocab: HF tensors padded on load": bridge_load.LOAD_HOOK,
    "fused_cross_entropy: the loss from bf16 logits": cross_entropy.PATCH,
    "fused_kernels: the RoPE slots filled": rope.PATCH,
    "fusion_kernels='triton': the MLP's SwiGLU": swiglu.PATCH,
    "rl.critic: the per-token output is compute_language_model_loss's": value_loss.PATCH,
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_still_needed_and_written_for_this_version(name):
    compat.apply("bridge")   # the bridge's sources are read through its import
    row = ROWS[name]
    assert ":" in row.upstream and any(c.isdigit() for c in row.upstream), row.upstream   # file:line
    assert row.still_needed(), f"{name}: upstream no longer shows the problem ({row.target}); delete the patch"
    assert registry.written_for_installed(row.package)


def test_applying_a_patch_records_its_row():
    class Pipeline:   # the two methods fsdp_gather_hold replaces, as megatron's AllGatherPipeline has them
        def release_bucket(self, bucket_id, bwd, lazy=False):
            return ("released", bucket_id)

        def reset(self):
            return "reset"
    pipeline = Pipeline()
    compat.apply("keep_gathered", pipeline=pipeline)
    assert fsdp_gather_hold.PATCH in registry.ACTIVE
    setattr(pipeline, fsdp_gather_hold.HOLD, True)
    assert pipeline.release_bucket(0, False) is None and pipeline.reset() == "reset"
    assert pipeline.release_bucket(1, False) == ("released", 1)   # reset let go of the hold
