"""rl.problems: (prompt, answer) pairs from JSONL and parquet files the test writes, with the field names as
arguments, each question rendered by the chat template (a Qwen-style one built by tokenizers, and the tiny one);
a bad file, row or field is named."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mfsdp_kit.train import data
from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl.problems import load_problems
from mfsdp_kit.rl import rewards

ROWS = [{"question": "Natalia sold 48 clips, then half as many. How many?", "answer": "48+24=72\n#### 72"},
        {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
        {"question": "Half of one?", "answer": r"\boxed{\frac{1}{2}}"}]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_and_parquet_give_the_same_pairs_in_file_order(tmp_path):
    jsonl = write_jsonl(tmp_path / "train.jsonl", ROWS)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": r["question"], "solution": r["answer"], "id": i}
                                         for i, r in enumerate(ROWS)]), parquet)
    from_jsonl = load_problems(jsonl, None)
    tiny = data.tiny_tokenizer()
    assert from_jsonl == [(data.render_chat([{"role": "user", "content": r["question"]}], tiny), r["answer"])
                          for r in ROWS]
    assert ROWS[0]["question"] in from_jsonl[0][0] and from_jsonl[0][0] != ROWS[0]["question"]   # rendered
    assert load_problems(parquet, None, prompt_field="problem", answer_field="solution") == from_jsonl
    assert load_problems(jsonl, None, limit=2) == from_jsonl[:2]
    reward = rewards.gold_reward(from_jsonl, grade=rewards.gsm8k)
    assert reward(from_jsonl[1][0], "so 1234\n#### 1234") == 1.0


def test_a_numeric_answer_column_is_text(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"question": "2+2?", "answer": 4}])
    assert load_problems(path, None)[0][1] == "4"


@pytest.mark.parametrize("rows,match", [
    ([{"question": "q"}], r"row 1: field 'answer' is None"),
    ([{"question": "q", "answer": "a"}, {"question": "", "answer": "a"}], "row 2: field 'question' is ''"),
    ([{"question": ["q"], "answer": "a"}], "not a non-empty string"),
])
def test_bad_rows_are_named(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        load_problems(write_jsonl(tmp_path / "bad.jsonl", rows), None)


def test_bad_files_are_named(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "a"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2: malformed JSON"):
        load_problems(tmp_path / "broken.jsonl", None)
    (tmp_path / "list.jsonl").write_text('["q", "a"]\n')
    with pytest.raises(ValueError, match="a JSON list, not an object"):
        load_problems(tmp_path / "list.jsonl", None)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_problems(tmp_path / "empty.jsonl", None)
    with pytest.raises(ConfigError, match="path"):
        load_problems(tmp_path / "train.csv", None)
    with pytest.raises(ConfigError, match="limit"):
        load_problems(tmp_path / "empty.jsonl", None, limit=0)
    pq.write_table(pa.Table.from_pylist([{"q": "x"}]), tmp_path / "cols.parquet")
    with pytest.raises(KeyError, match="no column 'question'; its columns: q"):
        load_problems(tmp_path / "cols.parquet", None)


def test_a_llama3_template_built_by_tokenizers_renders_each_question_as_a_user_turn(tmp_path):
    from tests import chat_tokenizers
    tok = chat_tokenizers.llama3()
    (prompt, answer), = load_problems(write_jsonl(tmp_path / "one.jsonl", ROWS[:1]), tok)
    assert answer == ROWS[0]["answer"]
    assert "<|start_header_id|>user<|end_header_id|>" in prompt and ROWS[0]["question"] in prompt
    assert prompt.rstrip().endswith("<|start_header_id|>assistant<|end_header_id|>")   # up to the generation prompt
