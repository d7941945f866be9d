"""The drafter's configuration, and its `config.json` in the public DFlash layout.

Released DFlash drafters are Hugging Face style: a Qwen3 config (`model_type` qwen3,
architectures `["DFlashDraftModel"]`) with a `dflash_config` block that holds `mask_token_id`
and `target_layer_ids`; `block_size` may sit at the top level or in `dflash_config`. We write
both places and read either.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.errors import DrafterError
from store.errors import ConfigError
from store.format.schema import StoreAttrs, from_json, to_json

ARCHITECTURE = "DFlashDraftModel"
DSPARK_ARCHITECTURE = "Qwen3DSparkModel"  # vLLM 0.32's DSpark drafter on the DFlash backbone (head "dspark")
HEADS = ("dflash", "dspark")  # dspark: + a low-rank Markov transition head and a confidence head (dspark.py)
MARKOV_RANK = 256  # the Markov head's rank r when none is given
LAYER_TYPES = ("full_attention", "sliding_attention")
OUR_KEY = "dflash_pipeline"  # config.json key for what we add (store fingerprint, shards)
GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # SPEC §2: loss decay per block size
# The anchor rules (blocks.py) and loss normalisations (loss.py), named here with gamma: training's config
# imports them without torch
ANCHOR_RULES = ("pair", "single")  # pair: loss_mask[a] and loss_mask[a+1] (SPEC); single: loss_mask[a]
NORMS = ("weights", "labels")  # what the weighted CE of a micro-batch is divided by
SOFT_TARGETS = ("none", "kl", "tv", "accept")  # --soft-targets: terms toward the target's p (soft_targets.py)
BLOCK_SIZE = 16  # released drafters' block size: the default for training and for configs without one
ROPE_THETA = 1e6  # Qwen3's RoPE base: the default when neither flags nor a config give one
NUM_LAYERS = 5  # drafter layers of the released drafters, and of a new one unless told otherwise


@dataclass(frozen=True, kw_only=True)
class TrainingRecord:
    """What this project adds to a drafter's config.json, under OUR_KEY: the store it was trained on
    and how. Released checkpoints have none."""

    store_fingerprint: str
    train_shards: str
    eval_shards: str  # "" when no shard was held out
    step: int
    epochs: float | None = None  # epochs made by `step` (stages/train/position.py); None: recorded before it was
    store: str | None = None
    store_taps: tuple[int, ...] | None = None
    train_config: dict | None = None  # the TrainConfig of the run, as a record
    store_conditioning: str | None = None  # Compat.conditioning() of the store (None: recorded before it existed)
    store_placement: str | None = (
        None  # Compat.placement() of the store: which rows its shards hold (None: not recorded)
    )


def architecture(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING) -> dataclasses.Field:
    """A DrafterConfig field of the architecture: what a new drafter takes from a --drafter-config
    (the store gives the rest: sizes it must match, taps, vocabulary, mask token)."""
    return field(default=default, default_factory=default_factory, metadata={"architecture": True})


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int = architecture()
    num_hidden_layers: int = architecture()
    num_attention_heads: int = architecture()
    num_key_value_heads: int = architecture()
    head_dim: int = architecture()
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # None when a released config does not say
    layer_types: tuple[str, ...] = architecture()
    sliding_window: int | None = architecture(None)
    is_causal: bool | None = architecture(None)  # None: sliding layers causal, full layers bidirectional
    rms_norm_eps: float = architecture(1e-6)
    rope_parameters: dict = architecture(default_factory=lambda: DrafterConfig.default_rope())
    max_position_embeddings: int = architecture(40960)
    input_embedding_scale: float = architecture(1.0)
    head: str = architecture("dflash")  # HEADS
    markov_rank: int = architecture(MARKOV_RANK)  # the dspark head's rank r (unused by dflash)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(t) for t in self.target_layer_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise DrafterError(f"drafter config: {what}")

        need(self.num_hidden_layers >= 1, f"num_hidden_layers {self.num_hidden_layers} must be at least 1")
        need(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
        )
        need(set(self.layer_types) <= set(LAYER_TYPES), f"layer_types {list(self.layer_types)}: expected {LAYER_TYPES}")
        need(
            "sliding_attention" not in self.layer_types or (self.sliding_window or 0) >= 1,
            "sliding_attention layers need sliding_window >= 1",
        )
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
            f"{self.num_key_value_heads}",
        )
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even (RoPE)")
        need(self.block_size >= 2, f"block_size {self.block_size} must be at least 2")
        need(
            0 <= self.mask_token_id < self.vocab_size,
            f"mask_token_id {self.mask_token_id} is outside the vocabulary (0-{self.vocab_size - 1})",
        )
        need(len(self.target_layer_ids) >= 1, "target_layer_ids is empty")
        need(self.head in HEADS, f"head {self.head!r}: expected one of {HEADS}")
        need(self.markov_rank >= 1, f"markov_rank {self.markov_rank} must be at least 1")

    @staticmethod
    def default_rope() -> dict:
        return {"rope_type": "default", "rope_theta": ROPE_THETA}

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_rule(self, i: int) -> tuple[bool, int | None]:
        """(causal, window) of layer i, the rule the reference inference code applies."""
        sliding = self.layer_types[i] == "sliding_attention"
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return causal, (self.sliding_window if sliding else None)

    # -- config.json ---------------------------------------------------------------------
    def to_hf(self, record: TrainingRecord | None = None) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["layer_types"] = list(self.layer_types)
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            **{k: v for k, v in d.items() if k not in _NOT_WRITTEN and v is not None},
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.input_embedding_scale != 1.0:  # written only when it matters: no serving consumer applies it
            out["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        out.update(legacy_rope(self.rope_parameters))  # for loaders that read the v4 fields
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.head == "dspark":
            out.update(dspark_fields(self.markov_rank))
        if record is not None:
            out[OUR_KEY] = to_json(record)
        return out

    @classmethod
    def from_hf(cls, d: dict, where: str = "config.json") -> "DrafterConfig":
        arch = d.get("architectures") or [ARCHITECTURE]
        if arch[0] not in (ARCHITECTURE, DSPARK_ARCHITECTURE):
            raise DrafterError(
                f"{where}: architectures {arch}: only {ARCHITECTURE} and {DSPARK_ARCHITECTURE} are supported"
            )
        if arch[0] == DSPARK_ARCHITECTURE:
            check_dspark(d, where)
        if d.get("attention_bias"):
            raise DrafterError(f"{where}: attention_bias true is not supported (released drafters have none)")
        dflash = d.get("dflash_config") or {}

        def get(name, default=KeyError, *, inner=False):
            for src in (dflash, d) if inner else (d, dflash):
                if name in src and src[name] is not None:
                    return src[name]
            if default is KeyError:
                raise DrafterError(f"{where}: missing field {name!r}")
            return default

        layers = int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        default = _defaults(cls)
        return cls(
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", int(get("hidden_size")) // heads)),
            vocab_size=int(get("vocab_size")),
            block_size=int(get("block_size", BLOCK_SIZE, inner=True)),
            mask_token_id=int(get("mask_token_id", inner=True)),
            target_layer_ids=tuple(get("target_layer_ids", inner=True)),
            num_target_layers=get("num_target_layers", None),
            layer_types=tuple(get("layer_types", ["full_attention"] * layers)),
            sliding_window=get("sliding_window", None),
            is_causal=get("is_causal", None),
            rms_norm_eps=float(get("rms_norm_eps", default["rms_norm_eps"])),
            rope_parameters=_rope(d),
            max_position_embeddings=int(get("max_position_embeddings", default["max_position_embeddings"])),
            input_embedding_scale=float(get("input_embedding_scale", default["input_embedding_scale"], inner=True)),
            head="dspark" if arch[0] == DSPARK_ARCHITECTURE else "dflash",
            markov_rank=int(get("markov_rank", default["markov_rank"])),
        )


_NOT_WRITTEN = ("is_causal", "input_embedding_scale", "head", "markov_rank")  # written their own way


def dspark_fields(rank: int) -> dict:
    """The config.json fields vLLM 0.32's Qwen3DSparkModel reads beside the DFlash ones: the Markov
    head's rank, a confidence head over [hidden, Markov embedding], and the DFlash block layout
    (anchor, then B-1 masks predicted at their own positions: sample_from_anchor false)."""
    return {
        "architectures": [DSPARK_ARCHITECTURE],
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": False,
    }


def check_dspark(d: dict, where: str) -> None:
    """A Qwen3DSparkModel config.json is ours to read only in the layout dspark_fields writes."""
    rank = d.get("markov_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise DrafterError(f"{where}: markov_rank is {rank!r}, expected a positive integer")
    want = dspark_fields(rank)
    for name in ("markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        if d.get(name) != want[name]:
            raise DrafterError(f"{where}: {name} is {d.get(name)!r}, expected {want[name]!r} (the layout written here)")
    anchor = d.get("sample_from_anchor", True)  # vLLM's default: the anchor predicts slot 1
    if anchor is not False:
        raise DrafterError(f"{where}: sample_from_anchor is {anchor!r}, expected False (the DFlash block layout)")


def architecture_fields() -> tuple[str, ...]:
    """The DrafterConfig fields declared with `architecture()`, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(DrafterConfig) if f.metadata.get("architecture"))


def _defaults(cls) -> dict:
    """The dataclass defaults of cls, by field name (so a reader never restates them)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def legacy_rope(rope: dict) -> dict:
    """The transformers v4 fields of rope_parameters, for older readers: rope_theta always;
    partial_rotary_factor when not 1; rope_scaling (with both `rope_type` and v4's `type`) for a
    scaled type."""
    out = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {}
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    kind = rope.get("rope_type", "default")
    if kind != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        out["rope_scaling"] = {**scaling, "type": kind}
    return out


def _rope(d: dict) -> dict:
    """rope_parameters (transformers v5) or the v4 fields rope_theta / rope_scaling / partial_rotary_factor."""
    rope = dict(d.get("rope_parameters") or {})
    if not rope:
        rope = dict(d.get("rope_scaling") or {})
        if "type" in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_theta", float(d.get("rope_theta", ROPE_THETA)))
        if "partial_rotary_factor" in d:
            rope.setdefault("partial_rotary_factor", d["partial_rotary_factor"])
    rope.setdefault("rope_type", "default")
    return rope


def store_mismatches(config: DrafterConfig, attrs: StoreAttrs) -> dict[str, tuple]:
    """What differs between a drafter and a store: {field: (drafter's, store's)} for taps, number of
    taps, hidden size, vocabulary and mask token."""
    pairs = {
        "taps": (list(config.target_layer_ids), list(attrs.taps)),
        "num_taps": (config.num_taps, len(attrs.taps)),
        "hidden_size": (config.hidden_size, attrs.hidden_size),
        "vocab_size": (config.vocab_size, attrs.vocab_size),
        "mask_token_id": (config.mask_token_id, attrs.mask_token_id),
    }
    return {k: v for k, v in pairs.items() if v[0] != v[1]}


def read_config(directory: str | Path) -> tuple[DrafterConfig, TrainingRecord | None]:
    """(config, our training record or None) from DIR/config.json (or a config file itself)."""
    path = Path(directory)
    path = path if path.is_file() else path / "config.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise DrafterError(f"{path}: no such file (not a drafter checkpoint directory)") from None
    except PermissionError:
        raise DrafterError(
            f"{path}: permission denied: this user cannot read it; its owner can make it readable (chmod a+r)"
        ) from None
    except ValueError as e:
        raise DrafterError(f"{path}: not valid JSON ({e})") from None
    record = from_json(TrainingRecord, d[OUR_KEY], f"{path}: {OUR_KEY}", DrafterError) if d.get(OUR_KEY) else None
    return DrafterConfig.from_hf(d, str(path)), record


def default_gamma(block_size: int) -> float:
    if block_size not in GAMMA:
        raise ConfigError(
            "--block-size", block_size, f"no default loss decay for this size (known: {sorted(GAMMA)}); pass --gamma"
        )
    return GAMMA[block_size]


def default_sizes(hidden_size: int) -> dict:
    """Drafter sizes that suit a target of this hidden size (Qwen3-like proportions).

    5120 gives the released Qwen3.6-27B drafter's 17408 intermediate and head_dim 128; small
    targets get head_dim hidden/4 so the shipped tiny target's drafter trains on CPU in minutes.
    """
    head_dim = 128 if hidden_size >= 1024 else max(8, hidden_size // 4)
    heads = max(1, hidden_size // head_dim)
    if hidden_size >= 4096:
        heads = 32  # the released large drafters: 32 q heads, 8 kv heads
    return {
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": head_dim,
        "intermediate_size": int(round(hidden_size * 3.4 / 64)) * 64,
    }
