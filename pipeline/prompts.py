"""The prompt set: rows from jsonl, json, parquet or a `datasets` dataset, mapped to shards.

A row holds either chat turns (the prompt is every turn before the last assistant turn, which is
the dataset's own response; system turns stay in the prompt) or a `prompt` string (plus an
optional response field). Turns come OpenAI/UltraChat style (`messages` of {"role", "content"})
or ShareGPT style (`conversations` of {"from": "human"|"gpt"|"system", "value"}), as they are.
Rows map to shards by position: shard s of K holds rows [s*N//K, (s+1)*N//K), so a row always
lands in the same shard whatever ranges or workers run. The row count is part of the dataset
fingerprint, so a changed dataset cannot silently shift rows between shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline import fingerprint
from pipeline.errors import DatasetError

SHAREGPT_FIELD = "conversations"  # where ShareGPT rows keep their turns, when the messages field is absent
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Fields:
    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"


@dataclass(frozen=True)
class Row:
    index: int
    messages: tuple  # chat turns for the prompt, each {"role", "content"}
    response: str | None  # the dataset's own assistant answer, if any


class PromptSet:
    def __init__(self, records: list[dict], source: str, fields: Fields, sha256: str) -> None:
        self.records = records
        self.source = source
        self.fields = fields
        self.sha256 = sha256
        if records and not {fields.messages, SHAREGPT_FIELD, fields.prompt} & set(records[0]):
            raise DatasetError(
                f"dataset {source}: row 0 has neither field {fields.messages!r} ({SHAREGPT_FIELD!r}) nor "
                f"{fields.prompt!r} (fields present: {sorted(records[0])}); set --messages-field or --prompt-field")

    def __len__(self) -> int:
        return len(self.records)

    def shard_rows(self, shard: int, num_shards: int) -> range:
        n = len(self.records)
        return range(shard * n // num_shards, (shard + 1) * n // num_shards)

    def check(self, rows) -> None:
        """Parse every row of `rows` now (before any model loads); the first bad one is named."""
        for i in rows:
            self.row(i)

    def row(self, i: int) -> Row:
        rec = self.records[i]
        f = self.fields
        turns_field = f.messages if f.messages in rec else SHAREGPT_FIELD if SHAREGPT_FIELD in rec else None
        if turns_field is not None:
            msgs = self._turns(i, turns_field, rec[turns_field])
            last_assistant = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
            if last_assistant is None:
                return Row(i, tuple(msgs), None)
            return Row(i, tuple(msgs[:last_assistant]), msgs[last_assistant]["content"])
        if f.prompt in rec:
            prompt = rec[f.prompt]
            if not isinstance(prompt, str):
                raise DatasetError(f"dataset {self.source}: row {i} field {f.prompt!r} is {type(prompt).__name__}, expected text")
            return Row(i, ({"role": "user", "content": prompt},), rec.get(f.response))
        raise DatasetError(f"dataset {self.source}: row {i} has neither field {f.messages!r} ({SHAREGPT_FIELD!r}) "
                           f"nor {f.prompt!r} (fields present: {sorted(rec)})")

    def _turns(self, i: int, field: str, turns) -> list[dict]:
        """A row's turns as {"role", "content"}, from either style."""
        where = f"dataset {self.source}: row {i} field {field!r}"
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise DatasetError(f"{where} is not a list of turns")
        out = []
        for j, t in enumerate(turns):
            if "role" in t and "content" in t:
                out.append(t)
            elif "from" in t and "value" in t:
                if t["from"] not in SHAREGPT_ROLES:
                    raise DatasetError(f"{where} turn {j}: 'from' is {t['from']!r}, expected one of "
                                       f"{', '.join(SHAREGPT_ROLES)}")
                out.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
            else:
                raise DatasetError(f"{where} turn {j}: expected {{'role', 'content'}} or {{'from', 'value'}}, "
                                   f"found keys {sorted(t)}")
        return out

    def describe(self) -> dict:
        return {"source": self.source, "rows": len(self), "sha256": self.sha256,
                "fields": {"messages": self.fields.messages, "prompt": self.fields.prompt,
                           "response": self.fields.response}}


def load(source: str, fields: Fields = Fields(), split: str = "train") -> PromptSet:
    path = Path(source).expanduser()
    if path.is_file():
        suffix = "".join(path.suffixes[-1:]).lower()
        if suffix == ".jsonl":
            records = _read_jsonl(path)
        elif suffix == ".json":
            records = _read_json(path)
        elif suffix == ".parquet":
            records = _read_parquet(path)
        else:
            raise DatasetError(f"--dataset {path}: unknown file type {suffix!r}; expected .jsonl, .json or .parquet")
        return PromptSet(records, str(path), fields, fingerprint.sha256_file(path))
    if path.is_dir() or source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            return _from_datasets(str(path), fields, split, on_disk=True)
        raise DatasetError(f"--dataset {source}: no such file (or not a saved `datasets` directory)")
    return _from_datasets(source, fields, split, on_disk=False)


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"--dataset {path}: line {n} is not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DatasetError(f"--dataset {path}: line {n} is not a JSON object")
            records.append(rec)
    return records


def _read_json(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"--dataset {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DatasetError(f"--dataset {path}: expected a JSON list of objects")
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:
        raise DatasetError(f"--dataset {path}: cannot read parquet ({e})") from None


def _from_datasets(name: str, fields: Fields, split: str, on_disk: bool) -> PromptSet:
    import datasets

    try:
        ds = datasets.load_from_disk(name) if on_disk else datasets.load_dataset(name, split=split)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split]
    except Exception as e:
        raise DatasetError(f"--dataset {name}: cannot load it with `datasets` ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return PromptSet(ds.to_list(), name, fields, fingerprint.sha256_json({"fingerprint": ds._fingerprint, "rows": len(ds)}))
