"""What a store records about how it was made: the root attributes of a new store, built from the
extraction settings, the loaded target and the prompt set (the record is store/format/schema.py's)."""

from __future__ import annotations

import sys
from dataclasses import asdict

from pipeline import fingerprint
from pipeline.prompts import PromptSet
from pipeline.reference_server import ServerInfo, redact
from pipeline.target.model import Target
from stages.extract.config import ExtractConfig
from store.format import hidden_formats, layout
from store.format.schema import (
    FORMAT_REVISION,
    SCHEMA_VERSION,
    Backends,
    Compat,
    DatasetRecord,
    LayoutRecord,
    StoreAttrs,
    to_json,
)

PACKAGES = ("torch", "transformers", "flash-linear-attention", "triton", "zarr", "numcodecs", "dflash-pipeline")


def store_attrs(
    config: ExtractConfig,
    target: Target,
    taps: list[int],
    mask_id: int,
    num_shards: int,
    prompt_set: PromptSet,
    backends: Backends,
    engine: ServerInfo | None,
    capture: dict | None = None,
) -> StoreAttrs:
    """capture: the engine that computed the states (`VllmCapture.record`), None for the target loaded here."""
    described = prompt_set.describe()
    hidden_format = hidden_formats.of(config.hidden_format)
    compat = Compat(
        schema_version=SCHEMA_VERSION,
        target_fingerprint=target.record.fingerprint,
        model_class=target.record.model_class,
        tokenizer_sha256=target.record.tokenizer_sha256,
        chat_template_sha256=target.record.chat_template_sha256,
        taps=tuple(taps),
        mask_token_id=mask_id,
        dataset_sha256=prompt_set.sha256,
        dataset_rows=len(prompt_set),
        dataset_fields=described["fields"],
        responses=config.responses,
        max_new_tokens=config.max_new_tokens,
        max_length=config.max_length,
        dtype=config.dtype,
        device_type=target.device.type,
        linear_attention=backends.linear_attention,
        attention=backends.attention,
        num_shards=num_shards,
        chunk_tokens=config.chunk_tokens,
        shard_tokens=config.shard_tokens,
        compression_level=config.compression_level,
        codec=hidden_format.codec,
        hidden_format=hidden_format.recorded,
        conv1d=backends.conv1d,
        references=references(config, engine, capture),
        turns=None if config.turns == "last" else config.turns,
        chat_template_kwargs=config.template_args() or None,
        capture=capture,
        final_state=config.final_state or None,
        sampling=config.sampling(),
    )
    return StoreAttrs(
        fingerprint=fingerprint.sha256_json(to_json(compat)),
        compat=compat,
        extract={
            **asdict(config),
            "server_url": redact(config.server_url) if config.server_url else None,
            "num_shards": num_shards,
        },
        taps=tuple(taps),
        num_layers=target.num_layers,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        mask_token_id=mask_id,
        eos_token_ids=tuple(target.eos_ids),
        pad_token_id=target.pad_id,
        num_shards=num_shards,
        hidden_dtype=layout.HIDDEN_DTYPE,
        target=target.record,
        dataset=DatasetRecord(**described, split=config.split),
        backends=backends,
        device=str(target.device),
        dtype=config.dtype,
        layout=LayoutRecord(
            chunk_tokens=config.chunk_tokens,
            shard_tokens=config.shard_tokens,
            compressor=[c.to_dict() for c in hidden_format.codecs(config.compression_level, target.hidden_size)],
        ),
        versions=versions(),
        engine=asdict(engine) if engine else None,
        format_revision=FORMAT_REVISION,
    )


def references(config: ExtractConfig, engine: ServerInfo | None, capture: dict | None) -> str | None:
    """The engine that made the references when not the target loaded here: the server's identity,
    or the capturing engine's with --capture vllm --responses regenerate; None otherwise."""
    if engine is not None:
        return engine.identity
    if capture is not None and config.responses == "regenerate":
        return f"{capture['engine']} {capture['version']} (the capturing engine)"
    return None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out
