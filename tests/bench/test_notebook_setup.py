"""bench/notebook_setup.py end to end on 2 gloo ranks (tiny xs, fp32): rank 0 writes the model, every rank loads
it phase by phase under both wrappers and steps it."""
from tests.bench.cli import run

LOAD = ["init", "check", "provider", "build", "weights", "wrap", "optimizer", "step0", "settle"]


def test_notebook_setup_bench(tmp_path):
    res = run("notebook_setup.py", "--size", "xs", "--root", str(tmp_path), "--steps", "1", "--profile", "5",
              out=tmp_path / "setup.json")
    per_wrapper = [f"{w}.{p}" for w in ("ddp", "fsdp") for p in LOAD]
    assert [r["phase"] for r in res["ranks"][0]] == ["imports", "draw", "tiny"] + per_wrapper
    assert [r["phase"] for r in res["ranks"][1]] == per_wrapper          # only rank 0 writes the model
    assert res["model_write_s"]["draw"] > 0 and set(res["load_s"]) == {"ddp", "fsdp"}
    assert "phases.py" in res["profile"]                    # cProfile saw the timed load phases
    assert list(tmp_path.iterdir()) == [tmp_path / "setup.json"]          # the written model is removed
