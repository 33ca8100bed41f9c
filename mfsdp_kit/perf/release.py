"""The release set's figures: what `SECTIONS=release bash scripts/gpu_check.sh` measured (scripts/gpu_sections.py),
read from the one current JSON file each of its sections keeps under docs/results/<device>/, as rows of one table,
each with its hardware bound. `make docs` (scripts/make_docs.py) writes that table into README.md and the top of
docs/benchmarks.md between `<!-- release:begin -->` and `<!-- release:end -->`; tests/perf/test_release.py fails
when what is there differs from what the committed JSON gives. No figure in that table is typed by hand.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..models.gpt import SPECS
from .flops import PEAK_FLOPS_PER_GPU, matmul_params
from .hf_folder import SHAPES

GIB = 2**30
TAG = "release"
"""The markers around a generated block: <!-- release:begin --> ... <!-- release:end -->."""


@dataclass(frozen=True, kw_only=True)
class Figure:
    section: str
    """The JSON file it comes from (its stem: notebooks, rollout, ...)."""
    what: str
    value: str
    bound: str = "-"
    """What the hardware allows for the same work (a floor in seconds, a ceiling in tokens/s), or "-"."""
    headline: bool = False
    """Also in the README (the rest: docs/benchmarks.md)."""


def _k(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k tok/s"


def _failed(error: str) -> str:
    """A failed run's cell: the error's first sentence."""
    return "failed: " + error.split(";")[0].split(". ")[0][:80]


def notebooks(d: dict) -> list[Figure]:
    ok = sum(nb["ok"] for nb in d["notebooks"])
    failed = ", ".join(nb["notebook"] for nb in d["notebooks"] if not nb["ok"])
    return [Figure(section="notebooks", headline=True, what=f"notebooks under nbval, {d['gpus']} GPU engine(s)",
                   value=f"{ok}/{len(d['notebooks'])} pass in {d['total_s']:.0f} s" + (f" (failed: {failed})" * bool(failed)))]


def rollout(d: dict) -> list[Figure]:
    """Per batch: the kit's engine against HF generate, the ceiling: every step reads the weights and KV once."""
    rows = []
    for r in d["results"]:
        ceiling = r["sequences"] / (r["floor_ms"] / 1e3)
        rows.append(Figure(section="rollout", headline=r["sequences"] == 256,
                           what=f"rollout engine, {d['shape']}, {r['sequences']} sequences x {d['new_tokens']} new",
                           value=f"{_k(r['kit_tokens_per_s'])} ({r['kit_tokens_per_s'] / r['hf_tokens_per_s']:.0f}x "
                                 "HF generate)", bound=f"{_k(ceiling)} (weights + KV read once a step)"))
    return rows


def grpo_history(d: dict) -> dict:
    """The history of the first backend a bench/grpo_iteration.py result ran (the release set runs one)."""
    return d["histories"][d["args"]["backends"].split(",")[0]]


def grpo_iteration(d: dict) -> list[Figure]:
    """The first iteration, then the median of the later ones, each part beside its floor (`perf.floors`)."""
    args, table = d["args"], grpo_history(d)["table"]
    work = (f"GRPO iteration, tiny `{args['size']}`, {args['prompts_per_iteration']} x {args['samples_per_prompt']} "
            f"samples, <= {args['max_new_tokens']} new")
    later = table[1:] or table
    med = {k: statistics.median(r["seconds"][k] for r in later) for k in later[0]["seconds"]}
    floor = {k: statistics.median(r["floors"][k] for r in later) for k in later[0]["floors"]}
    mfu = {k: statistics.median(r["mfu"][k] for r in later) for k in later[0].get("mfu", {})
           if all(k in r["mfu"] and r["floors"][k] > 0 for r in later)}
    rows = [Figure(section="grpo_iteration", headline=True, what=f"{work}: 1st", value=f"{table[0]['total_s']:.2f} s",
                   bound=f"{sum(table[0]['floors'].values()):.2f} s"),
            Figure(section="grpo_iteration", headline=True, what=f"{work}: later (median of {len(later)})",
                   value=f"{statistics.median(r['total_s'] for r in later):.2f} s", bound=f"{sum(floor.values()):.2f} s")]
    for part, label in (("rollout_s", "rollout"), ("logprob_s", "old log-probs"), ("update_s", "update"),
                        ("sync_s", "weight sync")):
        if part not in med:
            continue
        extra = f" ({100 * mfu[part]:.0f} % MFU)" if part in mfu else ""
        if part == "logprob_s" and floor[part] == 0:
            label = "batch before the update (pi_old from the update's own forward)"
        rows.append(Figure(section="grpo_iteration", what=f"... {label}, later", value=f"{med[part]:.2f} s{extra}",
                           bound=f"{floor[part]:.2f} s"))
    return rows


def throughput(d: dict) -> list[Figure]:
    """SFT tokens/s per GPU of each system; the ceiling: the model's FLOPs per token at the datasheet's peak."""
    spec = d["spec"]
    ceiling = d["peak_flops_per_gpu"] / d["flops_per_token"]
    names = {"ddp": "megatron DDP", "fsdp": "Megatron-FSDP", "fsdp2": "torch FSDP2"}
    return [Figure(section="throughput_1gpu", headline=mode == "fsdp",
                   what=f"SFT, {d['params'] / 1e9:.2f} B GPT, seq {spec['seq_len_tokens']}, {d['world']} GPU, "
                        f"{names.get(mode, mode)}",
                   value=(_failed(r["error"]) if r.get("error") else
                          f"{_k(r['tokens_per_s_per_gpu'])}, {100 * r['mfu']:.1f} % MFU, peak {r['peak_bytes'] / GIB:.1f} GiB"),
                   bound=f"{_k(ceiling)} (100 % MFU)") for mode, r in d["results"].items()]


def packing(d: dict) -> list[Figure]:
    """Real (unpadded) tokens/s of each way; the ceiling: 6 N FLOPs a token at 989 TFLOP/s."""
    spec = SPECS[d["spec"]]
    ceiling = PEAK_FLOPS_PER_GPU / (6 * matmul_params(spec))
    rows = []
    for mix, m in d["results"].items():
        padded = m["ways"].get("padded", {}).get("real_tokens_per_s")
        for way, r in m["ways"].items():
            ratio = f" ({r['real_tokens_per_s'] / padded:.2f}x padded)" if padded and way != "padded" and "error" not in r else ""
            rows.append(Figure(section="packing_rl", headline=way == "packed-sdpa",
                               what=f"{mix.upper()} mix ({100 * m['padding_fraction']:.0f} % padding), "
                                    f"{spec.param_count() / 1e9:.2f} B GPT, {way}",
                               value=_failed(r["error"]) if "error" in r else f"{_k(r['real_tokens_per_s'])} real{ratio}",
                               bound=f"{_k(ceiling)} (6N at 989 TFLOP/s)"))
    return rows


def lora(d: dict) -> list[Figure]:
    """LoRA against full fine-tuning; ceilings: 6 N FLOPs a token (full), 4 N (frozen base: no weight grads)."""
    cfg = SHAPES[d["args"]["shape"]][1]
    n = d["write"]["params"] - cfg["vocab_size"] * cfg["hidden_size"]   # the embedding table is a lookup
    rows = []
    for name, per_token in (("full", 6), ("lora", 4)):
        r = d["variants"][name]
        label = "full fine-tuning" if name == "full" else f"LoRA rank {d['args']['rank']}"
        rows.append(Figure(section="lora", headline=True, what=f"{d['args']['shape']} shape, {label}, 1 GPU",
                           value=_failed(r["error"]) if r.get("error") else
                           f"{_k(r['tokens_per_s'])}, peak {r['peak_bytes'] / GIB:.1f} GiB" +
                           (f", rollout refresh {r['refresh_s']:.2f} s" if "refresh_s" in r else ""),
                           bound=f"{_k(PEAK_FLOPS_PER_GPU / (per_token * n))} ({per_token}N at 989 TFLOP/s)"))
    return rows


READERS = {"notebooks.json": notebooks, "rollout.json": rollout, "grpo_iteration.json": grpo_iteration,
           "throughput_1gpu.json": throughput, "packing_rl.json": packing, "lora.json": lora}
"""One reader per file of the release set (scripts/gpu_sections.py RELEASE_FILES)."""


def provenance(d: dict) -> dict:
    """commit, date, device of a result (`report.write_json`; older files kept them at the top)."""
    p = d.get("provenance") or d
    return {k: p.get(k, "unknown") for k in ("commit", "date", "device")}


def load(folder: str | Path) -> dict[str, dict]:
    """The release files present under `folder`, parsed, by file name."""
    folder = Path(folder)
    return {name: json.loads((folder / name).read_text()) for name in READERS if (folder / name).is_file()}


def figures(results: dict[str, dict]) -> list[Figure]:
    return [f for name, reader in READERS.items() if name in results for f in reader(results[name])]


def table(results: dict[str, dict], *, folder: str, headline_only: bool = False) -> str:
    """The figures as one markdown table, then where each came from (file, commit, date, device)."""
    lines = ["| what | measured | hardware bound |", "|---|---|---|"]
    lines += [f"| {f.what} | {f.value} | {f.bound} |" for f in figures(results) if f.headline or not headline_only]
    missing = [name for name in READERS if name not in results]
    lines += ["", "From " + "; ".join(
        f"`{folder}/{name}` ({p['commit']}, {p['date'][:10]}, {p['device']})"
        for name, p in ((n, provenance(d)) for n, d in results.items())) + "."]
    if missing:
        lines.append("Not in this release run: " + ", ".join(missing) + ".")
    return "\n".join(lines)


def splice(text: str, block: str, *, where: str) -> str:
    """`text` with what lies between the release markers replaced by `block`; `where` names the file in the
    error when the markers are missing."""
    begin, end = f"<!-- {TAG}:begin -->", f"<!-- {TAG}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: needs exactly one {begin} ... {end} pair around the generated figures")
    head, rest = text.split(begin)
    return f"{head}{begin}\n{block}\n{end}{rest.split(end, 1)[1]}"


FOLDER = "docs/results/h200x1"
"""Where the release set's current files live (one H200, the kind the device tool lends)."""
DOCUMENTS = {"README.md": True, "docs/benchmarks.md": False}
"""The files with a generated block, and whether theirs holds the headline figures only."""


def documents(root: str | Path, *, folder: str = FOLDER) -> dict[Path, str]:
    """Each file of DOCUMENTS under `root` as `make docs` leaves it: its block regenerated from `folder`."""
    root = Path(root)
    results = load(root / folder)
    return {root / name: splice((root / name).read_text(), table(results, folder=folder, headline_only=short),
                                where=name)
            for name, short in DOCUMENTS.items()}
