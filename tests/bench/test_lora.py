"""bench/lora.py --tiny end to end on 1 gloo rank (shape small, fp32): full fine-tuning and LoRA rank 16 load the
written folder, train, and report optimizer state equal to the formula (12 B per trainable param on one rank);
bench/max_model.py's search runs the fsdp-lora16 variant (what gpu_sections' `lora` section runs on a GPU)."""
from tests.bench.cli import run


def test_lora_bench_tiny(tmp_path):
    res = run("lora.py", "--tiny", "--root", str(tmp_path), out=tmp_path / "lora.json", nproc=1)
    full, lora = res["variants"]["full"], res["variants"]["lora"]
    assert full["error"] is None and lora["error"] is None, res
    assert lora["frozen"] == full["trainable"] and full["frozen"] == 0   # LoRA's base is the full model, frozen
    assert 0 < lora["trainable"] < full["trainable"] / 4
    for r in (full, lora):
        assert r["optimizer_state_bytes"] == r["optimizer_formula_bytes"] == 12 * r["trainable"]
        assert r["tokens_per_s"] > 0 and len(r["losses"]) == 3
        assert r["refresh_bridge"] == 0 and r["refresh_planned"] > 0 and r["refresh_s"] > 0   # the plan, merged
    assert lora["model_state_bytes"] < full["model_state_bytes"]
    assert not (tmp_path / "mfsdp_lora_small").exists()   # removed without --keep


def test_max_model_searches_the_lora_variant(tmp_path):
    res = run("max_model.py", "--spec", "tiny", "--modes", "fsdp,fsdp-lora16", "--max-trials", "1",
              out=tmp_path / "mm.json", nproc=1)
    assert all(t["trained"] for t in res["trials"]), res["trials"]
    assert res["summaries"]["fsdp-lora16"]["largest_trained_layers"] >= 4
