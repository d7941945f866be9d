"""The tiny target for tests: chat-template prompt ids, Hugging Face's own hidden states, equality
up to bf16 rounding, and checkpoints built from it (a multimodal release, damaged copies)."""

import json
import shutil
from pathlib import Path

import torch

from pipeline import DEFAULT_PROMPTS, TINY_TARGET


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
    return bool(((got.float() - ref16).abs() <= ref16.abs() * 2**-7 + 1e-6).all())


def multimodal_checkpoint(directory: Path, mtp_tensors: int = 1) -> Path:
    """The shipped target as a Qwen3.5/3.6-style release: `Qwen3_5ForConditionalGeneration` with the
    text weights under `model.language_model.*`, a one-block vision tower under `model.visual.*` and
    `mtp.*` tensors, written to directory."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    text = AutoConfig.from_pretrained(TINY_TARGET)
    vision = Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=text.hidden_size,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict()))
    state = model.state_dict()
    for name, w in load_file(TINY_TARGET / "model.safetensors").items():
        state[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = w
    for i in range(mtp_tensors):
        state[f"mtp.layers.{i}.weight"] = torch.zeros(4, 4)
    return written(directory, model.config, state)


def damaged_checkpoint(directory: Path, edit) -> Path:
    """A copy of the shipped target whose tensors `edit` (a function of the state dict) changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY_TARGET, directory)
    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def two_way_target(directory: Path) -> Path:
    """The shipped target with its one Gated DeltaNet key head written as two equal ones, so that
    vLLM can split every head over two ranks (tensor parallel 2), written to directory. The same
    function: the shipped target's two value heads both read its one key head, here each reads its
    own copy of it (the query and key rows of in_proj_qkv and their convolution channels repeated);
    every other tensor is the shipped one. bf16, as shipped."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(TINY_TARGET)
    width = config.linear_num_key_heads * config.linear_key_head_dim  # the query's rows, and the key's
    state = load_file(TINY_TARGET / "model.safetensors")
    for name, w in state.items():
        if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
            q, k, v = w.split([width, width, w.shape[0] - 2 * width])  # rows: [query, key, value]
            state[name] = torch.cat([q, q, k, k, v])
    config.linear_num_key_heads *= 2
    return written(directory, config, state)


def fp8_block_target(directory: Path) -> Path:
    """A tiny target whose every quantizable linear layer vLLM's CPU FP8 block kernel takes: the
    shipped one with 16 Gated DeltaNet value heads instead of 2, so that in_proj_ba has 32 outputs
    (the shipped one's 4 fail the kernel: it packs outputs in multiples of 32). The shipped weights
    where the shapes stay (embedding, attention, MLPs, norms, lm_head), the Gated DeltaNet layers'
    others drawn as transformers initialises them, seed 0; bf16. Written to directory."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TINY_TARGET)
    config.linear_num_value_heads = 16
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = model.state_dict()
    shipped = load_file(TINY_TARGET / "model.safetensors")
    state.update({k: w for k, w in shipped.items() if k in state and state[k].shape == w.shape})
    return written(directory, config, state)


def written(directory: Path, config, state: dict) -> Path:
    """A target directory: `config`, the weights `state` (one safetensors file) and the shipped tiny
    target's tokenizer, template and generation config."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY_TARGET / name, directory / name)
    return directory
