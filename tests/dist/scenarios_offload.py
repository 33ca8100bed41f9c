"""Offload scenarios (2 gloo ranks, fp32, the embedded tiny HF model), run by launch.run.

Models loaded twice from one HF folder start bit-identical, so one process compares a plain
run with an offloaded twin step for step."""
from __future__ import annotations

import dataclasses

import torch

from mfsdp_kit.train import data
from mfsdp_kit.distributed import engine, offload, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.train import forward_backward, step
from scenarios_train import tiny_world


def _setup(*, fsdp: bool, workdir: str):
    return tiny_world(fsdp=fsdp, workdir=workdir)


def _model(cfg, src):
    model = load(src, cfg)
    return model, engine.build_optimizer(model.chunks, OptimConfig(lr=3e-3), cfg)


def _snapshot(chunks, opt) -> dict:
    return {k: [t.detach().clone() for t in ts] for k, ts in offload.shard_tensors(chunks, opt).items()}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the scenario reports which error and its message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _grad_copies(chunks, opt) -> int:
    """Grad tensors the optimizer step left behind (Megatron-FSDP's dist_main_grad, params' .grad)."""
    from mfsdp_kit.distributed.introspect import inner_optimizers
    n = sum(len(c.module.param_and_grad_buffer.dist_main_grad) for c in chunks if engine.is_fsdp(c))
    return n + sum(p.grad is not None for o in inner_optimizers(opt) for g in o.optimizer.param_groups
                   for p in g["params"])


def roundtrip(*, fsdp: bool, workdir: str) -> dict:
    """After one step: offload + reload restores every shard bitwise; misuse raises clearly."""
    cfg, src, tok = _setup(fsdp=fsdp, workdir=workdir)
    model, opt = _model(cfg, src)
    batches = data.batches(data.ArithmeticTask(digits=1).train_pairs(90), tok, seq_len_tokens=16, global_batch=8)
    batch = next(batches)
    result = dict(reload_first=_error(lambda: offload.reload(model.chunks, opt)))
    step(model.chunks, opt, batch, micro_batch_size=4)
    before = _snapshot(model.chunks, opt)
    grads_before = _grad_copies(model.chunks, opt)
    stats = offload.offload(model.chunks, opt)
    result["grad_copies"] = [grads_before, _grad_copies(model.chunks, opt)]
    live = offload.shard_tensors(model.chunks, opt)
    result.update(
        counts={k: len(v) for k, v in before.items()}, offload_bytes=stats["bytes"], by_kind=stats["bytes_by_kind"],
        storage_bytes_offloaded=sum(t.untyped_storage().nbytes() for ts in live.values() for t in ts),
        step_offloaded=_error(lambda: step(model.chunks, opt, batch, micro_batch_size=4)),
        forward_offloaded=_error(lambda: forward_backward(model.chunks, batch, micro_batch_size=4,
                                                          forward_only=True)),
        optimizer_step_offloaded=_error(lambda: opt.step()),
        assert_resident=_error(lambda: offload.assert_resident(model.chunks, opt)),
        offload_twice=_error(lambda: offload.offload(model.chunks, opt)))
    offload.reload(model.chunks, opt)
    after = _snapshot(model.chunks, opt)
    result["mismatched"] = [f"{k}[{i}]" for k in before for i, (a, b) in enumerate(zip(before[k], after[k]))
                            if not torch.equal(a, b)]
    result["reload_twice"] = _error(lambda: offload.reload(model.chunks, opt))
    result["step_after_reload"] = step(model.chunks, opt, batch, micro_batch_size=4).loss
    runtime.shutdown()
    return result


def losses(*, fsdp: bool, workdir: str, steps: int = 6) -> dict:
    """Three twins: plain; offload+reload between every step; optimizer streamed per step."""
    cfg, src, tok = _setup(fsdp=fsdp, workdir=workdir)
    twins = {mode: _model(cfg, src) for mode in ("plain", "between")}
    # EngineConfig.offload.optimizer_offload: build_optimizer streams states + main weights per step
    twins["stream"] = _model(dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, optimizer_offload=True)),
                             src)
    streamed_bytes = []
    out = {mode: [] for mode in twins}
    pairs = data.ArithmeticTask(digits=1).train_pairs(90)
    for mode, (model, opt) in twins.items():
        batches = data.batches(pairs, tok, seq_len_tokens=16, global_batch=8, seed=1)
        for _ in range(steps):
            out[mode].append(step(model.chunks, opt, next(batches), micro_batch_size=2).loss)
            if mode == "between":
                offload.offload(model.chunks, opt)
                offload.reload(model.chunks, opt)
            if mode == "stream":
                streamed_bytes.append(getattr(opt, "_mfsdp_offload_state").nbytes)
    plain, between = (_snapshot(twins[m][0].chunks, twins[m][1]) for m in ("plain", "between"))
    out["final_state_equal"] = all(torch.equal(a, b) for k in plain for a, b in zip(plain[k], between[k]))
    out["streamed_bytes"] = streamed_bytes
    runtime.shutdown()
    return out


def grpo_offload(*, workdir: str) -> dict:
    """One GRPO iteration on twins, with and without offload_during_rollout: same metrics, same weights."""
    import transformers

    from mfsdp_kit.rl import grpo
    cfg, src, tok = _setup(fsdp=True, workdir=workdir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    rollout = grpo.Rollout(hf, tok)
    prompts = data.ArithmeticTask(digits=1).rl_prompts(8)
    out, states = {}, {}
    for flag in (False, True):
        model, opt = _model(cfg, src)
        gcfg = grpo.GRPOConfig(prompts_per_iteration=8, samples_per_prompt=2, max_new_tokens=4,
                               micro_batch_size=8, offload_during_rollout=flag)
        m = grpo.iteration(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout, prompts=prompts,
                           reward_fn=lambda p, t: float(len(t) % 3), gcfg=gcfg, seq_len_tokens=16)
        out[str(flag)] = {k: m[k] for k in ("loss", "reward", "kl", "response_tokens")}
        states[flag] = _snapshot(model.chunks, opt)
        out[f"resident_after_{flag}"] = not offload.is_offloaded(opt)
    out["weights_equal"] = all(torch.equal(a, b) for k in states[False] for a, b in zip(states[False][k], states[True][k]))
    runtime.shutdown()
    return out
