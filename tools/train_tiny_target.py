"""Train the shipped tiny hybrid target (qwen3_5_text) on the Python standard library, on CPU.

    python tools/train_tiny_target.py --out pipeline/assets/tiny_target --prompts pipeline/assets/prompts.jsonl

Reproducible: fixed seeds, a fixed step count, a fixed thread count and a deterministic data
order; the corpus is this interpreter's own standard library (the Python version is recorded in
`provenance.json`). About 14 minutes on 2 CPU cores. The model (8 layers: 3 Gated DeltaNet
linear-attention layers then 1 full-attention layer, twice) is saved in bf16. Its Gated DeltaNet
heads are 64 wide (1 key head, 2 value heads), the narrowest vLLM's CPU kernel serves, so a real
vLLM can serve it in the engine tests.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

sys.modules["fla"] = None  # CPU: pin the PyTorch Gated DeltaNet path before transformers loads it

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import stdlib_corpus  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# ChatML. Beyond what the model was trained on (plain turns, rendered exactly as before), the
# template renders what a reasoning model with tools sees, so that every extraction feature runs on
# it: a tools block (a system turn listing the `tools` given to the template), an assistant turn's
# `reasoning_content` as <think>...</think> and its `tool_calls` as <tool_call> blocks, role `tool`
# as a <tool_response>, and `enable_thinking=False` as an empty think block after the generation
# prompt. As Qwen3's templates do, reasoning is rendered only in turns after the last user turn
# (dropped from history), which is what `--turns split` exists for.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- set no_thinking = enable_thinking is defined and enable_thinking is false %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}"
    "{%- if loop.index0 > ns.last_user and (message.get('reasoning_content') or no_thinking) %}"
    "{{- '<think>\\n' + (message.get('reasoning_content') or '') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>\\n' + ((call['function'] if 'function' in call else call) | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if no_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="model + tokenizer directory to write")
    p.add_argument("--prompts", type=Path, required=True, help="held-out chat prompts (jsonl) to write")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size, specials included")
    p.add_argument("--steps", type=int, default=750, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--num-prompts", type=int, default=640, help="held-out prompts to ship")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (fixed for reproducibility)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompts-only",
        action="store_true",
        help="only rewrite --prompts, with the tokenizer already in --out (what a full run writes too)",
    )
    return p.parse_args()


def render(messages: list[dict]) -> str:
    text = ""
    for m in messages:
        text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return text


def encode(tok, fn: stdlib_corpus.Function) -> list[int]:
    """Prompt and answer tokenized apart, exactly as at inference (prompt ids, then generated ids).

    Tokenizing the whole chat at once would merge the newline after 'assistant' with the body's
    indentation, a token sequence the model then never sees when it starts an answer.
    """
    user, assistant = fn.messages()
    prompt = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    return (
        tok(prompt, add_special_tokens=False).input_ids
        + tok(assistant["content"] + "<|im_end|>\n", add_special_tokens=False).input_ids
        + [tok.pad_token_id]
    )


def train_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def model_config(tok: PreTrainedTokenizerFast) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=64,  # vLLM's CPU Gated DeltaNet kernel takes 64 or 128 (Qwen3.6: 128)
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        dtype="bfloat16",
    )


def packed_batches(ids: list[list[int]], batch: int, seq_len: int, steps: int, seed: int):
    """Endless deterministic stream of [batch, seq_len+1] windows over shuffled, concatenated docs."""
    rng = random.Random(seed)
    order = list(range(len(ids)))
    buf: list[int] = []
    emitted = 0
    while emitted < steps:
        rng.shuffle(order)
        for i in order:
            buf.extend(ids[i])
            while len(buf) >= batch * (seq_len + 1):
                chunk = torch.tensor(buf[: batch * (seq_len + 1)]).view(batch, seq_len + 1)
                del buf[: batch * (seq_len + 1)]
                yield chunk
                emitted += 1
                if emitted == steps:
                    return


def train(model: Qwen3_5ForCausalLM, batches, args: argparse.Namespace) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    losses, t0 = [], time.time()
    for step, chunk in enumerate(batches):
        out = model(input_ids=chunk[:, :-1], labels=chunk[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            recent = sum(losses[-50:]) / len(losses[-50:])
            print(f"step {step:5d}  loss {recent:.3f}  {time.time() - t0:6.0f}s", flush=True)
    return losses


def fitting(functions: list[stdlib_corpus.Function], tok) -> list[stdlib_corpus.Function]:
    """The functions whose header and body fit a prompt (header <= 160 tokens, body <= 256), in corpus order."""
    return [f for f in functions if len(tok(f.header).input_ids) <= 160 and len(tok(f.body).input_ids) <= 256]


def write_prompts(functions: list[stdlib_corpus.Function], tok, path: Path, n: int, seed: int) -> int:
    """A seeded sample of held-out functions that fit (header <= 160 tokens, body <= 256)."""
    rng = random.Random(seed)
    fit = fitting(functions, tok)
    rng.shuffle(fit)
    path.parent.mkdir(parents=True, exist_ok=True)
    chosen = sorted(fit[:n], key=lambda f: f.name)
    with path.open("w") as fh:
        for f in chosen:
            fh.write(json.dumps({"id": f.name, "messages": f.messages()}) + "\n")
    return len(chosen)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    t0 = time.time()
    functions = stdlib_corpus.collect()
    heldout = [f for f in functions if f.heldout]
    if args.prompts_only:
        n = write_prompts(
            heldout, PreTrainedTokenizerFast.from_pretrained(args.out), args.prompts, args.num_prompts, args.seed
        )
        print(f"{n} prompts -> {args.prompts}")
        return
    train_fns = [f for f in functions if not f.heldout]
    texts = [render(f.messages()) for f in train_fns]
    tok = train_tokenizer(texts, args.vocab)
    eos = tok.eos_token_id
    ids = [encode(tok, f) for f in train_fns]
    n_tokens = sum(map(len, ids))
    print(
        f"{len(functions)} functions, {len(train_fns)} for training, {n_tokens} tokens; "
        f"tokenizer {time.time() - t0:.0f}s",
        flush=True,
    )

    config = model_config(tok)
    model = Qwen3_5ForCausalLM._from_config(config, dtype=torch.float32)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    model.train()
    losses = train(model, packed_batches(ids, args.batch, args.seq_len, args.steps, args.seed), args)

    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.do_sample = False
    model.to(torch.bfloat16).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    write_prompts(heldout, tok, args.prompts, args.num_prompts, args.seed)
    provenance = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "args": {k: str(v) for k, v in vars(args).items()},
        "train_tokens_seen": args.steps * args.batch * args.seq_len,
        "corpus_tokens": n_tokens,
        "final_loss_mean_last50": sum(losses[-50:]) / len(losses[-50:]),
        "first_loss": losses[0],
        "wall_s": round(time.time() - t0),
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance, indent=2))


if __name__ == "__main__":
    main()
