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

from pipeline.chat_template import Chat, answer_text
from pipeline.errors import DatasetError


def answer_spans(chat: Chat, messages, prompt: list[int], eos_ids: list[int]) -> list[tuple[int, int]]:
    """[(start, end)) token spans of every assistant turn of messages (the prompt's turns) within
    prompt, the ids `chat.ids(messages, True)` gave."""
    tokenizer, where = chat.tokenizer, chat.where
    full = chat.text(messages, generation_prompt=True)
    if not getattr(tokenizer, "is_fast", False):
        raise DatasetError(f"{where}: --turns all needs a fast tokenizer (character offsets); use --turns last")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded.input_ids == prompt, "the prompt is not the rendering of its turns"
    ends_of_turn = [tokenizer.convert_ids_to_tokens(i) for i in eos_ids]
    spans = []
    for j, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.text(messages[:j], True)
        answer = answer_text(chat, messages[:j], message, ends_of_turn)
        if not full.startswith(before + answer):
            raise DatasetError(
                f"{where}: the chat template renders assistant turn {j} differently once later "
                "turns follow, so its tokens cannot be found in the prompt; use --turns split (or last)"
            )
        a, b = len(before), len(before) + len(answer)
        inside = [k for k, (s, e) in enumerate(encoded.offset_mapping) if s < b and e > a]
        if inside:
            spans.append((inside[0], inside[-1] + 1))
    return spans
