"""rl.decoupled across two worlds: process 0 is the trainer (its own world of one, Megatron-FSDP, fp32), process 1 a
rollout process with no world (an HFRollout of the same HF folder), joined by a `push.Link`. The trainer first runs
the synchronous colocated loop (`loop.fit`, an HFRollout in its own process) as the reference, then `decoupled.fit`
with max_staleness 0 over one link (the same samples and updates expected), then with max_staleness 1 (one-step
off-policy, token-truncate correction) over a second link. Both sides record the completions they sampled; the
rollout process sends its record back through the link's store."""
from __future__ import annotations

import dataclasses
import json
import os

import torch

ITERATIONS = 3


def reward(prompt: str, completion: str) -> float:
    """A reward that differs within a group for an untrained model: a hash of the completion's text."""
    return sum(map(ord, completion)) % 7 / 6


class Recording:
    """A rollout backend as given, which keeps the completions each `sample` returned."""

    def __init__(self, backend):
        self.backend, self.tokenizer, self.model, self.calls = backend, backend.tokenizer, backend.model, []

    def refresh(self, chunks, bridge) -> dict:
        return self.backend.refresh(chunks, bridge)

    def sample(self, prompts, **kwargs):
        out = self.backend.sample(prompts, **kwargs)
        self.calls.append([list(c) for c in out])
        return out


def _cfg():
    from mfsdp_kit.rl.algorithms.grpo import GRPOConfig
    return GRPOConfig(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=4, micro_batch_size=8, seed=1)


def _pool():
    from mfsdp_kit.train import data
    return data.ArithmeticTask(digits=1).rl_prompts(40)


def _hf_rollout(src: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from mfsdp_kit.rl.rollout import HFRollout
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    return Recording(HFRollout(model, AutoTokenizer.from_pretrained(src)))


def _models(src: str, ecfg, rollout):
    from mfsdp_kit.config import OptimConfig
    from mfsdp_kit.distributed import engine
    from mfsdp_kit.models import hf as hf_models
    from mfsdp_kit.rl import loop
    model = hf_models.load(src, ecfg)
    optimizer = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), ecfg)
    return loop.Models(chunks=model.chunks, optimizer=optimizer, bridge=model.bridge, rollout=rollout)


KEYS = ("reward", "kl", "entropy", "response_tokens", "policy_version", "staleness_max", "groups_stale",
        "is_weight_mean")


def _digest(models) -> str:
    """One hash of every HF weight the trainer holds (after its updates)."""
    import hashlib
    from mfsdp_kit.weights import sync
    h = hashlib.sha256()
    for name, t in sync.export_hf_weights(models.chunks, models.bridge):
        h.update(name.encode() + t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _kept(history) -> dict:
    return {k: v for k, v in vars(history).items() if k in KEYS}


def _trainer(src: str, link_ports: list[int], world_port: int) -> dict:
    from mfsdp_kit.config import EngineConfig, Wrapper
    from mfsdp_kit.distributed import engine, runtime
    from mfsdp_kit.rl import decoupled, loop
    from mfsdp_kit.weights import push
    ecfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), dtype="fp32", seed=3)
    runtime.init(ecfg, rank=0, world_size=1, master_port=world_port)
    out = {}
    rollout = _hf_rollout(src)
    models = _models(src, ecfg, rollout)
    losses = []   # History keeps no loss: each iteration's metrics have it
    history = loop.fit(models=models, cfg=_cfg(), prompt_pool=_pool(), reward_fn=reward, iterations=ITERATIONS,
                       progress=False, on_iteration=lambda _, m: losses.append(m["loss"]))
    out["sync"] = dict(_kept(history), loss=losses, samples=rollout.calls, weights=_digest(models))
    engine.release(models.chunks)
    runs = [("staleness0", _cfg(), 0),
            ("staleness1", dataclasses.replace(_cfg(), rollout_correction="token-truncate"), 1)]
    for port, (name, cfg, staleness) in zip(link_ports, runs):
        models = _models(src, ecfg, None)
        link = push.connect(host="127.0.0.1", port=port, rank=0, size=2)
        losses = []
        history = decoupled.fit(models=models, cfg=cfg, link=link, tokenizer=rollout.tokenizer, prompt_pool=_pool(),
                                iterations=ITERATIONS, max_staleness=staleness, progress=False,
                                on_iteration=lambda _, m: losses.append(m["loss"]))
        out[name] = dict(_kept(history), loss=losses, weights=_digest(models), **json.loads(link.store.get("record")))
        engine.release(models.chunks)
    return out


def _rollout(src: str, link_ports: list[int]) -> None:
    from mfsdp_kit.rl import decoupled
    from mfsdp_kit.weights import push
    for port in link_ports:
        rollout = _hf_rollout(src)
        link = push.connect(host="127.0.0.1", port=port, rank=1, size=2)
        served = decoupled.serve(link=link, backend=rollout, prompt_pool=_pool(), reward_fn=reward)
        link.store.set("record", json.dumps(dict(samples=rollout.calls, versions=served["versions"])))


def two_worlds(*, src: str, link_ports: list[int], world_port: int) -> dict:
    if int(os.environ["RANK"]) == 0:   # the launcher's RANK names the role; neither process joins its world
        return _trainer(src, link_ports, world_port)
    _rollout(src, link_ports)
    return {}


def trainer_world_of_two(*, src: str, link_port: int, world_port: int) -> dict:
    """Processes 0 and 1: a trainer world of two (Megatron-FSDP over both); process 2: the rollout process. Every
    trainer rank gets the samples (rank 0 reads the store and broadcasts them) and the ranks stay in step."""
    from mfsdp_kit.config import EngineConfig, Wrapper
    from mfsdp_kit.distributed import engine, runtime
    from mfsdp_kit.rl import decoupled
    from mfsdp_kit.weights import push
    rank = int(os.environ["RANK"])
    if rank == 2:
        _rollout(src, [link_port])
        return {}
    ecfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), dtype="fp32", seed=3)
    runtime.init(ecfg, rank=rank, world_size=2, master_port=world_port)
    models = _models(src, ecfg, None)
    link = push.connect(host="127.0.0.1", port=link_port, rank=0, size=2) if rank == 0 else None
    from transformers import AutoTokenizer
    history = decoupled.fit(models=models, cfg=_cfg(), link=link, tokenizer=AutoTokenizer.from_pretrained(src),
                            prompt_pool=_pool(), iterations=ITERATIONS, max_staleness=1, progress=False)
    digests = [None, None]
    torch.distributed.all_gather_object(digests, _digest(models))
    out = dict(_kept(history), weights_agree=digests[0] == digests[1])
    if link is not None:
        out.update(json.loads(link.store.get("record")))
    engine.release(models.chunks)
    return out
