"""What `--responses regenerate` costs at a large target, said before the target loads.

In-process references are Hugging Face `generate`, a few hundred tokens/s per GPU at 27B, where a
serving engine decodes 2.5k-5k (docs/performance.md, "Planning a Qwen3.6-27B extraction"): a 27B
drafter's ~2.5M prompts of ~1k completion tokens cost ~2,000-4,000 GPU-h of references this way
against ~210-350 GPU-h through an engine. For a target of more than LARGE parameters, counted from
the checkpoint's file headers (no weight is read), extraction says so with the command to use.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import TargetError
from pipeline.target import loading, weights
from stages.extract.config import ExtractConfig

LARGE = 3e9  # parameters: above, regenerate's references are GPU-days (the tiny target has a few million)


def parameters(path: Path) -> int:
    """The checkpoint's parameter count, from the safetensors headers (a .bin file is opened on the
    meta device): no tensor's data is read."""
    import torch
    from safetensors import safe_open

    total = 0
    for f in weights.files(path):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as fh:
                shapes = [fh.get_slice(name).get_shape() for name in fh.keys()]
        else:
            shapes = [t.shape for t in torch.load(f, map_location="meta", weights_only=True, mmap=True).values()]
        for shape in shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
    return total


def notice(config: ExtractConfig) -> str | None:
    """With --responses regenerate and a target of more than LARGE parameters, the line that says
    what its references cost and the command that uses an engine; else None. A directory without
    config.json or weights is left to the loading to refuse. With --capture vllm the capturing engine
    generates them: nothing to say."""
    if config.responses != "regenerate" or config.capture == "vllm":
        return None
    path = loading.resolve(config.target)
    if not (path / "config.json").is_file():
        return None
    try:
        n = parameters(path)
    except TargetError:  # no weight files
        return None
    if n <= LARGE:
        return None
    return (
        f"--responses regenerate (the default) generates every reference in this process with Hugging Face "
        f"generate: for this {n / 1e9:.1f}B-parameter target that costs ~10x the GPU time of a serving engine (at "
        f"27B, ~2.5M prompts: ~2,000-4,000 GPU-h of references against ~210-350). To use one, serve the target "
        f"(`vllm serve {config.target} --port 8000`, or SGLang) and add `--responses server --server-url "
        f"http://127.0.0.1:8000` to this command, or have vLLM make and capture them (`--capture vllm`; "
        f'docs/extraction.md, "Where the greedy references come from" and "Capture inside vLLM").'
    )
