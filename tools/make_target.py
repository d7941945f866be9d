"""Build a target model directory from a published architecture, with deterministic random weights.

    python tools/make_target.py --arch qwen3.6-27b --layers 4 --out /tmp/q36-4l
    pipeline extract --target /tmp/q36-4l --taps 0,1,2,3 ...      # the command it prints

What it writes into --out: the text-only causal LM (`Qwen3_5ForCausalLM`, or the MoE's
`Qwen3_5MoeForCausalLM`) as transformers saves it (`config.json`, `generation_config.json`, bf16
weights in safetensors shards `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`,
tensor names as a release has them: transformers' own save-time renaming, `revert_weight_conversion`,
applied to the model's names, so the MoE's experts are saved one tensor each), a tokenizer, and
`provenance.json`. `pipeline/target/loading.py` loads it unchanged; extraction, train.py and
evaluate.py run on it at the architecture's real width, and no real weights exist anywhere.

- **Architectures**: pipeline/target/architectures.py, each published text config with where its numbers come
  from. `--layers N` keeps the first N layers of the published pattern (three Gated DeltaNet layers,
  then one full-attention layer), the embedding and lm_head at full vocabulary and width. The MoE
  (qwen3.5-35b-a3b, `Qwen3_5MoeForCausalLM`) loads in transformers 5.25 and through
  pipeline/target/loading.py unchanged, and `pipeline extract` runs on it (checked on a narrow copy).
- **Weights**: each tensor is drawn from its own generator seeded by sha256(seed, tensor name), so a
  tensor does not depend on which others are built or in what order (a reduced-depth build holds
  exactly the full build's first N layers, embedding and lm_head). Initialised as transformers'
  `_init_weights` does for the family: matrices, convolutions, embeddings, routers and experts
  normal(0, initializer_range); the RMSNorms zeros (Qwen3.5's norm is x * (1 + w)), the gated norm
  of the Gated DeltaNet output ones (it is x * w); dt_bias ones; A_log = log(U(0.01, 16)) (drawn in
  fp32). Everything is stored in bf16.
- **Device**: `--device cpu|cuda` (default cuda when there is one). Every tensor is created on that
  device, never on the host and copied; a shard at a time is held (about `--max-shard-gb`), then
  written. The same arguments give the same bytes on the same device kind and torch release
  (tests/tools/test_make_target.py checks it bit for bit on CPU); CPU and CUDA draw different numbers
  (different generators), so the device is recorded. Before anything is allocated the build refuses,
  in one line, a model whose weights the device (for cpu: the host's available memory) or the disk
  under --out cannot hold, naming what it needs and what is free: the target has to run there.
- **Taps**: the drafter conditions on the outputs of `default_taps(L)` (pipeline/target/taps.py; 64
  layers: 1, 16, 31, 46, 61). A tap k sits at depth (k + 1) / L, the share of the decoder's layers its
  state has passed through; at N layers each tap moves to the layer whose output is nearest that depth,
  (k + 1) * N / L rounded half up, less 1, kept within 0..N-1, and two taps that would share a layer
  are moved apart by one, keeping their order: the reduced model keeps the full model's five taps, the
  width of the store and of the drafter's `fc` (5 layers: 0-4; 8: 0, 1, 3, 5, 7; 16: 0, 3, 7, 11, 15).
  Below five layers every layer is a tap (4 layers: 0, 1, 2, 3).
  `provenance.json` records them as the `--taps` value to give `pipeline extract` (printed at the end),
  with the architecture, full depth, layers kept, seed, device and the torch and transformers versions.
- **Tokenizer**: the real Qwen tokenizer cannot be downloaded, and random weights emit any of the
  vocab_size ids, so every id must decode. The shipped tiny target's byte-level BPE
  (pipeline/assets/tiny_target/: 4,096 tokens, its chat template with generation markers, `<|im_end|>`
  the eos, `<|endoftext|>` the pad, `<|mask|>` the drafter's mask token) is extended to vocab_size
  with generated tokens `Ġtok<id>` (each decodes to " tok<id>"). They are vocabulary entries without
  merges, so no text ever encodes to them: prompts tokenize exactly as with the tiny target, and
  the config's token ids are the tokenizer's (not the release's 248044 and so on).
- Written to `<out>.partial` and renamed to --out when complete, so a killed build leaves no
  directory that looks like a target (a later build of the same --out removes the leftover).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import TINY_TARGET
from pipeline.target.architectures import ARCHS, Arch
from pipeline.target.taps import default_taps
from store.io.file_modes import as_umask

GB = 10**9
RECORD = "provenance.json"
INDEX = "model.safetensors.index.json"
GENERATED = "Ġtok{}"  # byte-level text of a generated token: " tok<id>"


class Refused(ValueError):
    """A build that cannot go ahead, said in one line (a user's mistake or too little room)."""


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor to draw: its saved name, shape and init rule."""

    name: str
    shape: tuple[int, ...]
    rule: str  # normal | zeros | ones | a_log

    @property
    def nbytes(self) -> int:
        n = 2  # bf16
        for d in self.shape:
            n *= d
        return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arch", required=True, choices=sorted(ARCHS), help="published architecture (pipeline/target/architectures.py)"
    )
    p.add_argument("--layers", type=int, metavar="N", help="decoder layers to keep (default: the full depth)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="target directory to create (must not exist)")
    p.add_argument(
        "--seed", type=int, default=0, help="weights seed; each tensor's generator is seeded by (seed, name)"
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="where the tensors are created (default: cuda if available, else cpu)"
    )
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard in GB (1e9 bytes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        record = build(
            ARCHS[args.arch],
            args.out,
            layers=args.layers,
            seed=args.seed,
            device=args.device,
            max_shard_gb=args.max_shard_gb,
        )
    except Refused as e:
        sys.exit(f"error: {e}")
    print(f"extract with: {record['extract']}")


def build(
    arch: Arch,
    out: Path,
    *,
    layers: int | None = None,
    seed: int = 0,
    device: str | None = None,
    max_shard_gb: float = 5.0,
    log=print,
) -> dict:
    """Write the target directory `out` for `arch` at `layers` decoder layers; return its record."""
    out = Path(out)
    layers = check_request(arch, out, layers, seed, max_shard_gb)
    t0 = time.time()
    dev = pick_device(device)
    if dev.type == "cpu":
        sys.modules.setdefault("fla", None)  # nothing runs here; keep fla's import off a CPU machine
    config = hf_config(arch, layers)
    tensors, model_class = checkpoint_tensors(config)
    config.architectures = [model_class]
    need = sum(t.nbytes for t in tensors)
    check_room(arch, layers, dev, need, out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a killed build's leftover
    partial.mkdir(parents=True)
    shards = write_weights(partial, tensors, seed, dev, config.initializer_range, int(max_shard_gb * GB), log)
    write_config(partial, config)
    write_tokenizer(partial, config.vocab_size, config.max_position_embeddings)
    record = provenance(arch, layers, seed, dev, out)
    (partial / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    partial.rename(out)
    log(
        f"built {arch.name} at {layers} of {arch.full_layers} layers (hidden {config.hidden_size}, vocabulary "
        f"{config.vocab_size:,}; {need / 2 / 1e9:.2f}B parameters, {need / GB:.2f} GB in "
        f"{shards} shard(s)) on {dev.type} in {time.time() - t0:.0f} s -> {out}"
    )
    log(f"taps: {record['taps']} (the full model's {record['full_taps']} at the same relative depths)")
    return record


def check_request(arch: Arch, out: Path, layers: int | None, seed: int, max_shard_gb: float) -> int:
    """The user's choices checked before torch loads; the number of layers to build."""
    layers = arch.full_layers if layers is None else layers
    if not 1 <= layers <= arch.full_layers:
        raise Refused(f"--layers {layers}: {arch.name} has {arch.full_layers} layers; choose 1-{arch.full_layers}")
    if seed < 0:
        raise Refused(f"--seed {seed}: must be 0 or more")
    if not max_shard_gb > 0:
        raise Refused(f"--max-shard-gb {max_shard_gb}: must be above 0")
    if out.exists():
        raise Refused(f"--out {out}: already exists; remove it or name another directory")
    base = len(base_tokenizer()["model"]["vocab"])
    if arch.config["vocab_size"] < base:
        raise Refused(
            f"{arch.name}: vocab_size {arch.config['vocab_size']} is below the tiny tokenizer's {base} tokens"
        )
    return layers


def pick_device(name: str | None):
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise Refused("--device cuda: this machine has no CUDA device (use --device cpu)")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def base_tokenizer() -> dict:
    """The shipped tiny target's tokenizer.json, parsed."""
    return json.loads((TINY_TARGET / "tokenizer.json").read_text())


def token_ids() -> dict[str, int]:
    """The tiny tokenizer's special tokens by content."""
    return {t["content"]: t["id"] for t in base_tokenizer()["added_tokens"]}


def hf_config(arch: Arch, layers: int):
    """The transformers config at `layers` layers, with the tokenizer's eos and pad."""
    from transformers import AutoConfig

    ids = token_ids()
    return AutoConfig.for_model(
        **arch.text_config(layers),
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        dtype="bfloat16",
    )


def checkpoint_tensors(config) -> tuple[list[Tensor], str]:
    """Every tensor a release of this model holds (names after transformers' save-time renaming),
    with its init rule; the causal LM class. The model is built on the meta device: nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    modules = dict(model.named_modules())
    saved = revert_weight_conversion(model, model.state_dict())
    return [Tensor(name, tuple(t.shape), init_rule(modules, name)) for name, t in saved.items()], type(model).__name__


def init_rule(modules: dict, name: str) -> str:
    """How transformers' `_init_weights` fills the tensor `name` for the Qwen3.5 family: by the class
    of the module that owns it (the longest module path `name` starts with) and its own name."""
    parts = name.split(".")
    owner = next(modules[p] for p in (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)) if p in modules)
    kind, leaf = type(owner).__name__, parts[-1]
    if leaf == "A_log":
        return "a_log"
    if leaf == "dt_bias" or kind.endswith("RMSNormGated"):
        return "ones"
    if kind.endswith("RMSNorm") or leaf == "bias":
        return "zeros"
    if kind in ("Linear", "Conv1d", "Embedding") or kind.endswith(("Experts", "TopKRouter")):
        return "normal"
    raise Refused(f"no init rule for {name} (a {kind}): add one to tools/make_target.py init_rule")


def free_bytes(dev) -> int:
    """What `dev` has free: the GPU's free memory, or the host's available memory for cpu."""
    import torch

    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    import psutil

    return psutil.virtual_memory().available


def check_room(arch: Arch, layers: int, dev, need: int, out: Path) -> None:
    """Refuse, in one line, weights the device or the disk under `out` cannot hold."""
    where = "host memory available" if dev.type == "cpu" else f"free on {dev}"
    free = free_bytes(dev)
    if need > free:
        raise Refused(
            f"{arch.name} at {layers} layers needs {need / GB:.1f} GB for its bf16 weights alone; "
            f"{free / GB:.1f} GB {where} (build fewer --layers, or on a larger device)"
        )
    parent = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    disk = shutil.disk_usage(parent).free
    if need > disk:
        raise Refused(
            f"--out {out}: its weights need {need / GB:.1f} GB on disk, {disk / GB:.1f} GB free under {parent}"
        )


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def draw(t: Tensor, seed: int, dev, std: float):
    """The tensor itself, created on `dev` from its own generator."""
    import torch

    if t.rule == "zeros":
        return torch.zeros(t.shape, dtype=torch.bfloat16, device=dev)
    if t.rule == "ones":
        return torch.ones(t.shape, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(tensor_seed(seed, t.name))
    if t.rule == "a_log":
        a = torch.empty(t.shape, dtype=torch.float32, device=dev).uniform_(0.01, 16, generator=g)
        return a.log_().to(torch.bfloat16)
    return torch.empty(t.shape, dtype=torch.bfloat16, device=dev).normal_(0.0, std, generator=g)


def shard_plan(tensors: list[Tensor], max_bytes: int) -> list[list[Tensor]]:
    """Tensors in order, a new shard whenever the next would pass max_bytes (one larger alone)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_weights(directory: Path, tensors: list[Tensor], seed: int, dev, std: float, max_bytes: int, log) -> int:
    """The safetensors shards, one held at a time, and their index; the number of shards."""
    from safetensors.torch import save_file

    plan = shard_plan(tensors, max_bytes)
    weight_map = {}
    for i, shard in enumerate(plan, 1):
        t0 = time.time()
        name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        save_file({t.name: draw(t, seed, dev, std) for t in shard}, str(directory / name), metadata={"format": "pt"})
        as_umask(directory / name)  # safetensors writes it owner-only (0600)
        weight_map.update(dict.fromkeys((t.name for t in shard), name))
        log(f"shard {i}/{len(plan)}: {sum(t.nbytes for t in shard) / GB:.2f} GB in {time.time() - t0:.0f} s")
    total = sum(t.nbytes for t in tensors)
    index = {"metadata": {"total_parameters": total // 2, "total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(plan)


def write_config(directory: Path, config) -> None:
    """config.json and a greedy generation_config.json, as save_pretrained writes them."""
    from transformers import GenerationConfig

    config.save_pretrained(directory)
    generation = GenerationConfig.from_model_config(config)
    generation.do_sample = False
    generation.save_pretrained(directory)


def write_tokenizer(directory: Path, vocab_size: int, max_length: int) -> None:
    """The tiny target's tokenizer with generated tokens up to vocab_size (see the module docstring)."""
    tokenizer = base_tokenizer()
    vocab = tokenizer["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        token = GENERATED.format(i)
        if token in vocab:
            raise Refused(f"the generated token {token!r} is already in the tiny tokenizer")
        vocab[token] = i
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    shutil.copy(TINY_TARGET / "chat_template.jinja", directory / "chat_template.jinja")
    settings = json.loads((TINY_TARGET / "tokenizer_config.json").read_text())
    settings["model_max_length"] = max_length
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def reduced_taps(full_layers: int, layers: int) -> list[int]:
    """The full model's default taps at the same relative depths of `layers` layers (module docstring)."""
    full = default_taps(full_layers)
    if layers == full_layers:
        return full
    if layers <= len(full):
        return list(range(layers))
    at = [min(layers - 1, max(0, int((k + 1) * layers / full_layers + 0.5) - 1)) for k in full]
    for i in range(1, len(at)):  # apart, in order: each above the one before ...
        at[i] = max(at[i], at[i - 1] + 1)
    at[-1] = min(at[-1], layers - 1)  # ... and below the one after, the last within the model
    for i in range(len(at) - 2, -1, -1):
        at[i] = min(at[i], at[i + 1] - 1)
    return at


def provenance(arch: Arch, layers: int, seed: int, dev, out: Path) -> dict:
    """What was built, from what, with what: and the `--taps` that place the taps as on the full model."""
    import torch
    import transformers

    taps = ",".join(map(str, reduced_taps(arch.full_layers, layers)))
    return {
        "arch": arch.name,
        "source": arch.source,
        "full_layers": arch.full_layers,
        "layers": layers,
        "seed": seed,
        "device": dev.type,
        "dtype": "bfloat16",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "full_taps": default_taps(arch.full_layers),
        "taps": taps,
        "extract": f"pipeline extract --target {out} --taps {taps}",
    }


if __name__ == "__main__":
    main()
