"""Stage two's settings: every train.py flag, its default and its help, in the config of the
component that reads it (data, shard schedule, optimizer, loss, drafter architecture, run). TrainConfig
holds the components; its flags are theirs (stages/settings.py `part`), and a run records them as one
flat {flag's field: value} (`TrainConfig.record`, `TrainConfig.of`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import device as devices
from pipeline.drafter.config import (
    ANCHOR_RULES,
    BLOCK_SIZE,
    GAMMA,
    HEADS,
    MARKOV_RANK,
    NORMS,
    NUM_LAYERS,
    ROPE_THETA,
    SOFT_TARGETS,
)
from stages import cache_flags
from stages.settings import at_least, build, check_choices, fill, flat, parse_count, part, require, setting
from stages.train.node_order import DATA_ORDERS
from stages.train.recipe import BATCHINGS, NOISES, OPTIMIZERS, SCHEDULES, slot_gamma

_GAMMAS = ", ".join(f"{g:g} for B={b}" for b, g in GAMMA.items())
FOLLOW_POLL_S = 30.0  # --follow-poll when --follow is given without it


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What each step reads: the store, its training and held-out shards, how samples become
    ordered rows and batches (stages/train/samples.py, epoch_order.py, node_order.py, position.py),
    and how they are read (loader.py)."""

    store: str = setting("hs.zarr", "Hidden-state store (path or fsspec URL).", resume="fixed")
    shards: str | None = setting(
        None, "Training shards, e.g. '0-55'.", default_text="every committed shard not in --eval-shards", resume="fixed"
    )
    eval_shards: str | None = setting(
        None,
        "Held-out shards for validation, e.g. '56-63'; never trained on (a "
        "--shards range that reaches one is refused).",
        default_text="none",
        resume="fixed",
    )
    max_length: int = setting(
        4096,
        "Tokens per sample used (longer ones are cut); with --batching packed also the tokens of a row.",
        resume="fixed",
    )
    batch_size: int = setting(
        1, "Rows per process per micro-batch (a row is one sample, or several with --batching packed).", resume="fixed"
    )
    batching: str = setting(
        "random",
        "How samples become rows and batches, from each epoch's shuffled order: "
        "random: one sample a row, in the shuffled order (the default by the recipe "
        "bench); bucketed: one sample a row, rows of similar length batched together "
        "(little padding, but each batch's loss is normalised on its own, so batches of "
        "long samples weigh as much as batches of short ones); packed: whole "
        "samples concatenated into rows of up to --max-length tokens, attention and "
        "labels never crossing samples, positions restarting at each, --anchors per "
        "sample.",
        choices=BATCHINGS,
        resume="fixed",
    )
    data_order: str = setting(
        "global",
        "Each epoch's sample order: global: one shuffle of all training samples, "
        "dealt to ranks in blocks (every node reads every shard every epoch); node: "
        "shards dealt to nodes (balanced by samples), each node's ranks reading only "
        "its shards, their samples shuffled within windows of --shuffle-window shards, "
        "so a node-local cache holds the node's share and the store is read about once "
        "a deal. It costs randomness: a rank's consecutive batches come from one window, "
        "not from every sample (docs/training.md, Node-affine order).",
        choices=DATA_ORDERS,
        resume="fixed",
    )
    shuffle_window: int | None = setting(
        None,
        "--data-order node: shards whose samples are shuffled together. "
        "Smaller: fewer shards in use at once on a node (open readers, cache "
        "working set), but a batch drawn from fewer samples.",
        default_text="all of a node's shards",
        resume="fixed",
    )
    redeal_every: int = setting(
        0,
        "--data-order node: epochs between deals of shards to nodes (0: dealt once for "
        "the run). A re-deal gives each node other shards: more variety across epochs, but "
        "a node-local cache fetches its new share again.",
        resume="fixed",
    )
    seed: int = setting(0, "Seeds the initialization, data order and anchors.", resume="fixed")
    workers: int = setting(2, "Data loader worker processes per training process.")
    cache_dir: str | None = cache_flags.cache_dir_setting()
    cache_size: int | None = cache_flags.cache_size_setting()
    on_corrupt: str = setting(
        "stop",
        "A sample that cannot be read as committed (a chunk failing its checksum, a "
        "damaged or missing file, a shard deleted under the run): stop (one line naming "
        "the file, shard and sample, and what to run) or skip (leave it out; counted in "
        "metrics.jsonl and the final line).",
        choices=("stop", "skip"),
    )

    def __post_init__(self) -> None:
        check_choices(self)
        cache_flags.check(self)
        at_least(self, 1, "max_length", "batch_size", "shuffle_window")
        at_least(self, 0, "workers", "redeal_every")
        for name in ("shuffle_window", "redeal_every"):
            require(
                self, name, not getattr(self, name) or self.data_order == "node", "is only used by --data-order node"
            )
        for name in ("shards", "eval_shards"):
            require(
                self,
                name,
                getattr(self, name) is None or bool(getattr(self, name).strip()),
                "is empty: give a range such as '0-55', or leave the flag out",
            )


@dataclass(frozen=True, kw_only=True)
class ShardScheduleConfig:
    """Which shards each epoch trains on when they are not fixed at launch (stages/train/
    shard_schedule.py)."""

    follow: bool = setting(
        False,
        "Train while extraction runs: each epoch takes the shards of --shards committed "
        "when it begins, so shards committed later join at the next epoch's start (waits "
        "for enough shards to begin). Needs --shards and --max-steps; each epoch's shards "
        "are recorded in OUT/shards.json and in every step-N.",
        resume="fixed",
    )
    follow_poll: float | None = setting(
        None,
        "--follow: seconds between looks at the store while too few shards "
        "are committed to begin, and the least time between two looks at "
        "epoch starts. Only with --follow.",
        default_text="30 with --follow",
    )
    shard_schedule: str | None = setting(
        None,
        "Train each epoch on the shards a schedule file lists for it (a "
        "--follow run's OUT/shards.json: that run replayed on the finished "
        "store); epochs past its end take its last entry. Needs --shards "
        "covering them.",
        default_text="off",
        resume="fixed",
    )

    def __post_init__(self) -> None:
        require(self, "follow_poll", self.follow_poll is None or self.follow, "is only used with --follow")
        require(self, "follow_poll", self.follow_poll is None or self.follow_poll > 0, "must be positive")
        if self.follow and self.follow_poll is None:
            fill(self, "follow_poll", FOLLOW_POLL_S)
        require(
            self,
            "follow",
            not (self.follow and self.shard_schedule),
            "cannot be combined with --shard-schedule (a schedule replays a followed run: give one or the other)",
        )


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimizer, its learning-rate schedule, and the gradients it steps on (stages/train/optim.py,
    grad_comm.py)."""

    lr: float = setting(
        6e-4,
        "Peak AdamW learning rate: of every parameter with --optimizer adamw, of the norms with "
        "muon (whose matrices take --muon-lr).",
        resume="fixed",
    )
    warmup_ratio: float = setting(0.04, "Linear warmup share of the steps; --schedule decay after.", resume="fixed")
    schedule: str = setting(
        "cosine", "Decay to 0 after the warmup: cosine or linear.", choices=SCHEDULES, resume="fixed"
    )
    optimizer: str = setting(
        "muon",
        "muon: Muon (torch.optim.Muon's update) over the 2-D weight matrices (fc, "
        "attention, MLP) and AdamW over the norms, as speculators trains DFlash; adamw: "
        "AdamW over every parameter (the SPEC recipe). The default by the recipe bench "
        "(docs/training.md).",
        choices=OPTIMIZERS,
        resume="fixed",
    )
    muon_lr: float | None = setting(
        None,
        "Peak Muon learning rate (--optimizer muon), its update scaled to match AdamW's RMS.",
        default_text="10 x --lr",
        resume="fixed",
    )
    muon_weight_decay: float = setting(0.1, "Muon weight decay (--optimizer muon).", resume="fixed")
    markov_optimizer: str = setting(
        "muon",
        "What steps a dspark drafter's Markov matrices (markov_w1, the previous token's embedding, and "
        "markov_w2, its projection to the vocabulary; both [vocab, r]) under --optimizer muon: muon, as "
        "every other matrix, or adamw at --lr, as embeddings and output heads are commonly kept.",
        choices=("muon", "adamw"),
        resume="fixed",
    )
    grad_clip: float = setting(1.0, "Gradient norm clip (0: off).", resume="fixed")
    weight_decay: float = setting(0.0, "AdamW weight decay.", resume="fixed")
    grad_accum: int = setting(1, "Micro-batches per optimizer step.", resume="fixed")
    grad_comm: str = setting(
        "bf16",
        "Precision of the gradients' all-reduce between processes: bf16 (half the bytes "
        "between nodes; each process's gradients rounded to bf16 and summed in bf16; the "
        "default by the recipe bench on 2 processes: chain tau +0.7%, 95% interval "
        "[-0.2%, +1.6%], docs/training.md) or fp32. The metrics log gives the bytes a step "
        "(docs/performance.md).",
        choices=("fp32", "bf16"),
    )

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "grad_accum")
        at_least(self, 0, "grad_clip", "weight_decay", "muon_weight_decay")
        require(self, "lr", self.lr > 0, "must be positive")
        require(self, "muon_lr", self.muon_lr is None or self.muon_lr > 0, "must be positive")
        require(self, "muon_lr", self.muon_lr is None or self.optimizer == "muon", "is only used by --optimizer muon")
        require(
            self,
            "markov_optimizer",
            self.markov_optimizer == "muon" or self.optimizer == "muon",
            "is only used by --optimizer muon (adamw steps every parameter)",
        )
        require(self, "warmup_ratio", 0 <= self.warmup_ratio < 1, "expected 0 <= ratio < 1")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The training loss: blocks, anchors, slot weights, input noise (stages/train/step.py LossPlan)."""

    block_size: int = setting(BLOCK_SIZE, "Block size B: anchor token + B-1 drafts.", resume="fixed")
    gamma: float | None = setting(None, "Loss decay w_k = exp(-(k-1)/gamma).", default_text=_GAMMAS, resume="fixed")
    anchors: int = setting(512, "Blocks per sample, resampled every step.", resume="fixed")
    anchor_rule: str = setting(
        "pair",
        "Which positions may anchor a block: pair: loss_mask[a] and loss_mask[a+1] "
        "(SPEC); single: loss_mask[a] (speculators).",
        choices=ANCHOR_RULES,
        resume="fixed",
    )
    noise_std: float = setting(
        0.0,
        "Noise on fc's input only (never the labels): the sd of --noise gaussian, the half-width of --noise uniform.",
        resume="fixed",
    )
    noise: str = setting(
        "gaussian",
        "Kind of --noise-std noise: gaussian, or uniform in [-std, std] (speculators' noise_std).",
        choices=NOISES,
        resume="fixed",
    )
    slot_weights: str = setting(
        "dpace",
        "Loss weight of draft slot k: dpace: D-PACE (arXiv:2605.18810), from the "
        "drafter's own detached confidences, the default of ModelOpt and speculators "
        "and of the recipe bench; exp: exp(-(k-1)/gamma) (SPEC).",
        choices=("dpace", "exp"),
        resume="fixed",
    )
    dpace_alpha: float = setting(
        0.5, "D-PACE smoothing: confidence q counts as alpha + (1-alpha) q (--slot-weights dpace only).", resume="fixed"
    )
    anchor_budget: int | None = setting(
        None,
        "At most N blocks per micro-batch in all, drawn from the samples' "
        "anchors pooled; each sample still at most --anchors.",
        default_text="off",
        resume="fixed",
    )
    loss_norm: str = setting(
        "weights",
        "Divide a micro-batch's weighted CE by the sum of the slot weights (SPEC) or "
        "by the number of labelled slots (labels, as speculators).",
        choices=NORMS,
        resume="fixed",
    )
    acceptance_weight: float = setting(
        0.0,
        "Weight lam of the expected-acceptance objective: loss = lam (1 - "
        "E/(B-1)) + (1 - lam) the weighted CE, E = sum over j of the product of "
        "the drafter's probabilities of the target's tokens at slots 1..j, the "
        "expected number of leading drafts accepted (docs/training.md, Blocks, "
        "labels and loss). The product weights the slots itself: --slot-weights "
        "weight the CE part only (at 1, nothing). 0: cross-entropy alone.",
        resume="fixed",
    )
    soft_targets: str = setting(
        "none",
        "Also learn the target's distribution, p = softmax(lm_head(final state)) of the position before "
        "each slot (a store extracted with --final-state): kl: KL(p || q); tv: total variation, 1 - the "
        "chance a sampled draft is accepted; accept: the expected-acceptance term with those chances; "
        "each mixed with the CE by --soft-weight. A dspark drafter takes tv (its TV share). none: hard "
        "labels only (docs/training.md, Soft targets).",
        choices=SOFT_TARGETS,
        resume="fixed",
    )
    soft_weight: float = setting(
        0.5,
        "Weight w of --soft-targets: loss = w soft + (1 - w) the weighted CE (not used by a dspark drafter, "
        "whose mix is 0.9 TV + 0.1 CE).",
        resume="fixed",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "block_size", "anchors", "anchor_budget")
        at_least(self, 0, "noise_std")
        require(self, "gamma", self.gamma is None or self.gamma > 0, "must be positive")
        require(self, "gamma", self.gamma is None or self.slot_weights == "exp", "is only used by --slot-weights exp")
        require(self, "dpace_alpha", 0 < self.dpace_alpha <= 1, "expected 0 < alpha <= 1")
        require(self, "acceptance_weight", 0 <= self.acceptance_weight <= 1, "expected 0 <= weight <= 1")
        require(self, "soft_weight", 0 < self.soft_weight <= 1, "expected 0 < weight <= 1")
        require(
            self,
            "acceptance_weight",
            not self.acceptance_weight or self.soft_targets == "none",
            "is the hard-label form of --soft-targets accept; pass one of them",
        )


@dataclass(frozen=True, kw_only=True)
class DrafterArchConfig:
    """The drafter's architecture, or where it comes from (stages/train/setup.py fresh_config);
    `drafter=` names the DrafterConfig field a size sets."""

    num_layers: int | None = setting(None, "Drafter layers.", default_text=str(NUM_LAYERS), drafter="num_hidden_layers")
    num_heads: int | None = setting(
        None, "Query heads.", default_text="from the store's hidden size", drafter="num_attention_heads"
    )
    num_kv_heads: int | None = setting(
        None,
        "Key/value heads.",
        default_text="heads / 4; the target's full-attention KV heads where vLLM needs them",
        drafter="num_key_value_heads",
    )
    head_dim: int | None = setting(
        None,
        "Head dimension.",
        default_text="128, or hidden/4 below 1024; the target's where vLLM needs it",
        drafter="head_dim",
    )
    intermediate_size: int | None = setting(
        None, "MLP width.", default_text="3.4 x hidden, rounded to 64", drafter="intermediate_size"
    )
    layer_types: str | None = setting(
        None,
        "'full', 'sliding', or one per layer, e.g. 'sliding,sliding,sliding,sliding,full'.",
        default_text="--drafter-config's, else full",
    )
    sliding_window: int | None = setting(None, "Window of sliding layers (positions).", drafter="sliding_window")
    rope_theta: float | None = setting(
        None, "RoPE base.", default_text=f"--drafter-config's, else {ROPE_THETA:.0e}".replace("e+0", "e")
    )
    mask_token_id: int | None = setting(None, "Mask token for the draft slots.", default_text="the store's")
    head: str | None = setting(
        None,
        "dspark: add DSpark's low-rank Markov transition head (the previous token's "
        "bias on each slot's logits, drafted slot after slot) and its confidence "
        "head, trained with 0.9 TV + 0.1 CE; exported as vLLM's Qwen3DSparkModel "
        "(docs/training.md, The DSpark head).",
        choices=HEADS,
        default_text="--drafter-config's, else dflash",
        drafter="head",
    )
    markov_rank: int | None = setting(
        None,
        "Rank r of the dspark Markov head (two [vocab, r] matrices).",
        default_text=f"--drafter-config's, else {MARKOV_RANK}",
        drafter="markov_rank",
    )
    drafter_config: str | None = setting(
        None,
        "Take the architecture (sizes, layer types, window, RoPE) from this "
        "config.json, e.g. a released drafter's; taps, vocab and mask come from "
        "the store; size flags override it.",
    )
    init_from: str | None = setting(
        None,
        "Start from this drafter checkpoint (loaded strictly; must fit the store). "
        "Its architecture and block size are used; size flags are ignored (a --head "
        "or --markov-rank other than its own is refused). The "
        "optimizer and schedule start afresh: to continue a trained drafter, lower "
        "--lr.",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "markov_rank")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run as a whole: OUT, its length, checkpoints, validation and logging cadence, the process's
    device settings."""

    out: str = setting("runs/drafter", "Run directory.")
    max_steps: int | None = setting(None, "Optimizer steps; overrides --epochs.", resume="fixed")
    epochs: int = setting(6, "Passes over the training samples.", resume="fixed")
    resume: str | None = setting(
        None,
        "Continue from OUT's latest step-N (bare flag) or from the given step directory.",
        click={"is_flag": False, "flag_value": "latest"},
    )
    save_every: int = setting(
        1000, "Write OUT/step-N (what --resume continues from) every N steps, and at the end (0: only OUT/final)."
    )
    keep_last: int = setting(
        2,
        "Keep the newest K step-N checkpoints: once one is written, older ones beyond K "
        "are deleted, with leftovers of a crashed save (0: keep all). OUT/final, and "
        "step-N past the one just written, are never deleted.",
    )
    eval_every: int = setting(0, "Validate every N steps (always before the first step and at the end).")
    eval_samples: int | None = setting(
        2000,
        "Validate on a fixed random sample of this many held-out samples, the "
        "same every time ('all': every one; at 27B scale that is ~1 h a call).",
        parse=parse_count,
        default_text="2000",
    )
    eval_replay_prompts: int | None = setting(
        256,
        "Validation also replays greedy speculative decoding (chain "
        "drafting, evaluate.py's rule, the fp32 weights) on a fixed random "
        "sample of this many held-out prompts and reports their tau "
        "(tau_replay; 0: off, 'all': every one).",
        parse=parse_count,
        default_text="256",
    )
    log_every: int = setting(10, "Write a metrics record every N steps.")
    threads: int | None = setting(
        None,
        "CPU only: intra-op threads per process. On a busy machine 1 can be much "
        "faster: OpenMP threads that wait on each other crawl.",
        default_text=devices.THREADS_AUTO,
    )
    mixed_precision: str = setting(
        "auto",
        "auto: bf16 autocast with fp32 master weights on GPU, fp32 on CPU.",
        choices=("auto", "bf16", "no"),
        resume="fixed",
    )
    grad_checkpoint: bool = setting(
        False,
        "Recompute each drafter layer's activations in the backward pass instead "
        "of keeping them: the same gradients with less memory per sample, for about "
        "a third more compute (for --max-length 8k-16k: docs/training.md, Long "
        "context).",
    )
    audit: bool = setting(False, "Write OUT/audit/rank-N.json: world size, samples read, parameter hash.")

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "eval_samples", "epochs", "log_every", "max_steps")
        at_least(self, 0, "eval_replay_prompts", "save_every", "keep_last", "eval_every")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run's settings: one config per component, each given to the builders of that component."""

    data: DataConfig = part(DataConfig)
    shard_schedule: ShardScheduleConfig = part(ShardScheduleConfig)
    optim: OptimConfig = part(OptimConfig)
    loss: LossConfig = part(LossConfig)
    drafter: DrafterArchConfig = part(DrafterArchConfig)
    run: RunConfig = part(RunConfig)

    def __post_init__(self) -> None:
        """What concerns two components (each checked its own settings as it was made)."""
        schedule = self.shard_schedule
        for name in ("follow", "shard_schedule"):
            if getattr(schedule, name):
                require(schedule, name, self.data.shards is not None, "needs --shards: the range of shards to train on")
                require(
                    schedule,
                    name,
                    self.run.max_steps is not None,
                    "needs --max-steps: an epoch's size is not known "
                    "before its shards are committed, so the step budget cannot come from --epochs",
                )
        if self.drafter.init_from is None:  # with --init-from the checkpoint's block size decides (LossPlan.of)
            slot_gamma(self.loss, self.loss.block_size)  # a block size without a default gamma needs --gamma

    @classmethod
    def of(cls, **settings) -> TrainConfig:
        """From flat settings, e.g. TrainConfig.of(lr=3e-4, anchors=64), or a run's record (`record`);
        a setting left out takes its default."""
        return build(cls, settings)

    def record(self) -> dict:
        """{setting: value} of every component, flat: what a run records (OUT/step-N/trainer_state.json,
        a drafter's config.json train_config) and a resumed run is compared with."""
        return flat(self)
