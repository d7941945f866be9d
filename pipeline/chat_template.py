"""A row rendered through the target's chat template: the arguments every rendering of it gets
(--chat-template-kwargs, then the row's own from --template-kwargs-field, then its `tools`), what
a template cannot render refused in one line naming the row, and an answer turn as the template
renders it.

An answer with `reasoning_content` or `tool_calls` exists as text only through the template (the
thinking block, the call's markup), so it is stored as the template renders that turn: the text
rendering the conversation up to and including it adds to the conversation before it with the
generation prompt, cut after its last end-of-turn token. A plain answer stays its text plus EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.errors import DatasetError


@dataclass(frozen=True)
class Chat:
    """How one row is rendered: the tokenizer, the arguments of every rendering, the row's name."""

    tokenizer: object
    kwargs: dict  # to apply_chat_template: tools, enable_thinking, ...
    where: str  # "dataset X: row 12", named in errors

    def text(self, messages, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs
            )
        except Exception as e:  # noqa: BLE001 - jinja's errors (raise_exception, a missing key) name no row
            raise DatasetError(
                f"{self.where}: the chat template cannot render this row ({type(e).__name__}: {e})"
            ) from None

    def ids(self, messages, generation_prompt: bool) -> list[int]:
        """The template applied to messages, as token ids (the template writes its own specials)."""
        return self.tokenizer(self.text(messages, generation_prompt), add_special_tokens=False).input_ids


def for_row(tokenizer, row, base: dict, source: str) -> Chat:
    """How a dataset row (pipeline/prompts.py Row) renders: --chat-template-kwargs (base), the row's
    own over them, its tools."""
    kwargs = {**base, **row.template_kwargs, **({"tools": list(row.tools)} if row.tools else {})}
    return Chat(tokenizer, kwargs, f"dataset {source}: row {row.index}")


def mode(kwargs: dict) -> str:
    """A rendering's arguments other than tools, as the summary counts rows by them."""
    return json.dumps({k: v for k, v in sorted(kwargs.items()) if k != "tools"})


def check(chat: Chat, messages) -> None:
    """Refuse a row whose tools or tool calls the template leaves out (it renders the row the same
    without them): the states would be of another conversation than the data's."""
    if chat.kwargs.get("tools"):
        bare = Chat(chat.tokenizer, {k: v for k, v in chat.kwargs.items() if k != "tools"}, chat.where)
        if chat.text(messages, True) == bare.text(messages, True):
            raise DatasetError(
                f"{chat.where}: the row has {len(chat.kwargs['tools'])} tool(s) but the target's chat "
                "template does not render them (the text is the same without them)"
            )
    for j, m in enumerate(messages):
        if m.get("tool_calls"):
            without = [*messages[:j], {k: v for k, v in m.items() if k != "tool_calls"}]
            if chat.text(messages[: j + 1], False) == chat.text(without, False):
                raise DatasetError(
                    f"{chat.where}: turn {j} has tool_calls but the target's chat template does not "
                    "render them (the text is the same without them)"
                )


def templated(message: dict) -> bool:
    """The answer exists as text only through the template (a thinking block, a call's markup)."""
    return bool(message.get("reasoning_content") or message.get("tool_calls"))


def answer_text(chat: Chat, before, message: dict, ends_of_turn: list[str]) -> str:
    """The text the template renders for answer `message` after the turns `before`, cut after its
    last end-of-turn token; refused when the rendering of `before` is not a prefix of it."""
    prompt, upto = chat.text(before, True), chat.text([*before, message], False)
    if not upto.startswith(prompt):
        raise DatasetError(
            f"{chat.where}: the chat template renders the turns before assistant turn {len(before)} "
            "differently once it follows, so its answer cannot be cut from the rendering"
        )
    answer = upto[len(prompt) :]
    cut = max((answer.rfind(e) + len(e) for e in ends_of_turn if e in answer), default=len(answer))
    return answer[:cut]


def answer_ids(chat: Chat, before, message: dict, eos_ids: list[int]) -> list[int]:
    """An answer as token ids: as the template renders it (templated), else its text plus EOS."""
    tok = chat.tokenizer
    if not templated(message):
        return tok(str(message.get("content") or ""), add_special_tokens=False).input_ids + [eos_ids[0]]
    text = answer_text(chat, before, message, [tok.convert_ids_to_tokens(i) for i in eos_ids])
    return tok(text, add_special_tokens=False).input_ids
