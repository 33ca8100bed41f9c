"""Checkpoint scenario (2 gloo ranks): a load refused for damaged bytes leaves the live job as it was.

Issue 69 item 6: 256 flipped bytes in a shard were refused (`CheckpointCorruptError`), but only after the read
had copied other files' tensors, and the damaged file's own bytes before the damage, into the live model.
"""
from __future__ import annotations

from mfsdp_kit.checkpoint import CheckpointManager
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.distributed import runtime
from scenarios_ckpt import _batches, _build, _compare, _flat, _train, local_snapshot  # noqa: E402
from scenarios_ckpt_hardening import _damage, _failure  # noqa: E402


def _live(chunks, opt, fsdp: bool) -> dict:
    """Every tensor this rank trains with, copied: the checkpointed state (model, optimizer, RNG:
    `local_snapshot`) and each parameter itself (Megatron-FSDP: its compute weights too)."""
    out = local_snapshot(chunks, opt, fsdp)
    out.update(_flat({"param": {str(i): dict(c.named_parameters()) for i, c in enumerate(chunks)}}))
    return out


def refused_load(*, root: str, fsdp: bool) -> dict:
    """Save steps 1 and 2, train step 3 (the live job now differs from both), flip 256 bytes in rank 1's
    first shard file of step 2, load it: refused, and every tensor as before; then `fallback=True` loads step 1."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7)
    runtime.init(cfg)
    batches = _batches()
    chunks, opt, sched = _build(cfg, 7)
    mgr = CheckpointManager(root)
    _train(chunks, opt, sched, batches, 0, 1)
    mgr.save(1, chunks, opt, sched, extra={"data_position": 1})
    at_step1, sched_at_step1 = _live(chunks, opt, fsdp), sched.state_dict()
    _train(chunks, opt, sched, batches, 1, 2)
    mgr.save(2, chunks, opt, sched, extra={"data_position": 2})
    at_step2 = _live(chunks, opt, fsdp)
    _train(chunks, opt, sched, batches, 2, 3)
    _damage(mgr.path(2))
    before, sched_before = _live(chunks, opt, fsdp), sched.state_dict()
    refused = _failure(lambda: mgr.load(chunks, opt, sched))
    untouched = _compare(before, _live(chunks, opt, fsdp))
    sched_untouched = sched.state_dict() == sched_before
    info = mgr.load(chunks, opt, sched, fallback=True)
    fell_back = _compare(at_step1, _live(chunks, opt, fsdp))
    # megatron's scheduler.load_state_dict adds the saved num_steps to the live one's (3 + 1 = 4 before
    # components.load set it back): loaded into this live job, the scheduler must say step 1 too
    sched_fell_back = sched.state_dict() == sched_at_step1
    moved = not _compare(at_step2, before)["all_equal"]   # step 3 changed the live job: a read would show
    runtime.shutdown()
    return dict(refused=refused, untouched=untouched, sched_untouched=sched_untouched, moved=moved,
                shard=str(mgr.path(2) / "__1_0.distcp"), step=info["step"], fallback_from=info["fallback_from"],
                fell_back=fell_back, sched_fell_back=sched_fell_back)
