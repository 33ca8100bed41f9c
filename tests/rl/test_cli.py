"""rl.cli: GRPO on a model folder and a problems file as one command, on 2 gloo ranks - the trained folder loads in
transformers and the history has every iteration; bad options stop it before any model loads."""
import json

import pytest
import torch

from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.rl import cli
from tests.dist import launch


def problems_file(path):
    rows = [{"question": f"{a}+{b}=", "answer": f"{a}+{b}={a + b}\n#### {a + b}"} for a in range(4) for b in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_command_trains_and_writes_a_folder_transformers_loads(tmp_path):
    import transformers
    src = tiny(str(tmp_path / "tiny"), size="xs", seed=0)
    out = tmp_path / "run"
    r = launch.run("scenarios_rl:grpo_command", src=str(src), data=str(problems_file(tmp_path / "p.jsonl")),
                   out=str(out))
    assert len(r["history"]["reward"]) == 2 and all(n == 0 for n in r["history"]["logprob_passes"])
    assert json.loads((out / "history.json").read_text())["reward"] == r["history"]["reward"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    # the untrained model writes no `#### answer`: every reward 0, every advantage 0, so Adam moves no weight and
    # the folder holds the input's values (through Megatron-FSDP, the sync and the export)
    assert r["history"]["reward"] == [0.0, 0.0]
    assert all(torch.equal(p, base.state_dict()[n]) for n, p in model.state_dict().items())
    transformers.AutoTokenizer.from_pretrained(out / "hf")


@pytest.mark.parametrize("argv, says", [(["--reward", "mmlu"], "--reward"), (["--iterations", "x"], "--iterations")])
def test_bad_options_name_themselves(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit):
        cli.parse(["--model", "m", "--data", "d.jsonl", "--out", str(tmp_path / "o"), *argv])
    assert says in capsys.readouterr().err


def test_an_existing_out_folder_is_refused_before_any_work(tmp_path):
    with pytest.raises(FileExistsError, match="--out"):
        cli.main(["--model", str(tmp_path), "--data", "d.jsonl", "--out", str(tmp_path)])
