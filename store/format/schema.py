"""The store's records, typed: the root attributes (`StoreAttrs`) and each shard's commit file
(`ShardCommit`). Extraction builds them, every reader gets them from `HiddenStore`; nothing else
reads these JSON keys. The JSON is documented in docs/store.md. Fields added after format revision 1
(store/format/read_checks.py) have the default None, meaning "not recorded", and are left out of
the JSON while None, so older stores load as they are and write back unchanged. Schema 2 (the
byte-plane layout) is `SCHEMA_VERSION`; schema-1 stores are read-only
(`StoreWriter.check_compatible`). What layout a store has, read from these records once, is
store/format/read_checks.py's `Layout`; its hidden format, store/format/hidden_formats.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from dataclasses import dataclass

from store.errors import NotAStore, StoreCorrupt
from store.format import hidden_formats
from store.format.hidden_formats import HiddenFormat

KIND = "dflash-hidden-states"
SCHEMA_VERSION = 2  # 2: byte-plane codec with a checksum per chunk (1: blosc, read-only now)
FORMAT_REVISION = (
    5  # what this version writes; the revisions, and what each lets a reader check: store/format/read_checks.py
)
TAP_MEANING = "tap k = output of decoder layer k (0-based) = Hugging Face hidden_states[k+1]"


def completion_limit(max_new_tokens: int, max_length: int, prompt_len: int) -> int:
    """THE completion length rule: max_new_tokens, within max_length tokens in all."""
    return min(max_new_tokens, max_length - prompt_len)


# The roles a Compat field may have (`role`): "conditioning", the settings that decide what state a
# token gets (the target, how it ran, where the taps are, the token space, and the hidden format, since
# fp8 rounds every state): two stores that agree on them condition a drafter alike, whatever their data,
# template, lengths, responses or lossless codec; "placement", the settings that decide which rows shard
# s holds (pipeline/prompts.py: rows [s*N//K, (s+1)*N//K) of the dataset): stores that agree on them
# number the same prompts alike, whatever their conditioning. Each has its digest (`Compat.conditioning`,
# `Compat.placement`), which checkpoints record.
ROLES = ("conditioning", "placement")


def role(name: str, default=dataclasses.MISSING):
    """A Compat field whose value is part of the digest of role `name` (ROLES)."""
    assert name in ROLES, name
    return dataclasses.field(default=default, metadata={"role": name})


def with_role(cls, name: str) -> tuple[str, ...]:
    """The fields of record `cls` with role `name`, in their order."""
    assert name in ROLES, name
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("role") == name)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How sampled references were drawn (`--temperature` > 0; a greedy store records none): each
    row's tokens from the target's distribution at `temperature`, cut to the `top_k` most likely
    and then to the nucleus of mass `top_p` (None: not cut), with the row's own seed derived from
    `seed` and its dataset row (pipeline/sampling.py)."""

    temperature: float
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0

    def describe(self) -> str:
        """'temperature 0.7, top-p 0.95, top-k 20, seed 0' (a cut not made is left out)."""
        parts = [f"temperature {self.temperature:g}"]
        if self.top_p is not None:
            parts.append(f"top-p {self.top_p:g}")
        if self.top_k is not None:
            parts.append(f"top-k {self.top_k}")
        return ", ".join([*parts, f"seed {self.seed}"])


@dataclass(frozen=True, kw_only=True)
class Compat:
    """Every setting a shard's content depends on. Runs that differ in any of them may not add
    shards to the same store; the store's fingerprint is the hash of this record. Fields with a
    role (`role`) are also part of that role's digest."""

    schema_version: int
    target_fingerprint: str = role("conditioning")
    model_class: str = role("conditioning")
    tokenizer_sha256: str = role("conditioning")
    chat_template_sha256: str
    taps: tuple[int, ...] = role("conditioning")
    mask_token_id: int = role("conditioning")
    dataset_sha256: str = role("placement")
    dataset_rows: int = role("placement")
    dataset_fields: dict
    responses: str
    max_new_tokens: int
    max_length: int
    dtype: str = role("conditioning")
    device_type: str = role("conditioning")
    linear_attention: str = role("conditioning")
    attention: str | None = role("conditioning")
    num_shards: int = role("placement")
    chunk_tokens: int
    shard_tokens: int
    compression_level: int
    # the engine behind --responses server ("vllm 0.32.0 MODEL"), or the capturing one with --capture vllm
    # --responses regenerate ("vllm 0.32.0 (the capturing engine)"); None: the target loaded here or the dataset
    references: str | None = None
    turns: str | None = (
        None  # "all": earlier assistant turns carry the loss too; "split": a sample per turn (None: last)
    )
    codec: str | None = None  # the states' codec (store/format/hidden_formats.py); None in schema 1: blosc
    chat_template_kwargs: dict | None = None  # --chat-template-kwargs (None: none given)
    # "fp8": states rounded to e4m3 x 2^k per token and tap (None: bf16, as captured; store/format/hidden_formats.py)
    hidden_format: str | None = role("conditioning", default=None)
    # The conv1d kernel of the target's linear-attention layers, as observed ("causal_conv1d", "torch",
    # "none", "mixed": Backends.conv1d); None: not recorded (stores made before it was).
    conv1d: str | None = role("conditioning", default=None)
    # What computed the states when not the target loaded in-process (`--capture vllm`): {"engine": "vllm",
    # "version", "dtype", "tensor_parallel", "pipeline_parallel", "quantization" (the engine's, None:
    # none), "checkpoint_quantization" (the checkpoint's method, None: none), "kernels" ({"attention",
    # "linear"}: names the engine's workers report), "layer_ids": the engine's ids of the taps}, as the
    # started engine reports them; None: transformers in the extracting process.
    capture: dict | None = role("conditioning", default=None)
    # True: every shard stores the target's state after its final norm, per token (`final_state`, [T, H], in
    # the hidden format: pipeline extract --final-state); None: not stored (every store made before it could
    # be). No role: the tap states are the same either way, so a drafter replays stores with and without it.
    final_state: bool | None = None
    # Sampled references (`--temperature` > 0): how they were drawn; None: greedy (every store made before
    # it was recorded). Not conditioning: it decides which tokens are stored, not the state a token gets.
    sampling: Sampling | None = None

    @property
    def format(self) -> HiddenFormat:
        """The hidden format of the states (store/format/hidden_formats.py)."""
        return hidden_formats.of_recorded(self.hidden_format, "compat")

    def conditioning(self) -> str:
        """SHA-256 of the settings that decide what state a token gets (CONDITIONING), not which
        tokens are stored: stores that share it can be replayed by each other's drafters."""
        return self._digest(CONDITIONING)

    def placement(self) -> str:
        """SHA-256 of the settings that decide which dataset rows each shard holds (PLACEMENT): stores
        that share it hold the same prompts under the same shard numbers, whatever their target or format."""
        return self._digest(PLACEMENT)

    def _digest(self, fields: tuple[str, ...]) -> str:
        """SHA-256 of these fields' values, as canonical JSON (a field not recorded is left out)."""
        body = {k: v for k, v in to_json(self).items() if k in fields}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def as_format(self, name: str) -> Compat:
        """These settings with the states in hidden format `name` ("bf16" or "fp8")."""
        return dataclasses.replace(self, hidden_format=hidden_formats.of(name).recorded)

    def completion_limit(self, prompt_len: int) -> int:
        """The completion length these settings allow after a prompt of prompt_len tokens."""
        return completion_limit(self.max_new_tokens, self.max_length, prompt_len)

    def differences(self, other: Compat) -> dict[str, tuple]:
        """{field: (mine, theirs)} for every field that differs."""
        a, b = to_json(self), to_json(other)
        return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


CONDITIONING = with_role(Compat, "conditioning")
PLACEMENT = with_role(Compat, "placement")


@dataclass(frozen=True, kw_only=True)
class TargetRecord:
    """Which target made the states: where it was, its class, and hashes of what it is."""

    path: str
    model_class: str
    model_type: str
    fingerprint: str
    config_sha256: str
    weights_sha256: dict  # file name -> SHA-256
    tokenizer_sha256: str
    chat_template_sha256: str
    # The tokenizer class transformers actually built (for qwen3_5 checkpoints its own, whatever
    # tokenizer_class says), and the checkpoint tensors the text model knowingly leaves unused
    # ({pattern: count}: vision tower, MTP heads); None in some revision-1 stores.
    tokenizer_class: str | None = None
    non_text_tensors: dict | None = None
    # The target's context length, which a drafter's config.json carries for serving engines to size
    # its rotary cache (None in revision-1 stores and some of revision 2).
    max_position_embeddings: int | None = None
    # The kind of each layer ("full_attention", "linear_attention", ...) and the KV layout of the
    # full-attention layers, which vLLM caches a drafter's layers beside (None in revision-1 stores and
    # some of revision 2).
    layer_types: tuple[str, ...] | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True, kw_only=True)
class Backends:
    """The kernels that actually ran (observed, not requested)."""

    linear_attention: str  # "fla", "torch", "mixed" or "none"
    conv1d: str
    linear_attention_requested: str
    attention: str | None
    kernel_calls: dict  # "function:family" -> calls
    # How fla's Triton kernels ran: "interpreter" (TRITON_INTERPRET=1: their code on CPU tensors, not
    # a GPU) or "compiled"; None when none ran (and in stores written before this was recorded).
    triton: str | None = None


@dataclass(frozen=True, kw_only=True)
class DatasetRecord:
    source: str
    rows: int
    sha256: str
    fields: dict  # which dataset fields hold messages, prompt, response
    split: str


@dataclass(frozen=True, kw_only=True)
class LayoutRecord:
    chunk_tokens: int
    shard_tokens: int
    compressor: dict | list  # the states' codec chain, as zarr writes it (schema 1: one codec)


@dataclass(frozen=True, kw_only=True)
class StoreAttrs:
    """The root attributes: what the store holds and exactly how it was made."""

    kind: str = KIND
    schema_version: int = SCHEMA_VERSION
    fingerprint: str  # SHA-256 of `compat`
    compat: Compat
    extract: dict  # the extraction settings as run (a record, not read back)
    taps: tuple[int, ...]
    tap_meaning: str = TAP_MEANING
    num_layers: int
    hidden_size: int
    vocab_size: int
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    num_shards: int
    hidden_dtype: str  # what the uint16 bits of `hidden` mean
    target: TargetRecord
    dataset: DatasetRecord
    backends: Backends
    device: str
    dtype: str
    layout: LayoutRecord
    versions: dict  # package -> version
    engine: dict | None = None  # --responses server: url (no credentials), model, engine, version
    format_revision: int | None = None  # FORMAT_REVISION of the writer that made the root (None: before revision 4)

    @classmethod
    def from_json(cls, d: dict, where: str) -> StoreAttrs:
        if d.get("kind") != KIND:
            raise NotAStore(f"{where}: not a hidden-state store (root kind {d.get('kind')!r}, expected {KIND!r})")
        if d.get("schema_version", 0) > SCHEMA_VERSION:
            raise NotAStore(
                f"{where}: store schema {d['schema_version']} is newer than this tool's "
                f"({SCHEMA_VERSION}); upgrade dflash-pipeline"
            )
        attrs = from_json(cls, d, f"{where}: root attributes", NotAStore)
        hidden_formats.of_recorded(attrs.compat.hidden_format, f"{where}: root attributes")  # one this version reads
        return attrs


@dataclass(frozen=True, kw_only=True)
class ShardCommit:
    """A shard's commit file, written last: its counts, array shapes and checksums, plus `run`,
    the extractor's notes (host, pid, device, backends, timing), which sit at the top level of
    the JSON beside the fields above."""

    shard: int
    samples: int
    tokens: int
    completion_tokens: int
    skipped: dict  # reason -> rows
    truncated: int  # completions cut at the length limit without an EOS
    shapes: dict  # array name -> shape
    checksums: dict  # array name -> CRC-32 of its C-order bytes; "algorithm" says so
    writer: dict  # the writer thread's timing
    # {"matches", "tokens"}: completion tokens equal to the target's own argmax at the position
    # before (None: not checked, or not recorded: some revision-1 stores)
    agreement: dict | None = None
    # {"shard": all of the shard's files, "hidden": its states} in bytes, measured once at commit
    # (None: not recorded, in some revision-2 stores and all of revision 1; `pipeline info` then walks the files)
    bytes: dict | None = None
    # From format revision 3 (None in shards committed before): the CRC-32 of each metadata file of
    # the shard, by path inside it ("zarr.json", "hidden/zarr.json", ...), and whether every chunk
    # file was written, all-fill-value chunks included, so that a missing chunk file is damage
    # rather than zeros.
    metadata: dict | None = None
    every_chunk: bool | None = None
    # --category-field: {"labels": the distinct labels, "codes": per sample (in sample order) the index of its
    # label}; None when no category field was given
    categories: dict | None = None
    # From format revision 5 (None before): the separator of the shard's chunk keys, "." (c.K.0.0: no
    # directory per key level); None: "/" (zarr's default, c/K/0/0). Its arrays' metadata says the same;
    # this lets a reader name a chunk file before it holds the metadata (store/format/layout.py chunk_key).
    chunk_separator: str | None = None
    # --final-state: the extraction's check of the stored final states ({"matches", "tokens"}: completion
    # tokens equal to the argmax of lm_head(stored final state) at the position before; {"normed",
    # "states"}: stored states of unit RMS under the target's final-norm gain); None: none stored
    final_state: dict | None = None
    run: dict = dataclasses.field(default_factory=dict)

    def category(self, index: int) -> str | None:
        """Sample `index`'s label (None: the shard records none)."""
        return None if self.categories is None else self.categories["labels"][self.categories["codes"][index]]

    def to_json(self) -> dict:
        d = to_json(self)
        return {**d.pop("run"), **d}

    @classmethod
    def from_json(cls, d: dict, where: str) -> ShardCommit:
        names = {f.name for f in dataclasses.fields(cls)} - {"run"}
        return from_json(
            cls,
            {**{k: v for k, v in d.items() if k in names}, "run": {k: v for k, v in d.items() if k not in names}},
            where,
            StoreCorrupt,
        )


@dataclass(frozen=True, kw_only=True)
class RootCommit:
    """The root's commit file, written last when the root is complete."""

    time: float
    host: str
    fingerprint: str  # the root attributes' fingerprint, repeated: the two must agree
    checksums: dict  # "embed_tokens", "lm_head" -> CRC-32 of the array's C-order bytes
    metadata: dict | None = None  # CRC-32 of each root metadata file (the attributes among them); from revision 3

    @classmethod
    def from_json(cls, d: dict, where: str) -> RootCommit:
        return from_json(cls, d, where, StoreCorrupt)


def to_json(record) -> dict:
    """A record as plain JSON types (tuples become lists); fields that are None where None is their
    default (added after revision 1, not recorded) are left out."""
    return {
        f.name: _plain(getattr(record, f.name))
        for f in dataclasses.fields(record)
        if not (f.default is None and getattr(record, f.name) is None)
    }


def _plain(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_json(v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def from_json(cls, d: dict, where: str, error: type[Exception]):
    """Build record `cls` from JSON `d`: every field without a default must be there; nested
    records and tuples are rebuilt; keys the record does not know are ignored."""
    if not isinstance(d, dict):
        raise error(f"{where}: expected an object, found {type(d).__name__}")
    hints = _hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{where}: missing field {f.name!r}")
            continue
        kind, v = _non_none(hints[f.name]), d[f.name]
        if v is not None and dataclasses.is_dataclass(kind):
            v = from_json(kind, v, f"{where}.{f.name}", error)
        elif v is not None and typing.get_origin(kind) is tuple:
            v = tuple(v)
        values[f.name] = v
    return cls(**values)


@functools.cache
def _hints(cls) -> dict:
    """The record's resolved field types (resolving them costs ~0.7 ms: thousands of commit files)."""
    return typing.get_type_hints(cls)


def _non_none(hint):
    """X from `X | None`; any other hint as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if isinstance(hint, types.UnionType) and len(args) == 1 else hint
