"""The architecture truth table: every architecture Megatron-Bridge 0.3.1 lists, run or refused.

For each architecture a tiny model is written by transformers (models.archs) and either
- goes through load -> Megatron-FSDP wrap -> logits vs HF -> export exact -> one training step
  (tests/dist/scenarios_arch.arch_roundtrip, 2 gloo ranks) at TP 1 and TP 2, or
- is refused by `check_folder` with a ConfigError naming the architecture, before any weight is read;
- or, where this transformers cannot build its config offline, is listed as not tested.

`python -m tests.models.arch_table` runs it all (minutes on 2 CPU cores) and writes
docs/architectures.md; tests/models/test_arch_table.py asserts the same rows.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from mfsdp_kit.config import ConfigError, EngineConfig
from mfsdp_kit.models import archs, hf as hf_models, support

DOC = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
TPS = (1, 2)


def refusal(arch: str, workdir: Path, tp: int = 1) -> str | None:
    """check_folder's ConfigError message for a config-only folder of `arch` at `tp` (None: accepted).

    Architectures whose config class transformers cannot build here get a config.json holding only
    the architecture's name: enough for check_folder, which refuses by name before reading more."""
    path = workdir / f"{arch}_config_tp{tp}"
    if arch in archs.ARCH_CONFIGS:
        archs.hf_config(arch).save_pretrained(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    try:
        hf_models.check_folder(path, EngineConfig(tensor_model_parallel_size=tp))
    except ConfigError as e:
        return str(e)
    except FileNotFoundError:  # past every config check; only the weights are absent
        return None
    return None


def collect(workdir, *, archs_to_run=None, tps: tuple[int, ...] = TPS, nproc: int = 2,
            attention: str = "local") -> list[dict]:
    """One row per listed architecture: {arch, outcome: works | refused | not tested, tp: {..}, reason}.

    The architectures that run go through one `nproc`-rank job (scenarios_arch.arch_roundtrips per TP),
    one after another in the same world as a notebook loads several models: not a job each. `attention`:
    scenarios_arch's (`"gpu-default"`: what the notebooks pick on a GPU)."""
    from tests.dist import launch
    workdir = Path(workdir)
    rows, runnable = [], []
    for arch in archs_to_run or hf_models.supported_architectures():
        first = refusal(arch, workdir)
        if first is not None:
            rows.append(dict(arch=arch, outcome="refused", reason=first, config_only=arch not in archs.ARCH_CONFIGS))
        elif arch not in archs.ARCH_CONFIGS:
            rows.append(dict(arch=arch, outcome="not tested", reason=_untested_reason(arch)))
        else:
            rows.append(dict(arch=arch, outcome="works", tp={}))
            runnable.append(rows[-1])
    refused = {tp: {r["arch"]: refusal(r["arch"], workdir, tp) for r in runnable} for tp in tps}
    to_run = {tp: [a for a, why in refused[tp].items() if why is None] for tp in tps}
    calls = [["scenarios_arch:arch_roundtrips", dict(archs=to_run[tp], tp=tp, fsdp=True, workdir=str(workdir),
                                                     attention=attention)]
             for tp in tps if to_run[tp]]
    n = sum(map(len, to_run.values()))
    done = iter(launch.run("sequence", nproc=nproc, calls=calls, timeout_s=300 * max(n, 1)) if calls else [])
    results = {tp: next(done) if to_run[tp] else {} for tp in tps}
    for tp in tps:
        for r in runnable:
            r["tp"][tp] = results[tp][r["arch"]] if refused[tp][r["arch"]] is None else dict(refused=refused[tp][r["arch"]])
    return rows


def problems(row: dict) -> list[str]:
    """What is wrong with one row of `collect`, empty when it holds: a refusal names the architecture and is
    listed in support.REFUSED; a working one is in support.VERIFIED and, at every TP it was not refused at,
    matches transformers (logits and loss within 1e-5, 32 greedy tokens, exact export, save_hf reload)."""
    arch, out = row["arch"], []
    if row["outcome"] == "refused":
        if arch not in row["reason"] or arch not in support.REFUSED:
            out.append(f"{arch}: refusal does not name it or is not in support.REFUSED")
    elif row["outcome"] == "works":
        if arch not in support.VERIFIED:
            out.append(f"{arch}: works but is not in support.VERIFIED")
        for tp, r in row["tp"].items():
            if "refused" in r:
                if not (tp > 1 and "tensor_model_parallel_size" in r["refused"]):
                    out.append(f"{arch} TP {tp}: refused for another reason: {r['refused']}")
                continue
            checks = {"logits": r["verify"]["relative"] < 1e-5,
                      "export": r["export_names_match"] and r["export_shapes_match"] and r["export_maxdiff"] == 0.0,
                      "loss": abs(r["megatron_loss"] - r["hf_loss"]) < 1e-5,
                      "trained shapes": r["trained_shapes_match"], "save_hf reload": r["reload_relative"] < 1e-5,
                      "greedy": r["greedy"]["ok"]}   # 32 greedy tokens == transformers'
            out += [f"{arch} TP {tp}: {name} differs from transformers: {_cell(r)}" for name, ok in checks.items()
                    if not ok]
    elif not (row["outcome"] == "not tested" and row["reason"]):
        out.append(f"{arch}: outcome {row['outcome']!r} without a reason")
    return out


def _untested_reason(arch: str) -> str:
    if arch == "DeciLMForCausalLM":
        return "its config class comes with the model's remote code (trust_remote_code), not with transformers"
    if arch == "NemotronHForCausalLM":
        return "transformers 4.57 has no NemotronH config class (the model ships remote code)"
    return "a vision-language model: its tiny config needs a vision tower this table does not build"


def _cell(r: dict) -> str:
    if "refused" in r:
        return "refused: " + r["refused"].split(": ", 1)[-1]
    v = r["verify"]
    g = r["greedy"]
    greedy = "greedy 32 = HF" if g["equal"] else f"greedy = HF up to a tie at token {g['first_diff']} (gap {g['tie_gap']:.0e})"
    return (f"logits {v['relative']:.1e} of scale, {greedy}, export {'exact' if r['export_maxdiff'] == 0 else r['export_maxdiff']}"
            f", loss {r['megatron_loss']:.6f} (HF {r['hf_loss']:.6f}), save_hf reload {r['reload_relative']:.1e}")


def render(rows: list[dict]) -> str:
    lines = ["# Architectures: what loads, what is refused, and why", "",
             "Generated by `python -m tests.models.arch_table` (asserted by tests/models/test_arch_table.py) on "
             "megatron-core 0.16.1 + Megatron-Bridge 0.3.1 without Transformer Engine, 2 gloo ranks, "
             "Megatron-FSDP, fp32. Each model is tiny (2 layers, hidden 64) and written by transformers "
             "itself (`models.archs.write_tiny`, random weights, no download). \"Works\" means: load -> "
             "Megatron-FSDP wrap -> logits vs transformers (`models.verify`, relative to the largest |logit|) "
             "-> 32 greedy tokens from two prompts equal transformers' `generate` -> export equal to the HF tensors -> one training step whose loss equals transformers' "
             "cross-entropy on the same batch -> export after the step keeps every HF name and shape -> `save_hf`, reloaded by transformers, gives "
             "Megatron's logits (relative difference shown). "
             "\"Refused\" means `models.hf.check_folder` raises ConfigError before any weight is read.", "",
             "| architecture | outcome | TP 1 | TP 2 / reason |", "|---|---|---|---|"]
    for row in rows:
        if row["outcome"] == "works":
            lines.append(f"| `{row['arch']}` | works | {_cell(row['tp'][1])} | {_cell(row['tp'][2])} |")
        elif row["outcome"] == "refused":
            reason = support.REFUSED.get(row["arch"]) or row["reason"].split(": ", 1)[-1]
            if row.get("config_only"):
                reason += f" (checked on a config.json naming only the architecture: {_untested_reason(row['arch'])})"
            lines.append(f"| `{row['arch']}` | refused | | {reason.replace('|', '/')} |")
        else:
            lines.append(f"| `{row['arch']}` | not tested | | {row['reason']} |")
    lines += ["", "The tiny Llama and Mistral configs have the same shapes and seed (Mistral without a window is "
              "Llama's layer), so their numbers coincide; Mistral with an active window is tested separately "
              "(tests/models/test_window.py: 3.5e-7 at window 8 over 16 tokens, TP 2).",
              "", "Field-level refusals for the architectures that work (rope scaling variants, sliding windows, "
              "soft-capping, MoE routing variants, unmapped biases, expert parallelism on a dense model or not dividing "
              "the experts) are listed in `mfsdp_kit/models/support.py` (the rules every family shares) and in each "
              "family's spec (`mfsdp_kit/models/archs/`), and tested in tests/models/test_support.py. "
              "Qwen3-MoE and OLMoE at expert-parallel size 1 and 2, under Megatron-FSDP and DDP (logits, export, "
              "training parity, checkpoint round trip), are tested in tests/models/test_moe.py.", "",
              "On GPUs: `SECTIONS=archs bash scripts/gpu_check.sh` runs the architectures that work through the same "
              "checks on NCCL with the notebooks' GPU attention (`python -m tests.models.arch_table --gpus N`); "
              "docs/benchmarks.md has the run.", ""]
    return "\n".join(lines)


def main() -> None:
    """No argument: the whole table on 2 gloo ranks, written to docs/architectures.md. `--gpus N --out F`: the
    architectures that work, on N GPUs (TP 1, and 2 with two GPUs) with the notebooks' GPU attention; prints
    each row, writes F, exits 1 when a row has a problem (scripts/gpu_check.sh's `archs` section)."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=0, choices=[0, 1, 2], help="2 on a machine with more: TP 1 and 2 "
                    "need no more ranks, and each roundtrip's 4-sequence step splits over at most 2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.gpus:
            rows = collect(tmp)
        else:
            rows = collect(tmp, archs_to_run=list(support.VERIFIED), tps=TPS[:args.gpus], nproc=args.gpus,
                           attention="gpu-default")
    bad = [p for row in rows for p in problems(row)]
    if not args.gpus:
        DOC.write_text(render(rows))
        print(f"wrote {DOC}")
    for row in rows:
        for tp, r in row.get("tp", {}).items():
            print(f"{row['arch']:28s} TP {tp}  {_cell(r)}")
    out = Path(args.out) if args.out else DOC.parent / "results" / f"architectures{'_gpu' if args.gpus else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print("\n".join(bad) or f"every row holds ({len(rows)} architectures)")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
