"""Extraction through the chat template: --chat-template-kwargs and a row's own arguments reach
every rendering and the store's record, tools and tool calls and reasoning are stored as the
template renders them, and --turns split trains every answer as the last turn."""

import json
import shutil

import pytest

from pipeline import TINY_TARGET
from pipeline.errors import DatasetError
from stages.extract.config import ExtractConfig
from stages.extract.run import run
from stages.extract.summary import render
from store.errors import ConfigError
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from store.summary import render as info_render
from store.summary import summarize
from tests.conftest import SMALL
from tests.pipeline.test_chat_template import CALL, PLAIN_CHATML, TOOLS

LONG = {**SMALL, "max_new_tokens": 200, "max_length": 600}
USER = {"role": "user", "content": "def add(a, b):"}
THOUGHT = {"role": "assistant", "content": "    return a + b", "reasoning_content": "Add them."}


def write(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def samples(location) -> list:
    store = HiddenStore(str(location))
    out = []
    for shard in sorted(store.committed()):
        reader = ShardReader(store, shard)
        out += [reader.read(i) for i in range(len(reader))]
    return sorted(out, key=lambda s: (s.row_id, s.prompt_len))


def chat_ids(target, messages, generation_prompt=True, **kwargs) -> list[int]:
    text = target.tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )
    return target.tokenizer(text, add_special_tokens=False).input_ids


def test_template_arguments_reach_the_prompts_the_record_and_info(tmp_path, target):
    data = write(tmp_path, [{"messages": [USER]}, {"messages": [{"role": "user", "content": "def sub(a, b):"}]}])
    common = dict(dataset=data, shards="0", num_shards=1, **SMALL)
    off = run(
        ExtractConfig(store=str(tmp_path / "off.zarr"), chat_template_kwargs='{"enable_thinking": false}', **common),
        log=lambda m: None,
    )
    run(ExtractConfig(store=str(tmp_path / "plain.zarr"), **common), log=lambda m: None)
    rows = [json.loads(line) for line in open(data)]
    for s in samples(tmp_path / "off.zarr"):
        assert s.tokens[: s.prompt_len].tolist() == chat_ids(target, rows[s.row_id]["messages"], enable_thinking=False)
    attrs = HiddenStore(str(tmp_path / "off.zarr")).attrs
    assert attrs.compat.chat_template_kwargs == {"enable_thinking": False}
    assert HiddenStore(str(tmp_path / "plain.zarr")).attrs.compat.chat_template_kwargs is None
    assert attrs.fingerprint != HiddenStore(str(tmp_path / "plain.zarr")).attrs.fingerprint
    assert 'chat template arguments {"enable_thinking": false}' in info_render(
        summarize(HiddenStore(str(tmp_path / "off.zarr")))
    )
    assert off["template_modes"] == {'{"enable_thinking": false}': 2}
    assert 'rows per chat-template mode: {"enable_thinking": false}: 2' in render(off)


def test_a_rows_own_arguments_mix_modes_in_one_store_and_are_counted(tmp_path, target):
    rows = [
        {"messages": [USER], "mode": {"enable_thinking": False}},
        {"messages": [USER]},
        {"messages": [USER], "mode": '{"enable_thinking": true}'},
    ]
    summary = run(
        ExtractConfig(
            store=str(tmp_path / "mix.zarr"),
            dataset=write(tmp_path, rows),
            shards="0",
            num_shards=1,
            template_kwargs_field="mode",
            **SMALL,
        ),
        log=lambda m: None,
    )
    assert summary["template_modes"] == {'{"enable_thinking": false}': 1, "{}": 1, '{"enable_thinking": true}': 1}
    prompts = {s.row_id: s.tokens[: s.prompt_len].tolist() for s in samples(tmp_path / "mix.zarr")}
    assert prompts[0] == chat_ids(target, [USER], enable_thinking=False) != prompts[1] == chat_ids(target, [USER])
    assert HiddenStore(str(tmp_path / "mix.zarr")).attrs.compat.dataset_fields["template_kwargs"] == "mode"
    with pytest.raises(DatasetError, match="row 0 field 'mode' is list, expected an object"):
        run(
            ExtractConfig(
                store=str(tmp_path / "bad.zarr"),
                dataset=write(tmp_path, [{"messages": [USER], "mode": [1]}]),
                shards="0",
                num_shards=1,
                template_kwargs_field="mode",
                **SMALL,
            ),
            log=lambda m: None,
        )


def test_tools_calls_and_reasoning_are_stored_as_the_template_renders_them(tmp_path, target):
    agent = [{"role": "user", "content": "add 2 and 2"}, CALL, {"role": "tool", "content": "4"}]
    rows = [
        {"tools": json.dumps(TOOLS), "messages": agent + [{"role": "assistant", "content": "It is 4."}]},
        {"tools": list(TOOLS), "messages": agent[:1] + [CALL]},
        {"messages": [USER, THOUGHT]},
    ]
    run(
        ExtractConfig(
            store=str(tmp_path / "t.zarr"),
            dataset=write(tmp_path, rows),
            shards="0",
            num_shards=1,
            responses="dataset",
            **LONG,
        ),
        log=lambda m: None,
    )
    got = {s.row_id: s for s in samples(tmp_path / "t.zarr")}
    decode = target.tokenizer.decode
    assert got[0].tokens[: got[0].prompt_len].tolist() == chat_ids(target, agent, tools=list(TOOLS))
    assert decode(got[0].tokens[: got[0].prompt_len]).startswith("<|im_start|>system\n# Tools\n<tools>\n")
    assert decode(got[0].tokens[got[0].prompt_len :]) == "It is 4.<|im_end|>"
    assert decode(got[1].tokens[got[1].prompt_len :]) == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>'
    )
    assert decode(got[2].tokens[got[2].prompt_len :]) == "<think>\nAdd them.\n</think>\n\n    return a + b<|im_end|>"


def test_a_template_that_cannot_render_tools_is_refused_naming_the_row(tmp_path):
    plain = tmp_path / "plain_target"
    shutil.copytree(TINY_TARGET, plain)
    (plain / "chat_template.jinja").write_text(PLAIN_CHATML)
    data = write(tmp_path, [{"messages": [USER]}, {"tools": list(TOOLS), "messages": [USER]}])
    with pytest.raises(
        DatasetError, match=r"rows.jsonl: row 1: the row has 1 tool\(s\) but the target's chat template"
    ):
        run(
            ExtractConfig(
                store=str(tmp_path / "t.zarr"), dataset=data, target=str(plain), shards="0", num_shards=1, **SMALL
            ),
            log=lambda m: None,
        )


def test_turns_split_stores_each_answer_as_the_last_turn(tmp_path, target):
    """The tiny template drops reasoning from history, as Qwen3's do: --turns all is refused naming
    the row; --turns split stores one sample per answer, each with its thinking block."""
    second = {"role": "assistant", "content": "    return a - b", "reasoning_content": "Subtract."}
    turns = [USER, THOUGHT, {"role": "user", "content": "def sub(a, b):"}, second]
    data = write(tmp_path, [{"messages": turns}, {"messages": [USER, THOUGHT]}, {"messages": [USER]}])
    common = dict(dataset=data, shards="0", num_shards=1, responses="dataset", **LONG)
    with pytest.raises(
        DatasetError, match="row 0: the chat template renders assistant turn 1 differently .* --turns split"
    ):
        run(ExtractConfig(store=str(tmp_path / "all.zarr"), turns="all", **common), log=lambda m: None)
    summary = run(ExtractConfig(store=str(tmp_path / "split.zarr"), turns="split", **common), log=lambda m: None)
    assert summary["samples"] == 3 and summary["skipped"]["missing_response"] == 1  # the row without an answer
    got = samples(tmp_path / "split.zarr")
    assert [s.row_id for s in got] == [0, 0, 1]
    decode = target.tokenizer.decode
    for s, before, answer in [(got[0], turns[:1], THOUGHT), (got[1], turns[:3], second), (got[2], turns[:1], THOUGHT)]:
        assert s.tokens[: s.prompt_len].tolist() == chat_ids(target, before)
        assert decode(s.tokens[s.prompt_len :]) == (
            f"<think>\n{answer['reasoning_content']}\n</think>\n\n{answer['content']}<|im_end|>"
        )
    assert "Add them." not in decode(got[1].tokens[: got[1].prompt_len])  # history without its reasoning
    assert HiddenStore(str(tmp_path / "split.zarr")).attrs.compat.turns == "split"


def test_dataset_rows_as_real_exports_write_them(tmp_path, target):
    """Capitalised roles and OpenAI text content parts store the same sample as the plain row; a
    blank answer is skipped as missing, not stored as a lone end token."""
    answer = "    return a + b"
    rows = [
        {"messages": [USER, {"role": "assistant", "content": " \n "}]},
        {
            "messages": [
                {"role": "User", "content": [{"type": "text", "text": "def add("}, {"type": "text", "text": "a, b):"}]},
                {"role": "Assistant", "content": [{"type": "text", "text": answer}]},
            ]
        },
        {"messages": [USER, {"role": "assistant", "content": answer}]},
    ]
    summary = run(
        ExtractConfig(
            store=str(tmp_path / "r.zarr"),
            dataset=write(tmp_path, rows),
            shards="0",
            num_shards=1,
            responses="dataset",
            **LONG,
        ),
        log=lambda m: None,
    )
    assert summary["samples"] == 2 and summary["skipped"]["missing_response"] == 1
    assert "skipped rows: missing_response 1;" in render(summary)
    got = samples(tmp_path / "r.zarr")
    assert [s.row_id for s in got] == [1, 2] and got[0].tokens.tolist() == got[1].tokens.tolist()
    assert got[0].tokens[: got[0].prompt_len].tolist() == chat_ids(target, [USER])
    assert target.tokenizer.decode(got[0].tokens[got[0].prompt_len :]) == answer + "<|im_end|>"


def test_an_unknown_role_stops_extract_in_one_line(tmp_path):
    from tests.processes import cli_args, run_pipeline

    rows = [
        {"messages": [USER, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "human", "content": "hi"}, {"role": "bot", "content": "hello"}]},
    ]
    p = run_pipeline(cli_args(tmp_path / "hs.zarr", write(tmp_path, rows), "0", num_shards=1, responses="dataset"))
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines()[-1] == (
        f"error: dataset {tmp_path / 'rows.jsonl'}: row 1 field 'messages' turn 1: "
        "'role' is 'bot', expected one of system, user, assistant, tool, human, gpt "
        "(any case)"
    )
    assert not (tmp_path / "hs.zarr").exists()


@pytest.mark.parametrize("text, problem", [("{not json", "is not JSON"), ("[1]", "must be a JSON object")])
def test_chat_template_kwargs_must_be_a_json_object(text, problem):
    with pytest.raises(ConfigError, match=f"--chat-template-kwargs .*{problem}"):
        ExtractConfig(chat_template_kwargs=text)
