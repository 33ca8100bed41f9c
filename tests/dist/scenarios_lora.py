"""LoRA scenarios on the embedded tiny model and arithmetic task (run by launch.run)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit.lora import adapters
from mfsdp_kit import lora
from mfsdp_kit.weights import sync
from mfsdp_kit.train import data, generate
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import ConfigError, EngineConfig, OptimConfig, Parallelism, Wrapper
from mfsdp_kit.distributed.introspect import inner_optimizers, local
from mfsdp_kit.distributed.memory import memory_report
from mfsdp_kit.models.hf import expected_tensors, load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import forward_backward, step


def _sum(value: int) -> int:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return int(t)


def _local_params(chunks) -> dict[str, torch.Tensor]:
    """Each parameter's local part (an FSDP shard, a TP slice), cloned; FSDP chunks show their shards first."""
    engine.synchronize_fsdp_params(chunks)
    return {f"{i}.{name}": local(p).detach().clone() for i, c in enumerate(chunks) for name, p in c.named_parameters()}


def _world(cfg: EngineConfig, workdir: str):
    rt = runtime.init(cfg)
    src = f"{workdir}/tiny_xs_lora"
    if rt.rank == 0:
        tiny(src, size="xs", seed=0)
    dist.barrier()
    return rt, src


def train_adapters(*, fsdp: bool, tp: int, workdir: str, steps: int = 3, lr: float = 1e-2,
                   exits: bool = True) -> dict:
    """Load the tiny model twice (plain and with LoRA), compare logits, train the adapters a few steps; then
    (DDP) one more batch's adapter grads against HF peft's, and (unless not `exits`) the trained model out through
    every exit: `save_adapter` into peft, `save_hf` merged into transformers, the rollout sync into an HF model."""
    layout = dict(wrapper=Wrapper(use_megatron_fsdp=fsdp), parallelism=Parallelism(tensor_model_parallel_size=tp),
                  seed=3)
    cfg = EngineConfig(**layout, lora=lora.LoRAConfig(rank=4, alpha=8))
    rt, src = _world(cfg, workdir)
    base = load(src, EngineConfig(**layout))
    model = load(src, cfg, wrap=False)
    trainable = lora.trainable_names(model.chunks)
    trainable_numel = sum(p.numel() for c in model.chunks for p in c.parameters() if p.requires_grad)
    frozen_numel = sum(p.numel() for c in model.chunks for p in c.parameters() if not p.requires_grad)
    model.chunks = engine.wrap_chunks(cfg, model.chunks)
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    init_diff = (generate.logits(model.chunks, tokens, vocab_size=model.vocab_size)
                 - generate.logits(base.chunks, tokens, vocab_size=model.vocab_size)).abs().max().item()
    for chunks in (model.chunks, base.chunks):
        engine.settle_param_gathers(chunks)
    engine.release(base.chunks)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=lr, clip_grad=1.0), cfg)
    before = _local_params(model.chunks)
    batches = data.batches(data.ArithmeticTask(digits=1).train_pairs(40), _tokenizer(src), seq_len_tokens=16,
                           global_batch=8, seed=1)
    results = [step(model.chunks, opt, next(batches), micro_batch_size=2, step_index=i) for i in range(steps)]
    after = _local_params(model.chunks)
    state_numel = sum(local(t["exp_avg"]).numel() for o in inner_optimizers(opt) for t in o.optimizer.state.values())
    held = [p for o in inner_optimizers(opt) for g in o.optimizer.param_groups for p in g["params"]]
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    frozen = [name for name in before if not lora.is_adapter(name)]
    result = dict(
        wrapper=type(model.chunks[0]).__name__, init_diff=init_diff,
        losses=[r.loss for r in results], grad_norms=[float(r.grad_norm) for r in results],
        trainable=trainable, all_trainable_are_adapters=all(lora.is_adapter(n) for n in trainable),
        frozen_changed=sorted(set(frozen) & changed),
        adapters_changed=len(changed - set(frozen)), adapters=len(before) - len(frozen), optimizer_params=len(held),
        adapters_here=sum(before[n].numel() > 0 for n in before if n not in frozen),
        frozen_bit_equal=all(torch.equal(before[n], after[n]) for n in frozen),
        state_numel_all_ranks=_sum(state_numel),
        trainable_numel_all_ranks=_sum(trainable_numel), frozen_numel_all_ranks=_sum(frozen_numel),
        local_frozen_numel=_sum(sum(before[n].numel() for n in frozen)),
        dp_size=rt.world_size // tp, memory=memory_report(model.chunks, opt).as_dict())
    batch = next(batches)
    tag = f"{'fsdp' if fsdp else 'ddp'}_tp{tp}"
    if not fsdp:   # DDP: every rank holds each adapter's whole (TP slice of its) grad
        result["grads_vs_peft"] = _grads_vs_peft(model, batch, src, f"{workdir}/grad_start_{tag}")
    if exits:
        result["exits"] = _exits(model, src, f"{workdir}/{tag}")
    runtime.shutdown()
    return result


def _hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.eval()(tokens).logits.float()


def _exits(model, src: str, out: str) -> dict:
    """Max |logits diff| against Megatron's of: peft on the base with `save_adapter`'s folder, transformers on
    `save_hf`'s merged folder, the base HF model after `sync.load_into`; and the folder's file names."""
    import peft
    import transformers
    tokens = torch.randint(0, model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
    want = generate.logits(model.chunks, tokens, vocab_size=model.vocab_size)
    engine.settle_param_gathers(model.chunks)
    adapters.save_adapter(chunks=model.chunks, bridge=model.bridge, path=f"{out}/adapter")
    adapters.save_adapter(chunks=model.chunks, bridge=model.bridge, path=f"{out}/adapter")   # replaces the first
    refusals = {}
    for name, save in (("unmerged", lambda: sync.save_hf(model.chunks, model.bridge, f"{out}/x", merged=False)),
                       ("foreign", lambda: adapters.save_adapter(chunks=model.chunks, bridge=model.bridge, path=out))):
        try:
            save()
        except (ConfigError, FileExistsError) as e:
            refusals[name] = str(e)
    dist.barrier()   # every rank refused (no rank left in a collective)
    sync.save_hf(model.chunks, model.bridge, f"{out}/merged")
    rollout = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    stats = sync.load_into(rollout, model.chunks, model.bridge)   # the plan merges W + s B A where TP is 1
    merged_by_bridge = dict(sync.export_hf_weights(model.chunks, model.bridge))
    state = rollout.state_dict()
    weights_diff = max((state[k] - v).abs().max().item() for k, v in merged_by_bridge.items())
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(base, f"{out}/adapter")
    merged = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/merged", dtype=torch.float32)
    diff = {name: (_hf_logits(m, tokens) - want).abs().max().item()
            for name, m in (("peft", with_peft), ("merged", merged), ("rollout", rollout))}
    return dict(diff, sync=dict(planned=stats["planned"], bridge=stats["bridge"], weights_diff=weights_diff),
                files=sorted(p.name for p in Path(f"{out}/adapter").iterdir()), refusals=refusals,
                siblings=sorted(p.name for p in Path(out).iterdir()),
                scale=with_peft.peft_config["default"].lora_alpha / with_peft.peft_config["default"].r,
                targets=sorted(with_peft.peft_config["default"].target_modules), logits_scale=want.abs().max().item())


def _grads_vs_peft(model, batch, src: str, start: str) -> dict:
    """This batch's adapter grads (DDP's main_grad after megatron's finalize: the per-token mean over the global
    batch) in HF names, against peft's on the same batch from the same adapters (`save_adapter`, then
    `PeftModel.from_pretrained(is_trainable=True)`), fp32. peft keeps one A per q/k/v (gate/up) module where
    megatron shares one over the fused linear: megatron's A grad is the sum of peft's. The distributed optimizer
    reduce-scatters grads (each rank's part of the buffer summed, the rest left local): here they are
    all-reduced (megatron's `force_all_reduce`), so every rank holds every adapter's global grad."""
    adapters.save_adapter(chunks=model.chunks, bridge=model.bridge, path=start)
    for chunk in model.chunks:
        chunk.zero_grad_buffer()
    config = engine.unwrap_model(model.chunks[0]).config
    config.finalize_model_grads_func = lambda *args, force_all_reduce=False, **kw: engine.finalize_grads(
        *args, force_all_reduce=True, **kw)
    try:
        forward_backward(model.chunks, batch, micro_batch_size=2)
    finally:
        engine.attach_schedule_hooks(model.chunks)
    ours = _adapter_grads(model)
    ref = _peft_grads(src, start, batch)
    fused = {}
    for name, grad in ref.items():   # A grads of the modules sharing one megatron A, summed
        if ".lora_A." in name:
            key = _fused_key(name)
            fused[key] = fused.get(key, 0) + grad
    diffs, scale = {}, max(g.abs().max().item() for g in ref.values())
    for name, grad in ours.items():
        expected = fused[_fused_key(name)] if ".lora_A." in name else ref[name]
        diffs[name] = (grad - expected).abs().max().item()
    return dict(max_diff=max(diffs.values()), grad_scale=scale, names=len(diffs), peft_names=len(ref),
                b_nonzero=all(ref[n].abs().max().item() > 0 for n in ref if ".lora_B." in n))


def _fused_key(name: str) -> str:
    """The megatron linear an HF LoRA name's A belongs to: q/k/v_proj -> one key, gate/up_proj -> one key."""
    for group, key in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "fc1")):
        for part in group:
            name = name.replace(f".{part}.", f".{key}.")
    return name


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    """{HF LoRA name: grad}: each adapter's main_grad put in its weight's place for the bridge's own export."""
    params = [p for c in model.chunks for n, p in c.named_parameters() if lora.is_adapter(n)]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad.view_as(p).to(p.dtype)
        return dict(adapters.export_adapter_weights(model.chunks, model.bridge))
    finally:
        for p, kept in zip(params, saved):
            p.data = kept


def _peft_grads(src: str, adapter: str, batch) -> dict[str, torch.Tensor]:
    """HF peft's LoRA grads of the masked per-token mean loss over the whole batch, names as in the files."""
    import peft
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True).train()
    logits = model(batch.tokens).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    mask = batch.loss_mask.float().flatten()
    ((losses * mask).sum() / mask.sum()).backward()
    return {n.removeprefix(adapters.PEFT_PREFIX).replace(".default", ""): p.grad
            for n, p in model.named_parameters() if p.requires_grad}


def _tokenizer(src: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(src)



def grpo_with_lora(*, workdir: str, iterations: int = 2) -> dict:
    """GRPO under LoRA (Megatron-FSDP): the rollout HF model refreshed with merged weights each iteration, the
    frozen base as the KL reference; the train-inference log-prob mismatch, the base left bit-equal."""
    import transformers

    from mfsdp_kit.rl import grpo
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), seed=3, lora=lora.LoRAConfig(rank=4, alpha=8))
    rt, src = _world(cfg, workdir)
    model = load(src, cfg)
    ref = load(src, EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), seed=3),
               wrap=False).chunks   # the base: LoRA's start
    tok = _tokenizer(src)
    rollout = grpo.Rollout(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), tok)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-2), cfg)
    before = _local_params(model.chunks)
    gcfg = grpo.GRPOConfig(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=4, kl_coef=0.05,
                           micro_batch_size=8)
    history = grpo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout,
                       prompt_pool=data.ArithmeticTask(digits=1).rl_prompts(40), reward_fn=_starts_with_digit, gcfg=gcfg,
                       iterations=iterations, seq_len_tokens=16, ref_chunks=ref, progress=False)
    after = _local_params(model.chunks)
    frozen = [n for n in before if not lora.is_adapter(n)]
    result = dict(history=vars(history), frozen_bit_equal=all(torch.equal(before[n], after[n]) for n in frozen),
                  adapters_changed=sum(not torch.equal(before[n], after[n]) for n in before if n not in frozen))
    runtime.shutdown()
    return result


def _starts_with_digit(prompt: str, completion: str) -> float:
    """A reward the untrained tiny model earns on some samples of a group and not others (exact match: on none,
    so every advantage would be 0 and the adapters would not move)."""
    return float(completion[:1].isdigit())


def resume_adapters(*, workdir: str, steps: int = 4, save_at: int = 2) -> dict:
    """Megatron-FSDP LoRA: a checkpoint at `save_at` holds adapters and their optimizer state only; a fresh
    build from the base resumes with losses bit-equal to the straight run's; another base is refused."""
    from mfsdp_kit import checkpoint as ckpt
    from mfsdp_kit.models.tiny import tiny as write_tiny
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), seed=3, lora=lora.LoRAConfig(rank=4, alpha=8))
    rt, src = _world(cfg, workdir)
    other = f"{workdir}/tiny_xs_other"
    if rt.rank == 0:
        write_tiny(other, size="xs", seed=1)
    dist.barrier()
    ocfg = OptimConfig(lr=1e-2, warmup_steps=1)
    stream = data.batches(data.ArithmeticTask(digits=1).train_pairs(40), _tokenizer(src), seq_len_tokens=16,
                          global_batch=8, seed=1)
    batches = [next(stream) for _ in range(steps)]

    def build(path):
        model = load(path, cfg)
        opt = engine.build_optimizer(model.chunks, ocfg, cfg)
        return model, opt, engine.build_scheduler(opt, ocfg, total_steps=steps)

    def train(model, opt, sched, start, stop):
        return [step(model.chunks, opt, batches[i], micro_batch_size=2, scheduler=sched, step_index=i).loss
                for i in range(start, stop)]

    model, opt, sched = build(src)
    manager = ckpt.CheckpointManager(f"{workdir}/ckpt")
    straight = train(model, opt, sched, 0, save_at)
    saved = manager.save(save_at, model.chunks, opt, sched)
    straight += train(model, opt, sched, save_at, steps)
    keys = list(ckpt.ModelState(model.chunks).state_dict()["0"])
    engine.release(model.chunks)
    model, opt, sched = build(src)
    meta = manager.load(model.chunks, opt, sched)
    resumed = train(model, opt, sched, save_at, steps)
    engine.release(model.chunks)
    model, opt, sched = build(other)
    try:
        manager.load(model.chunks, opt, sched)
        refused = None
    except ckpt.CheckpointError as e:
        refused = str(e)
    from mfsdp_kit.checkpoint.restore import checked
    on_disk = checked(saved, False)[1].state_dict_metadata   # DCP's key -> metadata, read without unpickling code
    saved_numel = {k: math.prod(m.size) for k, m in on_disk.items() if hasattr(m, "size")}
    result = dict(straight=straight[save_at:], resumed=resumed, loaded_step=meta["step"], lora_base=meta["lora_base"],
                  model_keys=keys, all_adapters=all(lora.is_adapter(k) for k in keys), refused=refused,
                  src=str(Path(src).resolve()),
                  saved_model_keys=sorted(k for k in saved_numel if k.startswith("model.")),
                  saved_numel=sum(saved_numel.values()),
                  adapter_numel=sum(v for k, v in saved_numel.items() if k.startswith("model.")),
                  base_numel=sum(math.prod(shape) for shape in expected_tensors(src).values()))
    runtime.shutdown()
    return result
