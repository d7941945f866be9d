"""The memory model: the peak bytes of each stage's largest process, as a sum of named parts, from the
run's tokens, widths, vocabulary and taps. Arithmetic over what the code holds at its peak (the
references are the functions each part names); `pytest -m real_width` measures each stage at
width 5,120 and vocabulary 248,320 and checks the sum within 15% (tests/tools/test_make_target.py;
bench/results/real_width_memory_cpu.json).

On a GPU the parts are what torch.cuda.max_memory_allocated counts; on CPU the process's peak RSS,
which adds the interpreter with torch and transformers imported (RUNTIME, measured on this project's
machine: 0.26 GiB) and holds training's frozen embedding and lm_head in fp32
(stages/train/setup.frozen_tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.drafter.loss import GPU_LOGITS_BYTES, LOGITS_BYTES
from store.io.zarr_files import ROUND_BYTES

RUNTIME = int(0.26 * 2**30)  # CPU only: `import torch, transformers` and the stage's modules, peak RSS
BF16, FP32 = 2, 4
AGREEMENT_CHUNK = 1024  # positions a logits chunk in Target._agreement (pipeline/target/model.py)
LOSS_PEAK = 3 / 2  # a chunk's fp32 logits and its bf16 copy, per fp32 logits byte (pipeline/drafter/loss.py)
POLICIES = 5  # drafts a prompt and round in evaluation's replay (chain and the DDTree budgets)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The widths the model reads: the target's hidden, MLP and vocabulary; the drafter's."""

    hidden: int
    intermediate: int
    vocab: int
    taps: int
    drafter_layers: int
    drafter_q: int  # query width of a drafter layer: heads x head dim
    drafter_kv: int  # key/value width of a drafter layer: kv heads x head dim
    drafter_intermediate: int
    drafter_parameters: int  # trainable: fc, the layers, the norms (and a dspark head's)
    markov_rank: int = 0  # a dspark head's r (its two [vocab, r] matrices); 0: none


def total(parts: dict[str, int]) -> int:
    return sum(parts.values())


def capture(shape: Shape, weights: int, tokens: int, *, cpu: bool) -> dict[str, int]:
    """Extraction's capture forward over `tokens` tokens (pipeline/target/model.Target.capture): the
    weights; the taps, each copied to host memory as its layer returns it: on a GPU one tap's rounded
    copy [tokens, H] bf16 in flight, on CPU (where host memory is the process's) the host buffers, a
    [tokens, H] bf16 a tap, and their stack (two copies of [tokens, taps, H]); one layer's temporaries
    (the MLP's gate, up and their product, [tokens, I] each, and four [tokens, H]: residual, norm,
    mixer output, sum); one agreement chunk of logits ([1024, V] bf16)."""
    taps = 2 * shape.taps if cpu else 1
    parts = {
        "target weights": weights,
        "taps" if cpu else "tap in flight": taps * tokens * shape.hidden * BF16,
        "one layer's temporaries": tokens * (3 * shape.intermediate + 4 * shape.hidden) * BF16,
        "agreement logits": min(tokens, AGREEMENT_CHUNK) * shape.vocab * BF16,
    }
    return {**parts, "runtime": RUNTIME} if cpu else parts


def capture_tokens(shape: Shape, weights: int, memory: int) -> int:
    """The most tokens a capture forward holds beside the weights in `memory` bytes (0: none fit)."""
    fixed = total(capture(shape, weights, 0, cpu=False)) + AGREEMENT_CHUNK * shape.vocab * BF16
    per_token = total(capture(shape, 0, 1, cpu=False)) - shape.vocab * BF16
    return max(0, (memory - fixed) // per_token)


def optimizer_bytes(optimizer: str, processes: int) -> float:
    """Bytes a trainable parameter on one process: fp32 weights and gradients, plus AdamW's two moments
    or Muon's momentum, which only each matrix's owner keeps (stages/train/optim.Muon): 1/processes."""
    return FP32 * (2 + (2 if optimizer == "adamw" else 1 / processes))


def step_temporaries(optimizer: str, *, cpu: bool) -> int:
    """Bytes a trainable parameter the optimizer's step allocates on top of its states: AdamW's foreach
    update makes two fp32 lists the size of the parameters (the bias-corrected second moment's root,
    the step); Muon every matrix's orthogonalised update at once (the owners' broadcast buffers), in
    its Newton-Schulz dtype: bf16 on a GPU, fp32 on CPU (stages/train/optim.build_optimizers)."""
    return 2 * FP32 if optimizer == "adamw" else FP32 if cpu else BF16


def training(
    shape: Shape,
    optimizer: str,
    context: int,
    anchors: int,
    block: int,
    *,
    cpu: bool,
    processes: int = 1,
    final_state: bool = False,
    markov_optimizer: str = "muon",
) -> dict[str, int]:
    """A training step on one sample of `context` tokens: the trainable states; the frozen embedding and
    lm_head (bf16 on a GPU, fp32 on CPU); the sample's states [context, taps, H] bf16 and fc's output
    [context, H] fp32; the block stream kept for the backward (anchors x block rows a layer: six of
    width H (input, norms, attention output, residuals), q, k, v, the MLP's gate, up and product; bf16
    under autocast on a GPU, fp32 on CPU) and the context K/V a layer; one loss chunk; the optimizer
    step's temporaries; Muon's momentum split over `processes`; a dspark head's two [V, r] Markov matrices under
    `markov_optimizer` when `optimizer` is muon (train.py --markov-optimizer). final_state: the sample's final states
    [context, H] bf16 too (--soft-targets); their loss chunks (a quarter of the CE chunk's rows, about four
    [rows, V] fp32: pipeline/drafter/soft_targets.py) run one at a time, never beside the CE chunk, so the
    loss chunk's peak stays the CE's."""
    rows = anchors * block
    frozen = act = FP32 if cpu else BF16  # a GPU trains under bf16 autocast; CPU in fp32
    per_row = 6 * shape.hidden + shape.drafter_q + 2 * shape.drafter_kv + 3 * shape.drafter_intermediate
    layer = (rows * per_row + context * 2 * shape.drafter_kv) * act
    markov = 2 * shape.vocab * shape.markov_rank if optimizer == "muon" else 0  # the matrices markov_optimizer steps
    owners = {optimizer: shape.drafter_parameters - markov}
    owners[markov_optimizer] = owners.get(markov_optimizer, 0) + markov
    parts = {
        "trainable states": int(sum(n * optimizer_bytes(o, processes) for o, n in owners.items())),
        "optimizer step": sum(n * step_temporaries(o, cpu=cpu) for o, n in owners.items()),
        "frozen embed + lm_head": 2 * shape.vocab * shape.hidden * frozen,
        "sample states + fc": context * ((shape.taps + final_state) * BF16 + FP32) * shape.hidden,
        "activations": shape.drafter_layers * layer,
        "loss chunk": int(LOSS_PEAK * (LOGITS_BYTES if cpu else GPU_LOGITS_BYTES)),  # stages/train/step.loss_chunk_rows
    }
    return {**parts, "runtime": RUNTIME} if cpu else parts


def replay(shape: Shape, prompts: int, context: int, block: int, *, cpu: bool) -> dict[str, int]:
    """Evaluation's replay (stages/evaluate, bf16): the drafter; the frozen embedding and lm_head as
    stored; the context K/V of `prompts` prompts a layer; a round's logits, one block a prompt and
    policy ([prompts x 5 x block, V] fp32). On CPU the host's peak may instead be the frozen tensors'
    read from the store (store/io/zarr_files.read_whole): both [V, H] arrays, and one batch of chunks
    of up to ROUND_BYTES fetched, held as zarr buffers and decoded (three copies); the larger of the two."""
    frozen = 2 * shape.vocab * shape.hidden * BF16
    parts = {
        "drafter bf16": shape.drafter_parameters * BF16,
        "frozen embed + lm_head": frozen,
        "context K/V": prompts * context * shape.drafter_layers * 2 * shape.drafter_kv * BF16,
        "round logits": prompts * POLICIES * block * shape.vocab * FP32,
    }
    if not cpu:
        return parts
    reading = {"frozen embed + lm_head": frozen, "a read batch x3": 3 * min(ROUND_BYTES, frozen)}
    return {**max(parts, reading, key=total), "runtime": RUNTIME}
