"""The GPU at real width, in one process: the bf16 matmul roofline, a published architecture's
capture against the same forward without it, and drafter training at the target's width.

    python -m bench.real_width_bench roofline --device cuda
    python -m bench.real_width_bench capture --arch qwen3.6-27b --device cuda --tokens 32768
    python -m bench.real_width_bench train --arch qwen3.6-27b --device cuda

`roofline`: TFLOP/s of square bf16 matmuls (the best of --sizes), the ceiling MFU is read against;
each part measures its own, so the figures of one run share one GPU and one clock.

`capture`: the target built in memory on --device from pipeline/target/architectures.py (all its
layers unless --layers; random weights drawn on the device as transformers initialises them, no
files written: a 27B target's 54 GB would take minutes to write and read back), loaded with the
kernels extraction chooses (--linear-attention, fla on CUDA), and run through `Target.capture`, the
call stage one makes, over sequences of --lengths (a token budget of --tokens a batch); then the
same forward without capture: the same layers up to the last tap, hooks that keep no state and
copy nothing. Tokens/s of each, the capture's share of the plain forward's rate, and MFU: the
layers' matmul FLOPs (2 x the parameters of every Linear run, per token) plus the full-attention
layers' scores and values (4 x heads x head_dim x mean causal context), over the roofline. The
Gated DeltaNet recurrence is not counted (~0.6% of the FLOPs at 27B width), so MFU is a slight
underestimate.

`train`: a drafter of the default sizes for the target's width (5120: the released Qwen3.6-27B
drafter's layers, 1.73B parameters) with the frozen embedding and lm_head at the full vocabulary,
trained on random tap states through stages/train/step.forward_loss (anchors, blocks, the masks,
the DFlash loss) with the run's optimizer (--optimizer) under bf16 autocast: tokens/s, MFU, peak
GPU memory, for batch sizes doubling from 1 until one does not fit (the largest that fits is
reported). FLOPs: 2 x fc's parameters per context token, 2 x the layers' parameters per block-stream
token (plus their k/v projections per context token), the attention scores over each block's
visible context, 2 x vocab x hidden per label; the backward twice the forward, the lm_head's slices
once more (recomputed).

`--toy` runs each on CPU at the shipped tiny target's sizes: seconds, to check the script works.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from bench import harness

TOY = [["roofline"], ["capture"], ["train"]]
TINY = "pipeline/assets/tiny_target"


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int, warmup: int = 1) -> float:
    """Median seconds of fn() over repeat calls, after warmup calls (kernel autotuning, compiling)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        runs.append(time.perf_counter() - t0)
    return harness.median_of(runs)


def roofline(device, sizes: list[int], repeat: int, dtype: str = "bf16") -> dict:
    """Best TFLOP/s of [n, n] @ [n, n] in dtype over sizes."""
    import torch

    best, kind = {}, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=kind)
        b = torch.randn(n, n, device=device, dtype=kind)
        s = timed(lambda: a @ b, device, repeat, warmup=2)  # noqa: B023 - called before the next n
        best[n] = 2 * n**3 / s / 1e12
    return {"dtype": dtype, "tflops_by_size": best, "tflops": max(best.values())}


def text_config(args):
    """The transformers config of the target to build: the named architecture at --layers, or (toy)
    the shipped tiny target's."""
    from transformers import AutoConfig

    if args.toy:
        return AutoConfig.from_pretrained(TINY)
    from pipeline.target.architectures import ARCHS

    arch = ARCHS[args.arch]
    layers = args.layers or arch.full_layers
    return AutoConfig.for_model(**arch.text_config(layers), dtype="bfloat16")


def build_target(args, device):
    """A Target around a model built in memory on device, its kernels chosen first as loading does."""
    import torch

    from pipeline.target.kernels import KernelRecorder, select_linear_attention
    from pipeline.target.model import Target

    requested = select_linear_attention(device.type, args.linear_attention)
    from transformers import AutoModelForCausalLM

    config = text_config(args)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    synchronize(device)
    built = time.perf_counter() - t0
    tok = SimpleNamespace(pad_token_id=config.pad_token_id or 0, eos_token_id=config.eos_token_id or 0)
    target = Target(model, tok, Path("."), device, torch.bfloat16, KernelRecorder(model), requested, None)
    return target, built


def forward_flops(model, lengths: list[int], last_layer: int) -> float:
    """FLOPs of the decoder's layers 0..last_layer over sequences of `lengths` (module doc)."""
    import torch

    layers = model.get_decoder().layers[: last_layer + 1]
    linear = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    full = sum(1 for t in c.layer_types[: last_layer + 1] if t == "full_attention")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    scores = sum(4 * c.num_attention_heads * head_dim * n * (n + 1) / 2 for n in lengths) * full
    return 2 * linear * sum(lengths) + scores


def capture(args) -> dict:
    import torch
    from transformers import DynamicCache

    from pipeline.target.capture_batches import capture_batches, chunks
    from pipeline.target.taps import StopForward, default_taps, tapping

    device = torch.device(args.device)
    harness.torch_setup(args.threads)
    target, built = build_target(args, device)
    taps = default_taps(target.num_layers)
    lengths = [int(x) for x in args.lengths.split(",")]
    seqs = batch_of(lengths, args.tokens, target.vocab_size)
    n = sum(map(len, seqs))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    captured = timed(lambda: target.capture(seqs, taps, budget=args.capture_tokens), device, args.repeat)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    def plain():  # the same forwards (rows, padding, chunks), nothing kept or copied
        for batch in capture_batches([len(s) for s in seqs], args.capture_tokens):
            ids = torch.zeros((len(batch.rows), batch.width), dtype=torch.long)  # [b, W], right-padded
            for j, i in enumerate(batch.rows):
                ids[j, : len(seqs[i])] = torch.tensor(seqs[i])
            ids = ids.to(device)
            long_row = batch.width > args.capture_tokens
            cache = DynamicCache(config=target.model.config) if long_row else None
            for lo, hi in chunks(batch.width, args.capture_tokens):
                stop = tapping(target.layers, [taps[-1]], lambda k, out: None, stop_after_last=True)
                with torch.inference_mode(), stop:
                    try:
                        target.model.get_decoder()(input_ids=ids[:, lo:hi], cache=cache, use_cache=long_row)
                    except StopForward:  # after the last tap, as capture stops
                        pass

    forward = timed(plain, device, args.repeat)
    flops = forward_flops(target.model, [len(s) for s in seqs], taps[-1])
    peak_tflops = roofline(device, [int(x) for x in args.sizes.split(",")], args.repeat)["tflops"]
    return {
        "arch": "tiny" if args.toy else args.arch,
        "layers": target.num_layers,
        "hidden": target.hidden_size,
        "vocab": target.vocab_size,
        "parameters": sum(p.numel() for p in target.model.parameters()),
        "build_s": built,
        "taps": taps,
        "backends": asdict(target.backends()),
        "sequences": len(seqs),
        "tokens": n,
        "capture_tokens": args.capture_tokens,
        "capture_tokens_per_s": n / captured,
        "forward_tokens_per_s": n / forward,
        "capture_over_forward": forward / captured,
        "flops_per_token": flops / n,
        "roofline_tflops": peak_tflops,
        "capture_mfu": flops / captured / 1e12 / peak_tflops,
        "forward_mfu": flops / forward / 1e12 / peak_tflops,
        "capture_peak_gpu_gib": None if peak is None else peak / 2**30,
    }


def batch_of(lengths: list[int], budget: int, vocab: int) -> list[list[int]]:
    """Random sequences cycling through lengths until the next would pass the token budget."""
    import torch

    g = torch.Generator().manual_seed(0)
    seqs, total = [], 0
    for i in range(10**6):
        n = lengths[i % len(lengths)]
        if seqs and total + n > budget:
            break
        seqs.append(torch.randint(0, vocab, (n,), generator=g).tolist())
        total += n
    return seqs


def drafter_for(args, device):
    import torch

    from pipeline.drafter.config import DrafterConfig, default_sizes
    from pipeline.drafter.model import Drafter

    config = text_config(args)
    width, vocab = config.hidden_size, config.vocab_size
    sizes = default_sizes(width)
    n = sizes["num_hidden_layers"]
    dc = DrafterConfig(
        hidden_size=width,
        vocab_size=vocab,
        block_size=16,
        mask_token_id=vocab - 1,
        target_layer_ids=tuple(range(5)),
        num_target_layers=config.num_hidden_layers,
        layer_types=("sliding_attention",) * (n - 1) + ("full_attention",),
        sliding_window=2048,
        **sizes,
    )
    g = torch.Generator(device=device).manual_seed(0)
    embed = torch.empty(vocab, width, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    head = torch.empty(vocab, width, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    model = Drafter(dc, embed, head).to(device)
    model.init_weights(torch.Generator().manual_seed(0), std=0.02)
    return model.to(device), dc


def train_flops(model, dc, batch: int, context: int, anchors: int) -> float:
    """One training step's FLOPs (module doc)."""
    fc = model.fc.weight.numel()
    layer = sum(p.numel() for p in model.layers.parameters() if p.ndim == 2)
    kv = sum(m.weight.numel() for n, m in model.layers.named_modules() if n.endswith(("k_proj", "v_proj")))
    stream = anchors * dc.block_size
    scores = 4 * dc.num_attention_heads * dc.head_dim * stream * min(context, dc.sliding_window or context)
    forward = (
        2 * fc * context + 2 * layer * stream + 2 * kv * context + scores + 2 * dc.vocab_size * dc.hidden_size * stream
    )
    return batch * (3 * forward + 2 * dc.vocab_size * dc.hidden_size * stream)


def train(args) -> dict:
    import torch

    from stages.train.config import LossConfig, OptimConfig
    from stages.train.optim import build_optimizers
    from stages.train.step import LossPlan

    device = torch.device(args.device)
    harness.torch_setup(args.threads)
    model, dc = drafter_for(args, device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    optimizers = build_optimizers(OptimConfig(optimizer=args.optimizer), model)
    context, anchors = (256, 16) if args.toy else (args.context, args.anchors)
    plan = LossPlan.of(LossConfig(anchors=anchors), dc, flex=device.type == "cuda")
    dtype = "bf16" if device.type == "cuda" else "fp32"  # what the step's matmuls run in (autocast on CUDA)
    peak_tflops = roofline(device, [int(x) for x in args.sizes.split(",")], args.repeat, dtype)["tflops"]
    rows, batch = [], 1
    while batch <= args.max_batch:
        row = train_batch(model, optimizers, plan, dc, device, batch, context, args.repeat)
        if row is None:
            break
        flops = train_flops(model, dc, batch, context, anchors)
        row.update(mfu=flops / row["step_s"] / 1e12 / peak_tflops, flops_per_step=flops)
        rows.append(row)
        batch *= 2
    return {
        "width": dc.hidden_size,
        "vocab": dc.vocab_size,
        "trainable_parameters": params,
        "optimizer": args.optimizer,
        "context": context,
        "anchors": anchors,
        "roofline_tflops": peak_tflops,
        "batches": rows,
        "largest_batch_that_fits": rows[-1]["batch"] if rows else 0,
    }


def train_batch(model, optimizers, plan, dc, device, batch: int, context: int, repeat: int) -> dict | None:
    """Steps at one batch size: seconds a step, tokens/s, peak memory; None when it does not fit."""
    import torch

    from stages.train.step import forward_loss, step_generator

    g = torch.Generator(device=device).manual_seed(batch)
    mask = torch.zeros(batch, context, dtype=torch.bool, device=device)
    mask[:, context // 8 :] = True
    data = SimpleNamespace(
        tokens=torch.randint(0, dc.vocab_size - 1, (batch, context), device=device, generator=g),
        loss_mask=mask,
        hidden=torch.randn(batch, context, 5, dc.hidden_size, device=device, generator=g).to(torch.bfloat16),
        starts=torch.zeros(batch, context, dtype=torch.long, device=device),
    )
    step = [0]

    def one():
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = forward_loss(model, model, data, plan, step_generator(0, step[0], 0, 0, device))
        out.loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        step[0] += 1

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        s = timed(one, device, repeat)
    except torch.OutOfMemoryError:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"batch": batch, "step_s": s, "tokens_per_s": batch * context / s, "peak_gpu_gib": peak}


def main() -> None:
    p = harness.parser(__doc__)
    subs = p.add_subparsers(dest="cmd", required=True)
    for name, help in (
        ("roofline", "bf16 matmul TFLOP/s"),
        ("capture", "a published architecture's capture against the same forward without it"),
        ("train", "drafter training at the target's width"),
    ):
        s = harness.subcommand(subs, name, help)
        s.add_argument("--device", default="cpu", help="cuda on the GPU machine (cpu: --toy)")
        s.add_argument("--repeat", type=int, default=3, help="timed calls of each measurement (their median)")
        s.add_argument("--sizes", default="4096,8192", help="roofline matmul sizes n ([n, n] @ [n, n])")
        s.add_argument("--arch", default="qwen3.6-27b", help="a name of pipeline/target/architectures.py")
        s.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all)")
        s.add_argument("--linear-attention", default="auto", help="auto (fla on CUDA), fla or torch")
        s.add_argument("--lengths", default="2048,4096,1024,8192", help="capture sequence lengths, cycled")
        s.add_argument("--tokens", type=int, default=32768, help="tokens captured in all: sequences of the run")
        s.add_argument(
            "--capture-tokens", type=int, default=16384, help="positions a capture forward holds (extract's flag)"
        )
        s.add_argument("--optimizer", default="muon", help="the drafter's optimizer: muon or adamw")
        s.add_argument("--context", type=int, default=4096, help="training sample length")
        s.add_argument("--anchors", type=int, default=512, help="blocks a training sample")
        s.add_argument("--max-batch", type=int, default=8, help="largest batch size tried")
    args = harness.parse(p)
    if args.toy:
        args.sizes, args.lengths, args.tokens, args.repeat, args.max_batch = "256", "64,32", 256, 1, 2
        args.capture_tokens = 48  # rows batched, and the 64-token rows chunked through the cache
    fn = {"roofline": roofline_only, "capture": capture, "train": train}[args.cmd]
    harness.emit(fn(args), args)


def roofline_only(args) -> dict:
    import torch

    harness.torch_setup(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, **roofline(device, [int(x) for x in args.sizes.split(",")], args.repeat)}


if __name__ == "__main__":
    main()
