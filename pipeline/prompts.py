"""The prompt set: rows from jsonl, json, parquet or a `datasets` dataset, mapped to shards.

A row holds either chat turns (the prompt is every turn before the last assistant turn, which is
the dataset's own response; system turns stay in the prompt) or a `prompt` string (plus an
optional response field). Turns come OpenAI/UltraChat style (`messages` of {"role", "content"})
or ShareGPT style (`conversations` of {"from": "human"|"gpt"|"system", "value"}). Both name their
roles from one table (ROLES, case ignored); any other role is refused naming the row and turn, as
rendered it would hide the answer in the prompt or drop it. A turn's content is text, or a list of
OpenAI content parts that are all text, joined with no separator (as the Qwen3.5/3.6 chat templates
render such a list); a part of any other type (an image) is refused naming the row, turn and type.
Rows map to shards by position: shard s of K holds rows [s*N//K, (s+1)*N//K), so a row always
lands in the same shard whatever ranges or workers run. The row count is part of the dataset
fingerprint, so a changed dataset cannot silently shift rows between shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from pipeline import row_sources
from pipeline.errors import DatasetError

SHAREGPT_FIELD = "conversations"  # where ShareGPT rows keep their turns, when the messages field is absent
# a turn's role (`role`, or ShareGPT's `from`; case ignored) -> the role the chat template gets: the four
# chat templates know, and ShareGPT's names for two of them
ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
}


@dataclass(frozen=True)
class Fields:
    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"
    template_kwargs: str | None = None  # a field holding the row's own chat-template arguments
    category: str | None = None  # a field holding the row's label (a benchmark, a source), stored per sample


TOOLS_FIELD = "tools"  # a row's tool schemas (a list, or its JSON text), given to the chat template
# token rows: stored as given, no template (PromptSet._token_row)
INPUT_IDS, LOSS_MASK, PROMPT_IDS = "input_ids", "loss_mask", "prompt_ids"


@dataclass(frozen=True)
class Row:
    index: int
    messages: tuple  # chat turns for the prompt, each {"role", "content"} (+ tool_calls, reasoning_content)
    response: str | None  # the dataset's own assistant answer, if any
    response_ids: tuple[int, ...] | None = None  # the answer as token ids (an engine's, generated offline)
    answer: dict | None = None  # the assistant turn `response` is the content of, as the dataset gives it
    tools: tuple = ()  # the row's tool schemas
    template_kwargs: dict = field(default_factory=dict)  # the row's own chat-template arguments
    prompt_ids: tuple[int, ...] | None = None  # a token row's prompt, stored as given (no template)
    prompt_spans: tuple[tuple[int, int], ...] = ()  # [start, end) runs of a token row's prompt carrying the loss
    category: str | None = None  # the row's label from Fields.category ("" when the row has none)

    def conversation(self) -> tuple:
        """The prompt's turns and the answer turn after them."""
        return self.messages + ((self.answer,) if self.answer is not None else ())

    def per_turn(self) -> list[Row]:
        """One row per assistant turn (--turns split): the turns before it as the prompt, it as the
        answer, so each is rendered as the last turn, as the model produces it."""
        if self.prompt_ids is not None:
            return [self]  # a token row is one sample, its loss mask as given
        turns = self.conversation()
        return [
            replace(
                self,
                messages=turns[:j],
                response=m["content"],
                response_ids=self.response_ids if j == len(turns) - 1 else None,
                answer=m,
            )
            for j, m in enumerate(turns)
            if m["role"] == "assistant"
        ] or [self]  # no answer: skipped as such


class PromptSet:
    """records: the rows as a sequence of dicts, read lazily where the source allows
    (pipeline/row_sources.py): a process decodes only the rows of the shards it works on."""

    def __init__(self, records, source: str, sha256: str, fields: Fields) -> None:
        self.records = records
        self.source = source
        self.fields = fields
        self.sha256 = sha256
        if records and not {fields.messages, SHAREGPT_FIELD, fields.prompt, INPUT_IDS, PROMPT_IDS} & set(records[0]):
            raise DatasetError(
                f"dataset {source}: row 0 has neither field {fields.messages!r} ({SHAREGPT_FIELD!r}) nor "
                f"{fields.prompt!r} nor token ids ({INPUT_IDS!r}, {PROMPT_IDS!r}) (fields present: "
                f"{sorted(records[0])}); set --messages-field or --prompt-field"
            )

    def __len__(self) -> int:
        return len(self.records)

    def shard_rows(self, shard: int, num_shards: int) -> range:
        n = len(self.records)
        return range(shard * n // num_shards, (shard + 1) * n // num_shards)

    def by_length(self, rows) -> list[Row]:
        """The rows numbered `rows` (in file order), parsed in one forward pass, then ordered by the
        length of their prompt text, or ids for token rows (stable): batches of similar lengths pad
        little in generation and capture. Parsed in file order and kept: a Parquet file's stream
        never steps back (pipeline/row_sources.py), where rows taken in length order restarted it
        at its row group for each step back."""
        return sorted((self.row(i) for i in rows), key=prompt_size)

    def check(self, rows) -> None:
        """Parse every row of `rows` now (before any model loads); the first bad one is named."""
        for i in rows:
            self.row(i)

    def row(self, i: int) -> Row:
        rec = self.records[i]
        f = self.fields
        ids = self._ids(i, rec)
        extra = {
            "tools": self._json(i, rec, TOOLS_FIELD, list, ()),
            "template_kwargs": self._json(i, rec, f.template_kwargs, dict, {}) if f.template_kwargs else {},
            "category": self._label(i, rec),
        }
        if INPUT_IDS in rec or PROMPT_IDS in rec:
            return self._token_row(i, rec, ids, extra)
        turns_field = f.messages if f.messages in rec else SHAREGPT_FIELD if SHAREGPT_FIELD in rec else None
        if turns_field is not None:
            msgs = self._turns(i, turns_field, rec[turns_field])
            last_assistant = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
            if last_assistant is None:
                return Row(i, tuple(msgs), None, ids, **extra)
            answer = msgs[last_assistant]
            return Row(i, tuple(msgs[:last_assistant]), answer["content"], ids, answer, **extra)
        if f.prompt in rec:
            prompt = rec[f.prompt]
            if not isinstance(prompt, str):
                raise DatasetError(
                    f"dataset {self.source}: row {i} field {f.prompt!r} is {type(prompt).__name__}, expected text"
                )
            response = rec.get(f.response)
            if isinstance(response, list):  # content parts, joined as a turn's are
                response = turn_text(f"dataset {self.source}: row {i} field {f.response!r}", response)
            return Row(i, ({"role": "user", "content": prompt},), response, ids, **extra)
        raise DatasetError(
            f"dataset {self.source}: row {i} has neither field {f.messages!r} ({SHAREGPT_FIELD!r}) "
            f"nor {f.prompt!r} (fields present: {sorted(rec)})"
        )

    def _ids(self, i: int, rec: dict, name: str | None = None) -> tuple[int, ...] | None:
        """The row's field `name` as token ids, if any; by default the response's, from `<response
        field>_ids` (e.g. `response_ids`)."""
        name = name or f"{self.fields.response}_ids"
        ids = rec.get(name)
        if ids is None:
            return None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise DatasetError(f"dataset {self.source}: row {i} field {name!r} is not a list of token ids (ints >= 0)")
        return tuple(ids)

    def _label(self, i: int, rec: dict) -> str | None:
        """The row's category label (text or a number; "" when absent), or None with no category field."""
        name = self.fields.category
        if not name:
            return None
        value = rec.get(name)
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise DatasetError(
                f"dataset {self.source}: row {i} field {name!r} is {type(value).__name__}, expected "
                "a label (text or a number)"
            )
        return str(value)

    def _token_row(self, i: int, rec: dict, response_ids, extra: dict) -> Row:
        """A row given as token ids, as an agent's rollouts are recorded: `input_ids` with a
        `loss_mask` (the last run of 1s is the answer, earlier runs carry the loss inside the
        prompt, tokens after the last run are left out), or `prompt_ids` with `<response>_ids`."""
        if PROMPT_IDS in rec:
            return Row(i, (), None, response_ids, prompt_ids=self._ids(i, rec, PROMPT_IDS) or (), **extra)
        ids, mask = self._ids(i, rec, INPUT_IDS) or (), rec.get(LOSS_MASK)
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise DatasetError(
                f"dataset {self.source}: row {i} field {LOSS_MASK!r} must be a list of 0 and 1 as long "
                f"as {INPUT_IDS!r} ({len(ids)} ids)"
            )
        runs = loss_runs(mask)
        if not runs:
            return Row(i, (), None, None, prompt_ids=ids, **extra)
        (start, end), earlier = runs[-1], tuple(runs[:-1])
        return Row(i, (), None, ids[start:end], prompt_ids=ids[:start], prompt_spans=earlier, **extra)

    def _json(self, i: int, rec: dict, name: str, kind: type, empty):
        """The row's field `name` as a `kind` (list or dict; JSON text of one is parsed), or empty."""
        value = rec.get(name)
        if value is None or value == "":
            return empty
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise DatasetError(
                    f"dataset {self.source}: row {i} field {name!r} is text but not JSON ({e})"
                ) from None
        if not isinstance(value, kind):
            raise DatasetError(
                f"dataset {self.source}: row {i} field {name!r} is {type(value).__name__}, expected "
                f"{'a list' if kind is list else 'an object'} (or its JSON text)"
            )
        return tuple(value) if kind is list else value

    def _turns(self, i: int, field: str, turns) -> list[dict]:
        """A row's turns as {"role", "content"} (content as text), from either style."""
        where = f"dataset {self.source}: row {i} field {field!r}"
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise DatasetError(f"{where} is not a list of turns")
        out = []
        for j, t in enumerate(turns):
            at = f"{where} turn {j}"
            if "role" in t and ("content" in t or t.get("tool_calls")):
                out.append({**t, "role": turn_role(at, "role", t["role"]), "content": turn_text(at, t.get("content"))})
            elif "from" in t and "value" in t:
                out.append({"role": turn_role(at, "from", t["from"]), "content": turn_text(at, t["value"])})
            else:
                raise DatasetError(
                    f"{at}: expected {{'role', 'content'}} or {{'from', 'value'}}, found keys {sorted(t)}"
                )
        return out

    def describe(self) -> dict:
        fields = {"messages": self.fields.messages, "prompt": self.fields.prompt, "response": self.fields.response}
        for name in ("template_kwargs", "category"):  # recorded only when given: older stores' fingerprints stay
            if getattr(self.fields, name):
                fields[name] = getattr(self.fields, name)
        return {"source": self.source, "rows": len(self), "sha256": self.sha256, "fields": fields}


def has_prompt(row: Row) -> bool:
    """The row gives the target something to read: prompt ids, or a turn with text."""
    if row.prompt_ids is not None:
        return bool(row.prompt_ids)
    return any(str(m.get("content") or "").strip() for m in row.messages)


def has_response(row: Row) -> bool:
    """The row brings its own answer (--responses dataset): token ids, an answer turn the template
    renders with reasoning or a tool call, or text that is not blank."""
    if row.response_ids is not None:
        return bool(row.response_ids)
    if row.answer is not None and (row.answer.get("reasoning_content") or row.answer.get("tool_calls")):
        return True
    return bool(str(row.response or "").strip())


def turn_role(where: str, key: str, value) -> str:
    """A turn's role as the chat template gets it (ROLES, case ignored); any other refused."""
    role = ROLES.get(value.lower()) if isinstance(value, str) else None
    if role is None:
        raise DatasetError(f"{where}: {key!r} is {value!r}, expected one of {', '.join(ROLES)} (any case)")
    return role


def turn_text(where: str, content) -> str:
    """A turn's content as text: text as it is, none as "", a list of OpenAI content parts joined
    with no separator when every part is text ({"type": "text", "text": ...})."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise DatasetError(f"{where}: content is {type(content).__name__}, expected text or a list of text parts")
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and not isinstance(part.get("text"), str):
            raise DatasetError(f"{where}: content part {k} is of type 'text' but its 'text' is not text")
        if kind != "text":
            raise DatasetError(
                f"{where}: content part {k} is of type {kind!r}; only text parts "
                "({'type': 'text', 'text': ...}) can be read, the target is read as a text model"
            )
    return "".join(part["text"] for part in content)


def prompt_size(row: Row) -> int:
    if row.prompt_ids is not None:
        return len(row.prompt_ids)
    return sum(len(str(m.get("content") or "")) for m in row.messages)


def loss_runs(mask: list) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a 0/1 list."""
    runs, start = [], None
    for k, m in enumerate([*mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    return runs


def load(source: str, fields: Fields = Fields(), split: str = "train") -> PromptSet:
    """The prompt set at source: a .jsonl, .json or .parquet file, a saved `datasets` directory, or a
    hub dataset name."""
    return PromptSet(*row_sources.open_rows(source, split), fields)
