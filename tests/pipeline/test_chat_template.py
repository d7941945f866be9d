"""A row through the chat template: its arguments reach the rendering, what the template leaves
out is refused naming the row, an answer with reasoning or tool calls is the template's text."""

import pytest
from transformers import AutoTokenizer

from pipeline import TINY_TARGET, chat_template
from pipeline.chat_template import Chat
from pipeline.errors import DatasetError
from pipeline.prompts import Row

PLAIN_CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
TOOLS = ({"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},)
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}],
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


@pytest.fixture
def plain_tok():
    t = AutoTokenizer.from_pretrained(TINY_TARGET)
    t.chat_template = PLAIN_CHATML
    return t


def test_the_rows_own_arguments_go_over_the_runs_and_tools_join_them(tok):
    row = Row(4, ({"role": "user", "content": "Hi"},), None, tools=TOOLS, template_kwargs={"enable_thinking": False})
    chat = chat_template.for_row(tok, row, {"enable_thinking": True, "x": 1}, "d.jsonl")
    assert (
        chat.kwargs == {"enable_thinking": False, "x": 1, "tools": list(TOOLS)}
        and chat.where == "dataset d.jsonl: row 4"
    )
    assert chat_template.mode(chat.kwargs) == '{"enable_thinking": false, "x": 1}'
    text = chat.text(row.messages, True)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n{") and text.endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )


def test_tools_or_calls_the_template_leaves_out_are_refused_naming_the_row(tok, plain_tok):
    messages = ({"role": "user", "content": "add 2 and 2"},)
    chat_template.check(Chat(tok, {"tools": list(TOOLS)}, "row 3"), messages)  # the tiny template renders them
    with pytest.raises(DatasetError, match=r"^row 3: the row has 1 tool\(s\) but the target's chat template does not"):
        chat_template.check(Chat(plain_tok, {"tools": list(TOOLS)}, "row 3"), messages)
    chat_template.check(Chat(tok, {}, "row 5"), messages + (CALL,))
    with pytest.raises(DatasetError, match="^row 5: turn 1 has tool_calls but the target's chat template does not"):
        chat_template.check(Chat(plain_tok, {}, "row 5"), messages + (CALL,))


def test_a_template_error_is_one_line_naming_the_row(plain_tok):
    plain_tok.chat_template = "{{ raise_exception('no system turns here') }}"
    with pytest.raises(DatasetError, match="^row 9: the chat template cannot render this row .*no system turns here"):
        Chat(plain_tok, {}, "row 9").text([{"role": "user", "content": "x"}], True)


def test_an_answer_is_its_text_plus_eos_or_the_templates_rendering(tok):
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    before = ({"role": "user", "content": "What is 2+2?"},)
    chat = Chat(tok, {}, "row 0")
    plain = {"role": "assistant", "content": "4"}
    assert chat_template.answer_ids(chat, before, plain, eos) == tok("4", add_special_tokens=False).input_ids + eos
    thought = {**plain, "reasoning_content": "2+2=4"}
    got = chat_template.answer_ids(chat, before, thought, eos)
    assert tok.decode(got) == "<think>\n2+2=4\n</think>\n\n4<|im_end|>"
    assert chat.ids(before, True) + got == chat.ids(before + (thought,), False)[:-1]  # the rendering, less its "\n"
    call = chat_template.answer_ids(chat, before, CALL, eos)
    assert tok.decode(call) == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>'


def test_per_turn_gives_each_answer_with_the_turns_before_it():
    turns = (
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "b"},
    )
    last = {"role": "assistant", "content": "B", "reasoning_content": "r"}
    row = Row(2, turns, "B", (5, 6), last, TOOLS, {"enable_thinking": True})
    first, second = row.per_turn()
    assert (
        first.messages == turns[:2]
        and first.answer == turns[2]
        and first.response == "A"
        and first.response_ids is None
    )
    assert second.messages == turns and second.answer == last and second.response_ids == (5, 6)
    assert first.tools == second.tools == TOOLS and first.index == second.index == 2
