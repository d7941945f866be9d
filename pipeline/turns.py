"""Assistant turns inside a rendered conversation: where each earlier assistant answer lies in the
prompt's token ids, so `--turns all` can put the loss on it too.

Found by rendering, not by parsing the template: turn j's answer is the text that rendering turns
0..j adds to the rendering of turns 0..j-1 with the generation prompt, cut after its last
end-of-turn token (the newline a template puts between turns is context, not answer), and both
must appear verbatim at the start of the whole prompt's text. A template that renders a turn
differently once later turns follow (one that drops reasoning from history, for example) fails
that check and is refused, naming the row, rather than masked wrongly. The prompt is tokenized as
one text (as a server tokenizes a chat history), so a token may straddle an answer's edge (a
newline merged with the answer's indentation): every token holding a character of the answer
carries the loss.
"""

from __future__ import annotations

from pipeline.errors import DatasetError


def text(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False)


def render(tokenizer, messages, generation_prompt: bool) -> list[int]:
    """The chat template applied to messages, as token ids (the template writes its own specials)."""
    return tokenizer(text(tokenizer, messages, generation_prompt), add_special_tokens=False).input_ids


def answer_spans(tokenizer, messages, prompt: list[int], eos_ids: list[int],
                 where: str) -> list[tuple[int, int]]:
    """[(start, end)) token spans of every assistant turn of messages (the prompt's turns) within
    prompt, the ids `render(tokenizer, messages, True)` gave; where: the row, named in errors."""
    full = text(tokenizer, messages, generation_prompt=True)
    if not getattr(tokenizer, "is_fast", False):
        raise DatasetError(f"{where}: --turns all needs a fast tokenizer (character offsets); use --turns last")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded.input_ids == prompt, "the prompt is not the rendering of its turns"
    ends_of_turn = [tokenizer.convert_ids_to_tokens(i) for i in eos_ids]
    spans = []
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = text(tokenizer, messages[:j], True), text(tokenizer, messages[:j + 1], False)
        answer = upto[len(before):]
        cut = max((answer.rfind(e) + len(e) for e in ends_of_turn if e in answer), default=len(answer))
        answer = answer[:cut]
        if not upto.startswith(before) or not full.startswith(before + answer):
            raise DatasetError(f"{where}: the chat template renders assistant turn {j} differently once later "
                               "turns follow, so its tokens cannot be found in the prompt; use --turns last")
        a, b = len(before), len(before) + len(answer)
        inside = [k for k, (s, e) in enumerate(encoded.offset_mapping) if s < b and e > a]
        if inside:
            spans.append((inside[0], inside[-1] + 1))
    return spans
