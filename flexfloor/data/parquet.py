"""verl-format prompt files.

Columns (one row per prompt):
    data_source   str                         selects the reward function
    prompt        list<struct<role, content>> the chat messages
    ability       str                         written, not read (verl metadata)
    reward_model  struct<style, ground_truth>
    extra_info    struct<index: int, split>   index is the prompt's stable uid

`read_examples` renders the messages with `flexfloor.tokenizer.render_chat`: a single user message
becomes its content unchanged (what `write_examples` writes, so a round trip is exact); longer
conversations keep their system prompt and earlier turns in the rendered text. A plain string in
`prompt` is taken as the prompt text. A cell of another type, or an empty prompt, is refused with
the file, the row (0-based) and the column.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flexfloor.data.synthetic import Example
from flexfloor.outputs import write_whole
from flexfloor.tokenizer import render_chat

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model", "extra_info")

_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
])


def write_examples(examples: list[Example], path: str | Path, *, ability: str = "arithmetic",
                   split: str = "train") -> None:
    rows = [{
        "data_source": e.data_source,
        "prompt": [{"role": "user", "content": e.prompt}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": e.ground_truth},
        "extra_info": {"index": e.uid, "split": split},
    } for e in examples]
    _check_unique_uids([e.uid for e in examples], str(path))
    table = pa.Table.from_pylist(rows, schema=_SCHEMA)
    write_whole(str(path), lambda tmp: pq.write_table(table, tmp))  # whole or not at all


def read_examples(path: str | Path) -> list[Example]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    table = pq.read_table(str(path))
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path} is missing column(s) {missing}; a verl-format prompt file needs "
                         f"{list(REQUIRED_COLUMNS)} (and usually 'ability')")
    if table.num_rows == 0:
        raise ValueError(f"{path} has 0 rows; a prompt file needs at least one prompt")
    examples = []
    for row_number, row in enumerate(table.select(list(REQUIRED_COLUMNS)).to_pylist()):
        where = f"{path} row {row_number}"
        ground_truth = _field(row, "reward_model", "ground_truth", where)
        index = _field(row, "extra_info", "index", where)
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{where}, column extra_info: extra_info.index must be an int, got "
                             f"{type(index).__name__} {index!r}")
        if not isinstance(row["data_source"], str):
            raise ValueError(f"{where}, column data_source: must be a str, got "
                             f"{type(row['data_source']).__name__} {row['data_source']!r}")
        prompt = _prompt_text(row["prompt"], where)
        # verl files sometimes store a numeric ground truth.
        if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
            raise ValueError(f"{where}, column reward_model: reward_model.ground_truth must be a "
                             f"str or a number, got {type(ground_truth).__name__} "
                             f"{ground_truth!r}")
        examples.append(Example(uid=index, prompt=prompt, ground_truth=str(ground_truth),
                                data_source=row["data_source"]))
    _check_unique_uids([e.uid for e in examples], str(path))
    return examples


def _prompt_text(prompt, where: str) -> str:
    """The `prompt` cell as text: chat messages rendered, or a plain string as it is (a raw
    completion prompt, as some datasets store it); anything else, or an empty prompt, refused."""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list):
        try:
            text = render_chat(prompt)
        except ValueError as e:
            raise ValueError(f"{where}, column prompt: {e}") from None
    else:
        raise ValueError(f"{where}, column prompt: expected a list of chat messages "
                         f"[{{role, content}}] or a string, got {type(prompt).__name__} "
                         f"{prompt!r}; write the prompt as [{{'role': 'user', 'content': ...}}]")
    if not text.strip():
        raise ValueError(f"{where}, column prompt: the prompt is empty; remove the row or give "
                         "it a prompt text")
    return text


def _field(row: dict, column: str, key: str, where: str):
    struct = row[column]
    if struct is not None and not isinstance(struct, dict):
        raise ValueError(f"{where}, column {column}: expected a struct with field {key!r}, got "
                         f"{type(struct).__name__} {struct!r}")
    value = struct.get(key) if isinstance(struct, dict) else None
    if value is None:
        raise ValueError(f"{where}: {column}.{key} is missing or null")
    return value


def _check_unique_uids(uids: list[int], where: str) -> None:
    seen, duplicates = set(), set()
    for uid in uids:
        (duplicates if uid in seen else seen).add(uid)
    if duplicates:
        raise ValueError(f"{where}: duplicate extra_info.index {sorted(duplicates)[:10]}; each "
                         "prompt needs a unique index (its uid across epochs)")
