"""weights.push across two worlds: process 0 is a trainer (its own world of one, Megatron-FSDP, fp32), process 1 a
rollout process with no world at all, holding the same architecture as a transformers model. Two pushes after
training steps: each lands bit for bit (a digest of every HF tensor on both sides, the rollout's sent back through
the link's store) with its version; a push into a model that lacks the names fails on the receiver, by name, after
the stream is drained, and the sender returns."""
from __future__ import annotations

import hashlib
import json
import time
import os

import torch

OCFG = dict(lr=1e-3, warmup_steps=1, decay_steps=10)


def _digest(named) -> dict:
    return {n: hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
            for n, t in named}


def _trainer(src: str, link_port: int, world_port: int) -> dict:
    from mfsdp_kit.config import EngineConfig, OptimConfig
    from mfsdp_kit.distributed import engine, runtime
    from mfsdp_kit.models import hf as hf_models
    from mfsdp_kit.train import step
    from mfsdp_kit.train.data import random_token_batches
    from mfsdp_kit.weights import push, sync
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp32", seed=3)
    runtime.init(cfg, rank=0, world_size=1, master_port=world_port)     # the trainer's world: this process alone
    model = hf_models.load(src, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(**OCFG), cfg)
    link = push.connect(host="127.0.0.1", port=link_port, rank=0, size=2)
    batches = random_token_batches(steps=3, global_batch=2, seq_len_tokens=16, vocab_size=256, seed=4)
    out = {}
    for version, batch in enumerate(batches[:2], start=1):
        step(model.chunks, opt, batch, micro_batch_size=2, step_index=version - 1)
        sent = push.send(model.chunks, model.bridge, link=link, version=version)
        mine = _digest(sync.export_hf_weights(model.chunks, model.bridge))
        theirs = json.loads(link.store.get(f"digest{version}"))
        out[f"push{version}"] = dict(tensors=sent["tensors"], version=theirs["version"], bytes=sent["bytes"],
                                     equal=mine == theirs["digest"], names=len(mine),
                                     moved=mine != out.get("last"))
        out["last"] = mine
    out.pop("last")
    out["bad_send"] = push.send(model.chunks, model.bridge, link=link, version=9)["tensors"]
    out["bad_receive"] = link.store.get("bad").decode()
    link.store.wait(["waiting"])   # the receiver is (about to be) inside a broadcast that no push will match
    time.sleep(0.5)
    t0 = time.monotonic()
    push.close(link, reason="the trainer stopped after iteration 3")
    out["closed"] = json.loads(link.store.get("closed_seen"))
    out["closed"]["seconds"] = time.monotonic() - t0
    out["closed_again"] = push.closed(link)   # a later close keeps the first reason
    push.close(link, reason="another reason")
    out["first_reason_kept"] = push.closed(link) == out["closed_again"]
    engine.release(model.chunks)
    return out


def _rollout(src: str, link_port: int) -> None:
    from transformers import AutoModelForCausalLM
    from mfsdp_kit.weights import push
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    link = push.connect(host="127.0.0.1", port=link_port, rank=1, size=2)
    for expected in (1, 2):
        version = push.receive(model, link=link)
        link.store.set(f"digest{expected}", json.dumps(dict(version=version,
                                                            digest=_digest(model.state_dict().items()))))
    try:
        push.receive(torch.nn.Linear(2, 2), link=link)
        link.store.set("bad", "no error")
    except KeyError as e:
        link.store.set("bad", str(e))
    link.store.set("waiting", "1")
    try:
        push.receive(model, link=link)
        seen = dict(error="no error")
    except push.LinkClosed as e:
        seen = dict(error=type(e).__name__, reason=str(e))
    link.store.set("closed_seen", json.dumps(seen))


def two_worlds(*, src: str, link_port: int, world_port: int) -> dict:
    if int(os.environ["RANK"]) == 0:   # the launcher's RANK names the role; neither process joins its world
        return _trainer(src, link_port, world_port)
    _rollout(src, link_port)
    return {}
