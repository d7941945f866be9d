"""Plan's settings: every `pipeline plan` flag, its default and its help. The defaults are the 27B job of
docs/scale.md ("A 27B run on an object store"): Qwen3.6-27B, 2.5M rows of ~2k tokens, 4 nodes of 8 H100s."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.drafter.config import HEADS, MARKOV_RANK
from stages.settings import require, setting
from store.format import hidden_formats

OPTIMIZERS = ("muon", "adamw")


def low_high(text: str) -> tuple[float, float]:
    """'2500-5000' -> (2500.0, 5000.0); one figure is both ends; ValueError naming the form otherwise."""
    try:
        ends = tuple(float(x) for x in text.split("-"))
    except ValueError:
        ends = ()
    if len(ends) == 1:
        ends = ends * 2
    if len(ends) != 2 or not 0 < ends[0] <= ends[1]:
        raise ValueError("expected LOW-HIGH, 0 < LOW <= HIGH (e.g. 2500-5000)")
    return ends


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    target: str = setting(
        "qwen3.6-27b",
        "A target model directory (its config.json is read, not its weights) or a published "
        "architecture's name (pipeline/target/architectures.py: qwen3.6-27b, qwen3.5-9b, qwen3.5-35b-a3b).",
    )
    rows: int = setting(2_500_000, "Rows (samples) in the dataset.")
    prompt_tokens: int = setting(1_000, "Mean prompt tokens a row.")
    completion_tokens: int = setting(1_000, "Mean completion tokens a row (the references).")
    taps: int = setting(5, "Tap layers stored a token (the drafter's fc input is taps x hidden).")
    final_state: bool = setting(
        False,
        "Plan a store that keeps the target's final state a token too (pipeline extract --final-state; train.py "
        "--soft-targets reads it): one more state of H values a token, stored, read and held a training sample.",
    )
    hidden_format: str = setting(
        "fp8", "How the states are stored (pipeline extract --hidden-format).", choices=hidden_formats.NAMES
    )
    shard_rows: int = setting(1_024, "Rows a shard (pipeline extract's default).")
    eval_shards: int = setting(42, "Shards held out for validation and evaluation (the last ones).")
    gpus_per_node: int = setting(8, "GPUs a node.")
    nodes: int = setting(4, "Nodes, each extracting and training on its own share.")
    gpu_memory_gb: float = setting(80.0, "Memory of one GPU, GB (10^9 bytes): H100 80, H200 141.")
    local_disk_tb: float = setting(30.0, "Local disk (NVMe) a node, TB (10^12 bytes), for the shard cache.")
    cache_share: float = setting(0.9, "Share of the local disk the cache may fill (--cache-size).")
    network_gbps: float = setting(100.0, "Network a node to the store, Gb/s.")
    tflops: float = setting(
        400.0,
        "Sustained bf16 TFLOP/s a GPU assumed for the capture forward and training (about 40% of an H200's peak).",
    )
    peak_tflops: float = setting(
        989.0, "Dense bf16 peak TFLOP/s a GPU (H100 and H200: 989); an engine's prefill runs at half of it."
    )
    decode_tokens_s: tuple[float, ...] = setting(
        (2_500.0, 5_000.0),
        "An engine's decode tokens/s a GPU at large batch, as a range (assumed).",
        parse=low_high,
        default_text="2500-5000",
    )
    optimizer: str = setting("muon", "The drafter's optimizer (train.py --optimizer).", choices=OPTIMIZERS)
    drafter_layers: int = setting(5, "Drafter decoder layers (the released 27B drafter: 5).")
    head: str = setting(
        "dflash",
        "The drafter's head (train.py --head): dspark adds two [vocab, r] Markov matrices and the bias they "
        "put on every slot's logits.",
        choices=HEADS,
    )
    markov_rank: int = setting(MARKOV_RANK, "Rank r of the dspark Markov head (train.py --markov-rank).")
    markov_optimizer: str = setting(
        "muon",
        "What steps the dspark Markov matrices under --optimizer muon (train.py --markov-optimizer): adamw keeps "
        "two fp32 moments of each on every GPU, where Muon's momentum is split over the GPUs.",
        choices=OPTIMIZERS,
    )
    anchors: int = setting(512, "Anchors a sample (train.py --anchors).")
    block_size: int = setting(16, "Drafter block size.")
    epochs: int = setting(6, "Training epochs over the training shards.")

    @property
    def states(self) -> int:
        """States stored a token: the taps, and the final state with --final-state."""
        return self.taps + self.final_state

    def __post_init__(self) -> None:
        require(self, "target", self.target.strip() != "", "give a directory or an architecture's name")
        for name in ("rows", "prompt_tokens", "completion_tokens", "taps", "shard_rows", "gpus_per_node", "nodes"):
            require(self, name, getattr(self, name) >= 1, "must be at least 1")
        for name in ("drafter_layers", "anchors", "block_size", "epochs", "markov_rank"):
            require(self, name, getattr(self, name) >= 1, "must be at least 1")
        require(self, "eval_shards", self.eval_shards >= 0, "must be 0 or more")
        require(
            self,
            "markov_optimizer",
            self.markov_optimizer == "muon" or self.optimizer == "muon",
            "is only used by --optimizer muon (adamw steps every parameter)",
        )
        for name in ("gpu_memory_gb", "local_disk_tb", "network_gbps", "tflops", "peak_tflops"):
            require(self, name, getattr(self, name) > 0, "must be above 0")
        require(self, "cache_share", 0 < self.cache_share <= 1, "a share in (0, 1]")
        low_high = len(self.decode_tokens_s) == 2 and 0 < self.decode_tokens_s[0] <= self.decode_tokens_s[1]
        require(self, "decode_tokens_s", low_high, "LOW-HIGH tokens/s, 0 < LOW <= HIGH")

    @property
    def sample_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
