"""Evaluation's settings: every evaluate.py flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import device as devices
from stages import cache_flags
from stages.settings import at_least, check_choices, fill, parse_count, require, setting

DDTREE_BUDGETS = (8, 16, 32, 64)


def parse_budgets(text: str) -> tuple[int, ...]:
    """'8,16,32,64' -> (8, 16, 32, 64); 'none' or '' -> () (chain drafting only)."""
    if text in ("", "none"):
        return ()
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError("expected budgets such as '8,16,32,64' or 'none'") from None


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    store: str = setting("hs.zarr", "Hidden-state store (path or fsspec URL).")
    checkpoints: tuple[str, ...] = setting(
        help="Drafter checkpoint directory (config.json + model.safetensors); repeat to compare several.",
        flag="--checkpoint",
    )
    shards: str | None = setting(
        None,
        "Shards of --store to replay, e.g. '56-63'.",
        default_text="the held-out shards a checkpoint recorded of this store (or of one with "
        "the same prompts in the same shards), else every committed shard",
    )
    ddtree: tuple[int, ...] = setting(
        DDTREE_BUDGETS,
        "DDTree node budgets to report ('none' for chain drafting only).",
        default_text=",".join(map(str, DDTREE_BUDGETS)),
        parse=parse_budgets,
    )
    temperature: float | None = setting(
        None,
        "Also report tau@T: the tokens per round expected under speculative sampling at this temperature "
        "(drafts sampled from the drafter's softmax(logits/T), accepted with probability min(1, p/q) against "
        "the target's softmax(lm_head(final state)/T)), over the chain rounds greedy replay makes. The target's "
        "distribution at a block's later slots is the one along the stored reference, not along the drafts "
        "sampled before them: exact where those equal the reference's tokens; a lower bound free of that "
        "assumption is reported beside it. Needs a store made with `pipeline extract --final-state`.",
        default_text="off (greedy tau only)",
    )
    out: str = setting("report", "Report directory.")
    force: bool = setting(
        False,
        "Replace the report already in --out (report.json, report.md and the PNGs). An --out "
        "holding anything else (a store, a run, other files) is refused, --force or not.",
    )
    max_rounds: int | None = setting(None, "Stop each prompt after this many rounds.")
    max_prompts: int | None = setting(
        2000,
        "Replay a fixed random sample of this many of the shards' prompts "
        "(seeded by --seed; the report gives the sample size and a 95% interval "
        "for tau); 'all' replays every one.",
        parse=parse_count,
        default_text="2000",
    )
    seed: int = setting(0, "Seeds the sample of prompts.")
    dtype: str = setting(
        "bf16",
        "Drafter weights and activations: bf16 (as served; the target's embedding and "
        "lm_head stay as stored) or fp32 (copies them to fp32).",
        choices=("bf16", "fp32"),
    )
    batch_prompts: int = setting(
        32,
        "Prompts replayed together: each round drafts one block per prompt and policy in "
        "one forward. More uses more device memory (the context K/V of each).",
    )
    allow_mismatch: bool = setting(
        False,
        "Evaluate a checkpoint trained on another conditioning (target, kernels, "
        "dtype, taps, tokenizer, mask token; hidden format other than an fp8-trained "
        "drafter on bf16 states), which is refused without it; the report says so at "
        "the top. A store of other data with the same conditioning needs no flag.",
    )
    live: bool = setting(
        False,
        "Also run real greedy speculative decoding with the target (verify each block in one "
        "pass, roll back the hybrid state on rejection); reports tau, tokens/s vs target-only "
        "greedy, and agreement with replay.",
    )
    target: str | None = setting(None, "The store's target model directory, for --live.")
    live_prompts: int | None = setting(
        20,
        "--live decodes with the target only the first N prompts of the sample "
        "(target-only greedy plus one run per drafter: slow at scale); 'all' for "
        "every one.",
        parse=parse_count,
        default_text="20",
    )
    served: str | None = setting(
        None,
        "Also serve the store's target with each drafter in this engine over the same "
        "prompts (stored prompt ids, greedy, the extraction's limits) and report served "
        "tau beside replay tau, per position (docs/evaluation.md).",
        choices=("vllm",),
        default_text="off",
    )
    served_python: str | None = setting(
        None, "The Python that has vLLM installed (its own venv), for --served.", default_text="this Python"
    )
    served_device: str | None = setting(
        None,
        "Device of the --served engine: cuda:N (GPU N as this process numbers "
        "them; the engine sees it alone) or cpu. It starts after replay and "
        "--live, once the evaluator has freed what it held, with every other "
        "process of a launch gone.",
        default_text="this process's device",
    )
    served_memory: float | None = setting(
        None,
        "Share of the --served engine's GPU memory it may take (vLLM's "
        "gpu_memory_utilization); refused up front when less is free.",
        default_text="0.9, or what is free less 0.03",
    )
    cache_dir: str | None = cache_flags.cache_dir_setting()
    cache_size: int | None = cache_flags.cache_size_setting()
    device: str | None = setting(None, "torch device.", default_text=devices.AUTO)  # None: chosen by run(), with torch
    threads: int | None = setting(
        None,
        "CPU intra-op threads per process. On an idle 2-core machine batched replay ran "
        "1.5x faster with two than with one; while another program is busy, one can be "
        "much faster (OpenMP threads waiting on each other).",
        default_text=devices.THREADS_AUTO,
    )

    def __post_init__(self) -> None:
        fill(self, "checkpoints", tuple(self.checkpoints))
        require(self, "checkpoints", bool(self.checkpoints), "give at least one drafter checkpoint directory")
        check_choices(self)
        cache_flags.check(self)
        require(self, "ddtree", all(b >= 1 for b in self.ddtree), "budgets must be at least 1")
        require(
            self,
            "temperature",
            self.temperature is None or 0 < self.temperature < float("inf"),
            "expected a temperature above 0 (greedy tau is always reported)",
        )
        require(self, "target", self.target or not self.live, "--live needs --target DIR (the store's target model)")
        require(
            self,
            "served_memory",
            self.served_memory is None or 0 < self.served_memory <= 1,
            "expected a share of the device's memory in (0, 1]",
        )
        at_least(self, 1, "max_rounds", "max_prompts", "threads", "batch_prompts", "live_prompts")
