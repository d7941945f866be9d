"""The tiny target's own answers, for tests: chat-template prompt ids, Hugging Face's hidden states,
and equality up to bf16 rounding."""

import json

import torch

from pipeline import DEFAULT_PROMPTS


def chat_prompt(tok, messages: list[dict]) -> list[int]:
    """Prompt ids as the target sees them: chat template with the generation prompt, no extra specials."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def prompt_ids(target, n: int) -> list[list[int]]:
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()[:n]]
    return [chat_prompt(target.tokenizer, r["messages"][:1]) for r in rows]


def reference_states(target, seq: list[int]) -> tuple:
    """Hugging Face's own hidden_states tuple for one unpadded sequence: [0] = embeddings."""
    with torch.inference_mode():
        out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    return out.hidden_states


def bf16_close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal up to bf16 rounding of an fp32 value (one bf16 ulp)."""
    ref16 = ref.to(torch.bfloat16).float()
    return bool(((got.float() - ref16).abs() <= ref16.abs() * 2 ** -7 + 1e-6).all())
