"""The table of hidden formats (store/format/hidden_formats.py): each record agrees with what stores record
(compat, the zarr codec id in a shard's metadata), its rounding and codec chain do what it says, and
an unknown format is refused naming the field. The layout read from a root (store/format/read_checks.py)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from store.errors import ConfigError, StoreMismatch
from store.format import hidden_formats
from store.hidden_store import HiddenStore
from store.store_writer import StoreWriter

DATA = Path(__file__).resolve().parents[2] / "data"


def state_codec_id(store: Path) -> str:
    meta = json.loads((store / "shards" / "00000" / "hidden" / "zarr.json").read_text())
    return meta["codecs"][0]["configuration"]["codecs"][1]["name"]  # sharding's inner chain: bytes, ours, crc32c


def test_each_record_is_what_its_stores_record(small_store, fp8_store):
    for path, fmt in (
        (small_store, hidden_formats.BF16),
        (fp8_store, hidden_formats.FP8),
        (DATA / "rev4_store", hidden_formats.BF16),
    ):
        store = HiddenStore(str(path))
        compat = store.attrs.compat
        assert (compat.hidden_format, compat.codec) == (fmt.recorded, fmt.codec), path
        assert compat.format is fmt and store.layout.format is fmt and store.layout.format_coded, path
        assert state_codec_id(path) == fmt.codec_class.name, path
    assert [hidden_formats.of(n) for n in hidden_formats.NAMES] == [hidden_formats.BF16, hidden_formats.FP8]
    assert hidden_formats.BF16.recorded is None  # absent, as in the stores made before fp8 existed


def test_rounding_and_stored_fraction():
    x = torch.randn(6, 3, 64).to(torch.bfloat16)
    assert hidden_formats.BF16.round(x) is x
    fp8 = hidden_formats.FP8.round(x)
    assert not torch.equal(fp8, x) and torch.equal(hidden_formats.FP8.round(fp8), fp8)  # rounded once, then kept
    assert hidden_formats.FP8.stored_fraction < hidden_formats.BF16.stored_fraction < 1
    for fmt in hidden_formats.FORMATS.values():
        inner, crc = fmt.codecs(1, 64)
        assert isinstance(inner, fmt.codec_class) and crc.to_dict()["name"] == "crc32c"


def test_an_unknown_format_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="--hidden-format fp4: expected one of bf16, fp8"):
        hidden_formats.of("fp4")


def test_the_layout_of_older_stores():
    """schema 1 and --codec blosc: bf16 states, not coded by the format's codec, read-only."""
    for name, schema, revision in (("schema1_store", 1, 1), ("blosc_store", 2, 3)):
        shape = HiddenStore(str(DATA / name)).layout
        assert (shape.schema, shape.format, shape.codec) == (schema, hidden_formats.BF16, "blosc"), name
        assert not shape.format_coded and not shape.writable and shape.revision == revision, name
    new = HiddenStore(str(DATA / "rev4_store")).layout
    assert new.writable and (new.schema, new.revision, new.codec) == (2, 4, "planes")


def test_a_store_that_records_its_conv1d_kernel_refuses_a_run_with_the_other(small_store, tmp_path):
    """A node without causal_conv1d may not add shards to a store made with it (and the other way
    round), named in one line; a store made before the kernel was recorded takes either."""
    import shutil

    shutil.copytree(small_store, tmp_path / "s.zarr")
    store = StoreWriter(str(tmp_path / "s.zarr"))
    compat = store.attrs.compat
    assert compat.conv1d == "torch"
    store.check_compatible(compat)
    with pytest.raises(
        StoreMismatch,
        match='conv1d: store has "torch", this run has "causal_conv1d".*made with the '
        "torch conv1d kernel: add shards from a node that runs it",
    ):
        store.check_compatible(dataclasses.replace(compat, conv1d="causal_conv1d"))
    shutil.copytree(DATA / "rev4_store", tmp_path / "old.zarr")
    old = StoreWriter(str(tmp_path / "old.zarr"))
    for kernel in ("torch", "causal_conv1d"):
        old.check_compatible(dataclasses.replace(old.attrs.compat, conv1d=kernel))
