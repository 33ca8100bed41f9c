"""`python -m mfsdp_kit.demo` (what `make demo` runs): the default end-to-end job.

Megatron-FSDP on every rank (one per GPU, else 2 CPU ranks): load the tiny HF model (or
$MODEL) and check its logits against transformers' on the same folder (`models.verify`; a
mismatch stops the demo), held-out accuracy, SFT on arithmetic (1-digit on CPU, 2-digit on GPU) with a
checkpoint halfway and a resume from it into a freshly built model, accuracy again, weight
sync into a `transformers` rollout model and samples from it, an HF export (`sync.save_hf`),
then a summary table and plots under runs/demo/.

The same library calls as the notebooks, under torchrun instead of ipyparallel: this process
spawns `python -m torch.distributed.run --nproc_per_node N -m mfsdp_kit.demo --worker`, and
the workers' rank 0 writes summary.json, which this process prints and draws.

$MODEL's tokenizer must carry a chat template (the arithmetic is rendered with it, so the model
trains in its own format and learns to end with its own end-of-turn token); this process checks
that before starting any rank. A tokenizer without a pad token (Llama 3, Qwen3) pads with eos,
which the loss mask leaves out. Sequence length and answer length follow from the tokenizer.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .distributed import ports

CPU = dict(digits=1, steps=300, batch_per_rank=16, micro_batch_size=16, seq_len_tokens=16, train_pairs=90, size="xs")
"""2 CPU cores: ~0.08 s/step for the 0.1 M-parameter model -> ~25 s of training."""
GPU = dict(digits=2, steps=600, batch_per_rank=32, micro_batch_size=16, seq_len_tokens=16, train_pairs=8000, size="s")
"""One GPU per rank: the 3 M-parameter model on 2-digit addition.
Global batch = batch_per_rank x data-parallel ranks (e.g. 2 x 16 = 32 sequences per step on CPU)."""


# ---- what the demo needs from a tokenizer ----------------------------------------------------------
def tokenizer_for(src: str):
    """`AutoTokenizer.from_pretrained(src)`, refused with a `ChatTemplateError` that says what the
    demo needs when it has no chat template."""
    from transformers import AutoTokenizer

    from .train.chat import ChatTemplateError, require_template
    tok = AutoTokenizer.from_pretrained(src)
    try:
        require_template(tok)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"MODEL={src}: the demo renders its arithmetic task with the model's chat "
                                f"template and this tokenizer has none. Use an instruct/chat model folder, or "
                                f"add a \"chat_template\" to {src}/tokenizer_config.json. ({e})") from None
    return tok


def stops(tok, src: str) -> list[int]:
    """The tokenizer's stop ids (eos, end-of-turn) and any more eos ids the model folder's
    generation_config.json lists (Llama 3.1 also ends on <|eom_id|>)."""
    from transformers import GenerationConfig

    from .train.chat import stop_ids
    ids = stop_ids(tok)
    try:
        extra = GenerationConfig.from_pretrained(src).eos_token_id
    except OSError:   # no generation_config.json
        extra = None
    return ids + [i for i in ([extra] if isinstance(extra, int) else extra or []) if i not in ids]


def plan(tok, recipe: dict, *, heldout: int) -> dict:
    """The demo's data for this tokenizer: task, train pairs, held-out prompts, the sequence length
    that keeps every pair whole (at least the recipe's) and the new tokens a full answer needs."""
    from .train import chat, data
    task = data.ArithmeticTask(digits=recipe["digits"], tokenizer=tok)
    pairs = task.train_pairs(recipe["train_pairs"])
    longest_reply = len(chat.encode_text(tok, task.reply("9" * (recipe["digits"] + 1))))
    return dict(task=task, pairs=pairs, heldout=task.rl_prompts(heldout, split="heldout"),
                seq_len_tokens=max(recipe["seq_len_tokens"], data.seq_len_needed(pairs, tok)),
                max_new_tokens=longest_reply + 1)


# ---- worker: runs on every rank under torchrun ---------------------------------------------------
def _log(*args) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print("[demo]", *args, flush=True)


def _problem(prompt: str) -> str:
    """"3+4=" out of a rendered prompt (its last "a op b=")."""
    import re
    return re.findall(r"\d+[+\-*]\d+=", prompt)[-1]


def _samples(hf_model, tok, prompts, device, *, max_new_tokens: int, stop_ids: list[int]) -> list[tuple[str, str]]:
    """Greedy samples from the rollout model, one prompt at a time (no padding needed):
    (problem, completion without special tokens)."""
    import torch

    from .train.chat import encode_text, pad_id
    out = []
    for prompt in prompts:
        ids = torch.tensor([encode_text(tok, prompt)], device=device)
        gen = hf_model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id(tok),
                                eos_token_id=stop_ids)
        out.append((_problem(prompt), tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)))
    return out


def worker(out: Path, *, steps: int | None = None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .train import data, generate
    from .weights import sync
    from .distributed import engine, runtime
    from .checkpoint import CheckpointManager
    from .config import EngineConfig, OptimConfig, Wrapper
    from .distributed.memory import memory_report, zero_formula_bytes
    from .models.hf import load
    from .models.tiny import tiny
    from .train import fit

    on_gpu = torch.cuda.is_available()
    recipe = dict(GPU if on_gpu else CPU)
    recipe["steps"] = steps or recipe["steps"]
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), seed=0)
    rt = runtime.init(cfg)
    src = os.environ.get("MODEL") or str(out / f"tiny_{recipe['size']}")
    if "MODEL" not in os.environ and rt.rank == 0:
        tiny(src, size=recipe["size"], seed=0)
    runtime.barrier()
    recipe["global_batch"] = recipe["batch_per_rank"] * rt.dp_size
    tok = tokenizer_for(src)
    plan_ = plan(tok, recipe, heldout=40 if on_gpu else 10)
    heldout, recipe["seq_len_tokens"] = plan_["heldout"], plan_["seq_len_tokens"]
    vocab_size = getattr(AutoConfig.from_pretrained(src), "vocab_size", None)   # greedy never picks padded rows
    stop_ids = stops(tok, src)
    _log(f"{rt.world_size} ranks ({rt.backend}, {rt.device.type}), model {src}, recipe {recipe}")
    total, half = recipe["steps"], recipe["steps"] // 2
    warmup = min(10, max(1, total // 4))   # 10 of the default 300 steps; a short --steps run still decays
    ocfg = OptimConfig(lr=3e-3, min_lr=1e-4, warmup_steps=warmup, decay_steps=max(1, total - warmup))

    def build(verify: bool = False):
        model = load(src, cfg, verify=verify)   # verify: HF's logits on the same folder, a mismatch raises
        opt = engine.build_optimizer(model.chunks, ocfg, cfg)
        return model, opt, engine.build_scheduler(opt, ocfg, total_steps=total)

    def stream(skip: int = 0):
        it = data.batches(plan_["pairs"], tok, seq_len_tokens=recipe["seq_len_tokens"],
                          global_batch=recipe["global_batch"], seed=0)
        for _ in range(skip):
            next(it)
        return it

    def progress(i, result):
        if (i + 1) % 50 == 0:
            _log(f"step {i + 1}/{total} loss {result.loss:.4f} lr {result.lr:.2e}")

    def accuracy(model):
        return generate.evaluate(model.chunks, tok, heldout, reward_fn=data.verify,
                                 max_new_tokens=plan_["max_new_tokens"], vocab_size=vocab_size, stop_ids=stop_ids)

    t0 = time.perf_counter()
    model, opt, sched = build(verify=True)
    verification = model.verification.as_dict()
    _log(str(model.verification))
    before = accuracy(model)
    _log(f"held-out accuracy before: {before['accuracy']:.2f}")
    fit_kw = dict(micro_batch_size=recipe["micro_batch_size"], scheduler=sched, progress=False, on_step=progress)
    first = fit(model.chunks, opt, stream(), steps=half, **fit_kw)

    ckpt = CheckpointManager(out / "ckpt", keep_last=1, hf_source=src)
    saved = ckpt.save(half, model.chunks, opt, sched, extra={"data_position": half})
    _log(f"checkpoint {saved} written in {ckpt.last_save_s:.2f} s; resuming from it in a fresh model")
    del model, opt, sched
    model, opt, sched = build()   # as a restarted job would
    meta = ckpt.load(model.chunks, opt, sched)
    fit_kw["scheduler"] = sched
    second = fit(model.chunks, opt, stream(skip=meta["extra"]["data_position"]), steps=total - meta["step"],
                 start_step=meta["step"], **fit_kw)
    train_s = time.perf_counter() - t0
    after = accuracy(model)
    _log(f"held-out accuracy after: {after['accuracy']:.2f}")

    hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(rt.device).eval()
    stats = sync.load_into(hf_model, model.chunks, model.bridge)
    samples = _samples(hf_model, tok, [p for p, _ in heldout[:4]], rt.device, max_new_tokens=plan_["max_new_tokens"],
                       stop_ids=stop_ids)
    export = sync.save_hf(model.chunks, model.bridge, out / "hf")
    report = memory_report(model.chunks, opt)
    n, dp = report.num_params, report.dp_size
    if rt.rank == 0:
        summary = dict(
            world_size=rt.world_size, device=rt.device.type, model=src, recipe=recipe, train_s=train_s,
            loss=first.loss + second.loss, tokens_per_s=first.tokens_per_s + second.tokens_per_s,
            resumed_at=meta["step"], checkpoint=str(saved), verification=verification, accuracy_before=before["accuracy"],
            accuracy_after=after["accuracy"], heldout=len(heldout), samples=samples, export=str(export),
            sync=stats, memory=report.as_dict(),
            formula=dict(ddp=zero_formula_bytes(num_params=n, dp_size=dp, fsdp=False, dtype=cfg.dtype),
                         fsdp=zero_formula_bytes(num_params=n, dp_size=dp, fsdp=True, dtype=cfg.dtype)))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    runtime.shutdown(destroy_process_group=True)


# ---- launcher: this process ----------------------------------------------------------------------
def launch(out: Path, *, nproc: int, steps: int | None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={ports.unclaimed()}", "-m", "mfsdp_kit.demo", "--worker", "--out", str(out)]
    if steps:
        cmd += ["--steps", str(steps)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    import torch
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")   # 2 ranks on 2 cores: no oversubscription
    subprocess.run(cmd, env=env, check=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def _verification(v: dict | None) -> str:
    if not v:
        return "not run"
    return (f"max diff {v['max_abs_diff']:.2g} = {v['relative']:.2g} of the logit scale "
            f"(tolerance {v['tolerance']:g}): {'ok' if v['ok'] else 'MISMATCH'}")


def summarize(out: Path) -> str:
    """The summary table; also writes runs/demo/loss.png and memory.png."""
    from .notebook import plots
    s = json.loads((out / "summary.json").read_text())
    mem, formula = s["memory"], s["formula"]
    plots.loss_curves({f"Megatron-FSDP, {s['world_size']} ranks": s["loss"]}, out / "loss.png",
                      title="SFT loss", events={"resumed from checkpoint": s["resumed_at"]})
    n, dp = mem["num_params"], mem["dp_size"]
    ddp_parts = dict(params_bytes=4 * n, grads_bytes=4 * n, main_params_bytes=0, optimizer_states_bytes=8 * n // dp)
    plots.memory_breakdown({"DDP (ZeRO-1 formula)": ddp_parts, "Megatron-FSDP (measured)": mem},
                           {"DDP (ZeRO-1 formula)": formula["ddp"], "Megatron-FSDP (measured)": formula["fsdp"]},
                           out / "memory.png", title=f"model state per rank, {dp} data-parallel ranks, fp32")
    saved = formula["ddp"] - mem["model_state_bytes"]
    tps = sorted(s["tokens_per_s"])[len(s["tokens_per_s"]) // 2]
    rows = [
        ("ranks / device", f"{s['world_size']} x {s['device']}"),
        ("model", f"{s['model']} ({n:,} params)"),
        ("logits vs transformers", _verification(s.get("verification"))),
        ("task", f"{s['recipe']['digits']}-digit addition, {len(s['loss'])} steps x {s['recipe']['global_batch']} seq"),
        ("loss first -> last", f"{s['loss'][0]:.4f} -> {s['loss'][-1]:.4f}"),
        ("train time / median tokens/s", f"{s['train_s']:.1f} s / {tps:.0f}"),
        ("checkpoint, resumed at step", f"{s['checkpoint']} @ {s['resumed_at']}"),
        (f"held-out accuracy ({s['heldout']})", f"{s['accuracy_before']:.2f} -> {s['accuracy_after']:.2f}"),
        ("rollout sync (HF model)", f"{s['sync']['tensors']} tensors, {_mib(s['sync']['bytes'])}, "
                                    f"{s['sync']['seconds']:.3f} s"),
        ("rollout samples", ", ".join(f"{p}{c.strip()}" for p, c in s["samples"])),
        ("HF export", s["export"]),
        ("model state / rank, FSDP", f"{_mib(mem['model_state_bytes'])} (formula {_mib(formula['fsdp'])})"),
        ("model state / rank, DDP formula", _mib(formula["ddp"])),
        ("saved by FSDP vs DDP", f"{_mib(saved)} per rank ({saved / formula['ddp']:.0%})"),
        ("plots", f"{out / 'loss.png'}, {out / 'memory.png'}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo", help="output folder (checkpoint, HF export, plots, summary.json)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, else 2)")
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: 300 on CPU, 600 on GPU)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    if args.worker:
        worker(out, steps=args.steps)
        return
    import shutil

    import torch
    start = time.perf_counter()
    for stale in ("ckpt", "hf", "summary.json"):   # a rerun starts clean (the tiny model folder is kept)
        target = out / stale
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("MODEL"):
        tokenizer_for(os.environ["MODEL"])   # refuse a tokenizer without a chat template before any rank starts
    nproc = args.nproc or torch.cuda.device_count() or 2
    launch(out, nproc=nproc, steps=args.steps)
    print("\n" + summarize(out))
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
