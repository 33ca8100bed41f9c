"""bench/max_model.py end to end on 2 gloo ranks (spec tiny, CPU: no device memory, so the two
calibration sizes and --max-trials larger ones train, without OOM search). The search itself is
tested against a fake device in tests/perf/test_capacity.py."""
from dataclasses import replace

from mfsdp_kit.models.gpt import SPECS
from tests.bench.cli import run


def test_max_model_bench(tmp_path):
    res = run("max_model.py", "--spec", "tiny", "--max-trials", "1", "--micro-batches", "2", out=tmp_path / "m.json")
    assert res["args"]["micro_batches"] == 2   # two micro-batches a step: gradient accumulation
    trials = [(t["mode"], t["layers"], t["purpose"], t["trained"]) for t in res["trials"]]
    assert trials == [(m, n, p, True) for m in ("ddp", "fsdp") for n, p in ((2, "calibrate"), (4, "calibrate"),
                                                                            (6, "size"))]
    for mode in ("ddp", "fsdp"):
        assert res["summaries"][mode]["largest_trained_layers"] == 6
        assert res["summaries"][mode]["largest_trained_params"] == replace(SPECS["tiny"], num_layers=6).param_count()
    assert res["fsdp_over_ddp_params"] == 1.0 and res["cap"] is None
