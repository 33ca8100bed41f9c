"""Router replay (`models.router_replay`) on the tiny transformers-made MoE models, 2 gloo ranks, fp32, at EP 1 and
EP 2 under Megatron-FSDP.

Per layout: the routes a forward chose, recorded; replaying them gives the same logits bit for bit; replaying other
routes (every expert index shifted by one) makes each router dispatch exactly those experts (read from the routing
map megatron's router returns) and changes the logits; and three training steps whose batches carry the routes the
current weights choose (`extras["routes"]`, replayed per micro-batch by `train.step`; padded at EP 1, packed at
EP 2) give the losses and grad norms of three plain steps bit for bit (the load-balancing loss included: it reads
the router's own scores either way).
"""
from __future__ import annotations

import dataclasses

import torch

from mfsdp_kit.config import EngineConfig
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.models import hf as hf_models, router_replay
from mfsdp_kit.train import step
from mfsdp_kit.train.data import Batch
from mfsdp_kit.train.generate import logits
from scenarios_moe import LAYOUTS, OCFG, _batches, _source  # noqa: E402  (tests/dist is on the path)


def _dispatched(chunks, tokens) -> list[torch.Tensor]:
    """Each router's routing map of a forward over `tokens` (megatron's [tokens, experts] bool), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter
    maps, hooks = [], []
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                hooks.append(m.register_forward_hook(lambda mod, args, out: maps.append(out[1].detach().clone())))
    try:
        logits(chunks, tokens)
    finally:
        for h in hooks:
            h.remove()
    return maps


def _as_maps(routes: torch.Tensor, experts: int) -> list[torch.Tensor]:
    """Routes [batch, seq, layers, k] as per-layer routing maps in megatron's token order."""
    b, s, layers, _ = routes.shape
    tokens = routes.transpose(0, 1).reshape(s * b, layers, -1).long()
    maps = []
    for layer in range(layers):
        m = torch.zeros(s * b, experts, dtype=torch.bool)
        m.scatter_(1, tokens[:, layer], True)
        maps.append(m)
    return maps


def _train(model, cfg, *, replay: bool, packed: bool, shift: int = 0) -> dict:
    """Three steps of one-row micro-batches (two per rank), packed or padded; `replay`: each step's batch carries the
    routes the current weights choose (`extras["routes"]`, which `train.step` replays per micro-batch), each expert
    index moved `shift` places."""
    opt = engine.build_optimizer(model.chunks, OCFG, cfg)
    sched = engine.build_scheduler(opt, OCFG)
    losses, norms = [], []
    for i, b in enumerate(_batches()):
        if replay:
            with router_replay.recording(model.chunks) as rec:
                logits(model.chunks, b.tokens)
            routes = rec.routes(batch=b.tokens.shape[0], seq=b.tokens.shape[1])
            experts = engine.unwrap_model(model.chunks[0]).config.num_moe_experts
            b = Batch(b.tokens, b.labels, b.loss_mask, {"routes": (routes + shift) % experts})
        r = step(model.chunks, opt, b, micro_batch_size=1, packed=packed, scheduler=sched, step_index=i)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return dict(losses=losses, grad_norms=norms)


def _layout(src: str, *, ep: int, fsdp: bool) -> dict:
    cfg = EngineConfig(use_megatron_fsdp=fsdp, expert_model_parallel_size=ep, dtype="fp32", seed=3)
    runtime.init(cfg)
    model = hf_models.load(src, cfg)
    tokens = _batches()[0].tokens
    b, s = tokens.shape
    with router_replay.recording(model.chunks) as rec:
        plain = logits(model.chunks, tokens)
    routes = rec.routes(batch=b, seq=s)
    router_replay.set_routes(model.chunks, routes)
    same = logits(model.chunks, tokens)
    experts = engine.unwrap_model(model.chunks[0]).config.num_moe_experts
    other = (routes.long() + 1) % experts
    router_replay.set_routes(model.chunks, other)
    dispatched = _dispatched(model.chunks, tokens)
    moved = logits(model.chunks, tokens)
    router_replay.clear(model.chunks)
    after = logits(model.chunks, tokens)
    wanted = _as_maps(other, experts)
    out = dict(layers=routes.shape[2], k=routes.shape[3], dtype=str(routes.dtype),
               self_replay_equal=torch.equal(plain, same), cleared_equal=torch.equal(plain, after),
               dispatched_as_replayed=len(dispatched) == len(wanted)
               and all(torch.equal(d.cpu(), w) for d, w in zip(dispatched, wanted)),
               dispatched_layers=len(dispatched), other_maxdiff=(moved - plain).abs().max().item(),
               flips_other=router_replay.flips(routes, other), flips_self=router_replay.flips(routes, routes))
    engine.release(model.chunks)
    packed = ep > 1   # EP 1 trains padded, EP 2 packed: each way and each layout once (packed rows need SDPA)
    c = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, attention_backend="sdpa")) if packed else cfg
    out["train_way"] = "packed" if packed else "padded"
    out["plain"] = _train(hf_models.load(src, c), c, replay=False, packed=packed)
    out["replayed"] = _train(hf_models.load(src, c), c, replay=True, packed=packed)
    out["shifted"] = _train(hf_models.load(src, c), c, replay=True, packed=packed, shift=1)
    runtime.shutdown()
    return out


def replay_layouts(*, archs: list[str], workdir: str, layouts: list[str]) -> dict:
    """{arch: {layout: ...}} for each named layout of scenarios_moe.LAYOUTS."""
    runtime.init(EngineConfig())
    result = {}
    for arch in archs:
        src, _ = _source(arch, workdir)
        result[arch] = {name: _layout(src, ep=LAYOUTS[name][0], fsdp=LAYOUTS[name][1]) for name in layouts}
        runtime.init(EngineConfig())
    return result


def rl_replay(*, arch: str, workdir: str, rollout_dtype: str) -> dict:
    """The kit's engine (weights in `rollout_dtype`) samples with its routes recorded (`collect(routes=True)`); the
    trainer (fp32, Megatron-FSDP, 2 ranks) scores the samples with and without replaying them. Rank 0's numbers:
    the share of (token, MoE layer) pairs whose experts differ between rollout and trainer without replay (flips),
    and the largest |trainer - rollout| log-prob over completion tokens with and without replay; then two GRPO
    iterations with `router_replay=True`."""
    import transformers

    from mfsdp_kit import data
    from mfsdp_kit.rl import core, grpo, scoring
    from mfsdp_kit.rl.rollout import ContinuousRollout
    from mfsdp_kit.config import OptimConfig
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp32", seed=3)
    runtime.init(cfg)
    src, _ = _source(arch, workdir)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[rollout_dtype]
    rollout = ContinuousRollout(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype), tok)
    model = hf_models.load(src, cfg)
    pool = data.ArithmeticTask(digits=1).rl_prompts(20)
    batch = core.collect(chunks=model.chunks, bridge=model.bridge, backend=rollout, prompts=pool[:4],
                         reward=data.verify, samples_per_prompt=2, max_new_tokens=8, temperature=1.0, top_p=1.0,
                         seed=5, routes=True)
    ids = [batch.prompt_ids[i // 2] for i in range(len(batch.completions))]
    shapes_ok = all(r.shape[0] == len(p) + len(c) for r, p, c in zip(batch.routes, ids, batch.completions))
    measured = scoring.routing_mismatch(model.chunks, batch, seq_len_tokens=40, pad_id=0, micro_batch_size=4)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    history = grpo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout, prompt_pool=pool,
                       reward_fn=data.verify, iterations=2, progress=False,
                       cfg=grpo.GRPOConfig(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=8,
                                           micro_batch_size=4, router_replay=True))
    runtime.shutdown()
    return dict(shapes_ok=shapes_ok, routes=len(batch.routes), completions=len(batch.completions), **measured,
                rewards=history.reward, kl=history.kl, logprob_diff_max=history.logprob_diff_max)
