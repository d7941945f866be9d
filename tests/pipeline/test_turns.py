"""Assistant turns inside a rendered conversation (--turns all): found exactly, or refused."""

import pytest
from transformers import AutoTokenizer

from pipeline import TINY_TARGET, turns
from pipeline.chat_template import Chat
from pipeline.errors import DatasetError

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Add 1+1"},
    {"role": "assistant", "content": "It is 2."},
    {"role": "user", "content": "And 2+2?"},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


def test_every_earlier_answer_is_found_with_its_end_of_turn(tok):
    chat = Chat(tok, {}, "row 0")
    prompt = chat.ids(CHAT, generation_prompt=True)
    spans = turns.answer_spans(chat, CHAT, prompt, [tok.convert_tokens_to_ids("<|im_end|>")])
    assert [tok.decode(prompt[a:b]) for a, b in spans] == ["Hello there<|im_end|>", "It is 2.<|im_end|>"]
    outside = [t for k, t in enumerate(prompt) if not any(a <= k < b for a, b in spans)]
    assert "Hello there" not in tok.decode(outside) and "It is 2." not in tok.decode(outside)
    assert "Add 1+1" in tok.decode(outside)  # user turns stay context


def test_a_conversation_without_earlier_answers_has_no_spans(tok):
    chat, turns_ = Chat(tok, {}, "row 0"), [{"role": "user", "content": "Hi"}]
    assert turns.answer_spans(chat, turns_, chat.ids(turns_, True), [2]) == []


def test_a_template_that_rewrites_history_is_refused(tok):
    """A template that renders an answer differently once later turns follow (as templates that
    drop reasoning from history do) cannot be masked honestly: refused, naming the row."""
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    tok.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\n(earlier)<|im_end|>\n' }}{%- else %}"
        "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
    )
    chat, messages = Chat(tok, {}, "row 7"), CHAT[:5] + [{"role": "user", "content": "More"}]
    with pytest.raises(DatasetError, match="row 7: the chat template renders assistant turn 2 differently"):
        turns.answer_spans(chat, messages, chat.ids(messages, True), [2])
