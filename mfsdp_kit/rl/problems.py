"""A prompt pool from your data: (prompt, gold answer) pairs read from JSONL or parquet, the field names yours.

    problems = load_problems("gsm8k/train.jsonl", tokenizer, prompt_field="question", answer_field="answer")
    problems = load_problems("math/test.parquet", tokenizer, prompt_field="problem", answer_field="solution")

The pairs are what `grpo.fit(prompt_pool=...)` samples from and what `rewards.gold_reward` grades against. Each
question becomes one user turn rendered by the tokenizer's own chat template up to the generation prompt, as
`data.load_prompts_jsonl` renders its prompts (a pool holds rendered prompts: `rl.core.prompt_ids`).
"""
from __future__ import annotations

from pathlib import Path

from ..train import data
from ..config import bad_value

FORMATS = (".jsonl", ".parquet")


def _jsonl_rows(path: Path) -> list[dict]:
    rows = []
    for where, row in data._rows(path):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object")
        rows.append(row)
    return rows


def _parquet_rows(path: Path, columns: list[str]) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise KeyError(f"{path}: no column {missing[0]!r}; its columns: {', '.join(table.column_names)}")
    return table.select(columns).to_pylist()


def load_problems(path, tokenizer, *, prompt_field: str = "question", answer_field: str = "answer",
                  limit: int | None = None) -> list[tuple[str, str]]:
    """(rendered prompt, answer) of each row of a .jsonl or .parquet file, in file order, at most `limit` of them. A
    row without either field, or with an empty or non-text one, is an error naming the file, the row and the
    field. `tokenizer`: its chat template renders the prompts (None: the tiny tokenizer's)."""
    path = Path(path)
    if path.suffix not in FORMATS:
        raise bad_value("path", str(path), " | ".join(f"a {s} file" for s in FORMATS))
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad_value("limit", limit, "None or a positive int")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path, [prompt_field, answer_field])
    problems = []
    for n, row in enumerate(rows[:limit], 1):
        values = []
        for field in (prompt_field, answer_field):
            value = row.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and field == answer_field:
                value = str(value)   # a numeric answer column
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{path}: row {n}: field {field!r} is {value!r}, not a non-empty string "
                                 f"(the row's fields: {', '.join(row)})")
            values.append(value)
        problems.append((data.render_chat([{"role": "user", "content": values[0]}], tokenizer), values[1]))
    if not problems:
        raise ValueError(f"{path}: no rows")
    return problems
