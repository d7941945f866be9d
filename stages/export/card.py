"""The model card (README.md) of an exported drafter: a pure function from a `CardRecord` to markdown.

Everything the card states comes from the record: the drafter's config, our training record, the
target as the store recorded it, and a replay report's numbers; nothing is looked up here.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.drafter.config import DrafterConfig, TrainingRecord
from store.format.schema import TargetRecord

TRAIN_KEYS = (
    ("optimizer", "optimizer"),
    ("lr", "learning rate"),
    ("muon_lr", "Muon learning rate"),
    ("schedule", "schedule"),
    ("batching", "batching"),
    ("batch_size", "batch size (per process)"),
    ("grad_accum", "gradient accumulation"),
    ("anchors", "anchors per sequence"),
    ("anchor_budget", "anchor budget per micro-batch"),
    ("gamma", "loss decay gamma"),
    ("slot_weights", "slot weights"),
    ("dpace_alpha", "D-PACE alpha"),
    ("acceptance_weight", "expected-acceptance weight"),
    ("max_length", "max tokens per sample"),
    ("max_steps", "max steps"),
    ("warmup_ratio", "warmup ratio"),
    ("weight_decay", "weight decay"),
    ("noise_std", "noise std"),
    ("mixed_precision", "mixed precision"),
    ("seed", "seed"),
)
HUB_CACHE = re.compile(r"models--([^/]+)--([^/]+)/snapshots/")  # a hub id resolved into the local cache


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One checkpoint's row of an evaluate.py report."""

    report: str
    name: str
    tau: float
    tau_ci95: tuple[float, float] | None = None
    tau_pooled: float | None = None
    ddtree: dict | None = None  # budget (text) -> tau
    ddtree_ci95: dict | None = None  # budget (text) -> [low, high] or None
    prompts: int | None = None
    available: int | None = None
    shards: str | None = None
    dtype: str | None = None
    store_fingerprint: str | None = None
    warnings: tuple[str, ...] = ()  # the report's own
    served: dict | None = None  # evaluate.py --served: the report's "served" entry


@dataclass(frozen=True, kw_only=True)
class CardRecord:
    out: str  # how the usage commands name the exported directory
    drafter: DrafterConfig
    training: TrainingRecord | None
    target: TargetRecord | None  # None: the target checks were skipped
    target_layers: int | None  # the target's decoder layers (the store's, else the drafter config's)
    skipped: str | None  # why the target checks were skipped, or None
    measured: Measured | None
    evaluate: str  # the command that would measure tau
    caveats: tuple[str, ...]  # every serving warning, then our own notes


def hub_id(path: str) -> str | None:
    """The hub id of a target loaded from the hub cache ("org/name"), else None."""
    m = HUB_CACHE.search(path)
    return f"{m.group(1)}/{m.group(2)}" if m else None


def base_model(target: TargetRecord | None) -> str | None:
    """The target's name: its hub id when it was loaded from the hub cache, else its directory's name."""
    if target is None:
        return None
    return hub_id(target.path) or Path(target.path).name or None


def served_as(target: TargetRecord | None) -> str:
    """How the usage commands name the target: its hub id, else its path, else a placeholder."""
    return "TARGET" if target is None else hub_id(target.path) or target.path


def render(c: CardRecord) -> str:
    d, name = c.drafter, base_model(c.target)
    front = ["---", "library_name: transformers", "tags:", "- dflash", "- speculative-decoding"]
    if name:
        front.append(f"base_model: {json.dumps(name)}")
    out = front + ["---", "", f"# DFlash drafter for {name or 'its target model'}", ""]
    out += [
        f"A DFlash block drafter for speculative decoding with `{name or 'the target'}`, trained with "
        "dflash-pipeline from the target's stored hidden states. Given the target's "
        f"hidden states at {len(d.target_layer_ids)} tap layers, it drafts {d.block_size - 1} tokens at once "
        "(one block: the last accepted token plus mask slots), which the target then verifies in one pass. "
        "It has no embedding or output head of its own: it uses the target's.",
        "",
    ]
    return "\n".join(out + _target(c) + _drafter(d) + _training(c) + _tau(c) + _usage(c) + _caveats(c)) + "\n"


def _rows(pairs) -> list[str]:
    return ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in pairs] + [""]


def _target(c: CardRecord) -> list[str]:
    taps = ", ".join(map(str, c.drafter.target_layer_ids))
    tap_row = ("taps (`target_layer_ids`)", f"{taps}: the outputs of layer k, `hidden_states[k+1]` in Transformers")
    layers = ("decoder layers", c.target_layers if c.target_layers is not None else "not recorded")
    if c.target is None:
        return ["## Target", "", f"Not checked: {c.skipped}.", ""] + _rows([layers, tap_row])
    t = c.target
    rows = [
        ("path", f"`{t.path}`"),
        ("model_type", f"`{t.model_type}`"),
        ("class", f"`{t.model_class}`"),
        ("fingerprint", f"`{t.fingerprint}`"),
        layers,
        tap_row,
    ]
    if t.max_position_embeddings:
        rows.append(("context length", t.max_position_embeddings))
    return ["## Target", ""] + _rows(rows)


def _drafter(d: DrafterConfig) -> list[str]:
    kinds = ", ".join(f"{n} x {k}" for k, n in Counter(d.layer_types).items())  # in first-seen order
    rows = [
        ("layers", d.num_hidden_layers),
        ("hidden size", d.hidden_size),
        ("MLP width", d.intermediate_size),
        ("heads / KV heads / head_dim", f"{d.num_attention_heads} / {d.num_key_value_heads} / {d.head_dim}"),
        ("block size", f"{d.block_size} (the anchor token + {d.block_size - 1} drafts)"),
        ("mask token id", d.mask_token_id),
        ("layer types", f"{kinds} (`{', '.join(d.layer_types)}`)"),
        ("sliding window", d.sliding_window if d.sliding_window else "none"),
        ("vocabulary", d.vocab_size),
        ("RoPE", f"`{json.dumps(d.rope_parameters)}`"),
    ]
    if d.is_causal is not None:
        rows.append(("is_causal", str(d.is_causal).lower()))
    if d.input_embedding_scale != 1.0:
        rows.append(("input_embedding_scale", d.input_embedding_scale))
    return ["## Drafter", ""] + _rows(rows)


def _training(c: CardRecord) -> list[str]:
    r = c.training
    if r is None:
        return ["## Training", "", "Not recorded: this checkpoint carries no dflash-pipeline training record.", ""]
    rows = [
        ("store fingerprint", f"`{r.store_fingerprint}`"),
        ("train shards", r.train_shards),
        ("held-out shards", r.eval_shards or "none"),
        ("steps", r.step),
        ("epochs", epochs_made(r)),
    ]
    cfg = r.train_config or {}
    rows += [(label, cfg[k]) for k, label in TRAIN_KEYS if cfg.get(k) is not None]
    return ["## Training", ""] + _rows(rows)


def epochs_made(r: TrainingRecord) -> str:
    """The epochs the run made by this checkpoint's step, as the record gives them; for an older record
    without them, "not recorded" and the flags the run had (a step-N, or --max-steps, which overrides
    --epochs, makes them no count of epochs made)."""
    if r.epochs is not None:
        return f"{r.epochs:g}"
    cfg = r.train_config or {}
    flags = ", ".join(f"--{k.replace('_', '-')} {cfg[k]}" for k in ("epochs", "max_steps") if cfg.get(k) is not None)
    return "not recorded" + (f" (run with {flags})" if flags else "")


def _tau(c: CardRecord) -> list[str]:
    out = ["## Replay tau", ""]
    m = c.measured
    if m is None:
        return out + [
            "Not measured: run",
            "",
            f"    {c.evaluate}",
            "",
            "and export again with `--report` pointing at its report directory.",
            "",
        ]
    where = [
        f"shards {m.shards}" if m.shards else None,
        f"{m.prompts} of {m.available} prompts"
        if m.prompts is not None and m.available is not None
        else (f"{m.prompts} prompts" if m.prompts is not None else None),
        f"drafter in {m.dtype}" if m.dtype else None,
        f"store `{m.store_fingerprint[:16]}`" if m.store_fingerprint else None,
    ]
    out += [
        f"From `{m.report}` (checkpoint `{m.name}`): greedy speculative decoding replayed from the stored "
        "target states and greedy completions"
        + (f" ({'; '.join(w for w in where if w)})" if any(where) else "")
        + ". tau = mean over prompts of tokens per round (accepted drafts + 1, the bonus token counted); "
        "DDTree-N drafts a tree of N nodes from the same drafter.",
        "",
    ]
    rows = [("chain", m.tau, m.tau_ci95)]
    rows += [(f"DDTree-{b}", t, (m.ddtree_ci95 or {}).get(b)) for b, t in (m.ddtree or {}).items()]
    out += ["| policy | tau | 95% interval |", "| --- | --- | --- |"]
    out += [f"| {p} | {t:.3f} | {f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '-'} |" for p, t, ci in rows]
    if m.tau_pooled is not None:
        out += ["", f"Pooled chain tau (all tokens / all rounds): {m.tau_pooled:.3f}."]
    if m.served:
        sv = m.served
        out += [
            "",
            f"Chain drafting served by {sv['engine']} over the same prompts (served tau in replay's "
            "convention, docs/evaluation.md):",
            "",
            "| prompts | n | served tau | replay tau |",
            "| --- | --- | --- | --- |",
        ]
        out += [
            f"| {label} | {n} | {x['served_tau']:.3f} | {x['replay_tau']:.3f} |"
            for label, n, x in (
                ("served completion = stored", f"{sv['identical_completions']} of {sv['prompts']}", sv["agreeing"]),
                ("all", sv["prompts"], sv["all"]),
            )
        ]
    if m.warnings:
        out += ["", "The report warned:", ""] + [f"- {w}" for w in m.warnings]
    return out + [""]


def _usage(c: CardRecord) -> list[str]:
    d, target = c.drafter, served_as(c.target)
    spec = json.dumps({"method": d.head, "model": c.out, "num_speculative_tokens": d.block_size - 1})
    mixed = len(set(d.layer_types)) > 1
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixed or d.head == "dspark" else ""
    out = [
        "## Usage",
        "",
        "The drafter runs beside its target: it reads the target's hidden states at the tap "
        "layers above, so it serves only with that target.",
        "",
        "### vLLM",
        "",
        f"    {env}vllm serve {shlex.quote(target)} --speculative-config '{spec}'",
        "",
    ]
    if mixed:
        out += [
            "vLLM serves a drafter that mixes sliding and full attention layers only with its V2 model runner "
            "(`VLLM_USE_V2_MODEL_RUNNER=1`).",
            "",
        ]
    if d.head == "dspark":
        out += [
            "vLLM drafts with the DSpark head (Qwen3DSparkModel: the Markov transition head, slot after slot) "
            "only in its V2 model runner (`VLLM_USE_V2_MODEL_RUNNER=1`).",
            "",
        ]
    out += [
        "### SGLang",
        "",
        f"    python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(c.out)} --speculative-num-draft-tokens {d.block_size}",
        "",
        "### Transformers",
        "",
        "`modeling_dflash.py` ships in this directory and `config.json`'s `auto_map` points at it, so "
        "`trust_remote_code=True` builds the drafter with its tap projection. `spec_generate` decodes "
        "greedily (temperature 0), one sequence at a time, and returns the target's own greedy output:",
        "",
        "```python",
        "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
        "",
        f'target = AutoModelForCausalLM.from_pretrained({json.dumps(target)}, dtype="auto")',
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(target)})",
        f'draft = AutoModel.from_pretrained({json.dumps(c.out)}, trust_remote_code=True, dtype="auto")',
        'input_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], '
        'add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]',
        "out = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256,",
        "                          stop_token_ids=[tokenizer.eos_token_id])",
        "```",
        "",
    ]
    return out


def _caveats(c: CardRecord) -> list[str]:
    out = ["## Serving caveats", ""]
    if not c.caveats:
        return out + [
            "None known: vLLM, SGLang, SpecForge and the reference DFlash code, as dflash-pipeline reads "
            "them, compute this drafter's training-time attention, and vLLM can cache its layers beside the "
            "target's.",
            "",
        ]
    return out + [f"- {w}" for w in c.caveats] + [""]
