"""bench/packing.py end to end on 2 gloo ranks (the tiny spec in fp32): packed steps train on the padded
steps' numbers, and the padding it reports is what the batches hold."""
import pytest

from tests.bench.cli import run


def test_packing_bench(tmp_path):
    res = run("packing.py", "--spec", "tiny", "--sequences", "8", "--steps", "2", "--warmup", "1", "--dtype", "fp32",
              "--ways", "padded,packed-sdpa", "--mixes", "sft,rl", "--max-tokens", "64", "--micro-batch-size", "2",
              out=tmp_path / "p.json")
    assert res["world"] == 2 and list(res["results"]) == ["sft", "rl"]
    for mix in res["results"].values():
        padded, packed = mix["ways"]["padded"], mix["ways"]["packed-sdpa"]
        assert packed["losses"] == pytest.approx(padded["losses"], rel=1e-5)
        assert 0 < mix["padding_fraction"] < 1 and mix["real_tokens"] < mix["positions"]
        assert packed["positions_per_s"] == pytest.approx(packed["real_tokens_per_s"])   # packed computes no padding
        assert padded["positions_per_s"] > padded["real_tokens_per_s"]
