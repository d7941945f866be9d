"""Damage to any file of a store, of any kind, is never read as data: every reader either returns
exactly what the undamaged store holds, or raises one line naming the damaged file.

Each file of a small extracted store (root metadata and attributes, the embedding and lm_head
chunks, commit files, every array's metadata and chunks, the shard index inside a state file) is
damaged in turn (bytes flipped, cut short, emptied, deleted) and everything training and evaluation
read is read back: the root attributes, the embedding and lm_head, the index file's content (every
commit record and per-sample index), each shard's commit record, per-sample arrays and every
sample's tokens, loss mask and states.
"""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from store import index_file
from store.errors import StoreError
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


def read_everything(location: str, shards: list[int]) -> dict:
    """What training and evaluation read from a store, as plain values."""
    store = HiddenStore(location)
    store.require_committed(shards)
    out = {"attrs": store.attrs, "embed_tokens": store.embedding("embed_tokens"), "lm_head": store.embedding("lm_head")}
    index, _ = index_file.load(store)  # training's start-up: the index file (here, damaged in turn too) or the shards
    out["index"] = [index.records, index.arrays]
    for shard in shards:
        reader = ShardReader(store, shard)
        out[shard] = [reader.record, reader.offsets, reader.prompt_lens, reader.row_ids, reader.first_pairs]
        for i in range(len(reader)):
            s = reader.read(i)
            out[shard] += [reader.tokens(i), s.tokens, s.loss_mask, s.hidden, s.row_id, s.prompt_len]
    return out


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
            b.view(torch.uint8) if b.dtype == torch.bfloat16 else b,
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def files(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() and "_locks" not in p.parts)


def damaged(data: bytes, kind: str) -> bytes | None:
    """data damaged one way (None: the file deleted)."""
    if kind == "flip":
        mid = len(data) // 2
        return data[:mid] + bytes(b ^ 0x5A for b in data[mid : mid + 8]) + data[mid + 8 :]
    if kind == "digit":  # JSON that stays JSON: a count, a shape, a checksum changed
        digits = [i for i, b in enumerate(data) if 48 <= b <= 57]
        if not digits:
            return data
        i = digits[len(digits) // 2]
        return data[:i] + bytes([48 + (data[i] - 47) % 10]) + data[i + 1 :]
    if kind == "flip-end":  # a shard file's index, a chunk's checksum, a JSON file's closing brace
        return data[:-6] + bytes(b ^ 0x5A for b in data[-6:])
    return {"cut": data[: len(data) // 2], "empty": b"", "delete": None}[kind]


def names(message: str, key: str) -> bool:
    """The message names the damaged file, or the array it is a chunk or the metadata of (a deleted
    commit file leaves its shard uncommitted, which is how a crash leaves it: named as such)."""
    array = re.split(r"/c[./]", key)[0]  # a chunk key: c/K/0/0 (before revision 5) or c.K.0.0
    if array.endswith("/zarr.json") and array[: -len("/zarr.json")] in message:
        return True
    uncommitted = key.startswith("_commits/0") and f"shard {int(key[9:14])} is not committed" in message
    return array in message or uncommitted


KINDS = ("flip", "digit", "flip-end", "cut", "empty", "delete")


SCHEMA1 = Path(__file__).parents[1] / "data" / "schema1_store"
REV4 = Path(__file__).parents[1] / "data" / "rev4_store"  # tests/store/test_chunk_keys.py


def unchecked_in_schema1(key: str) -> bool:
    """What schema 1 (no chunk checksums, commit-file seals or metadata checksums) cannot see: a
    per-token chunk changed or gone (the readers' warning says so: `ReadChecks.warning`),
    a root attribute or a commit file's note (a time, a host) changed into another valid value (a
    change to the counts, shapes or checksums contradicts the arrays, and is seen)."""
    return (
        key == "zarr.json"
        or key.startswith("_commits/")
        or any(f"/{name}/c/" in key or f"/{name}/c." in key for name in ("hidden", "tokens", "loss_mask"))
    )


@pytest.mark.parametrize("schema", [2, 1, "2, fp8", "2, revision 4"])
def test_damage_to_any_file_is_an_error_naming_it_or_changes_nothing(request, tmp_path, schema):
    """schema 2 in the layout this revision writes (chunk keys c.K.0.0), and in revision 4's (c/K/0/0)."""
    store = tmp_path / "hs.zarr"
    fixture = {1: SCHEMA1, "2, revision 4": REV4}
    shutil.copytree(
        fixture[schema]
        if schema in fixture
        else request.getfixturevalue("fp8_store" if schema == "2, fp8" else "small_store"),
        store,
    )
    shards = [0, 1] if schema in fixture else [0, 1, 2, 3]
    clean = read_everything(str(store), shards)
    kept, errors, wrong, unseen = [], [], [], []
    # the index file first: damage to a commit file that leaves it readable is a new state, whose
    # index file replaces this one
    for key in sorted(files(store), key=lambda k: not k.startswith(index_file.FOLDER)):
        path = store / key
        original = path.read_bytes()
        for kind in KINDS:
            bad = damaged(original, kind)
            if bad == original:
                continue
            if bad is None:
                path.unlink()
            else:
                path.write_bytes(bad)
            try:
                got = read_everything(str(store), shards)
            except StoreError as e:
                text = str(e)
                if "\n" in text or not names(text, key):
                    wrong.append((key, kind, text))
                errors.append((key, kind))
            except Exception as e:  # noqa: BLE001 - collected: every case is reported at once
                wrong.append((key, kind, f"{type(e).__name__}: {e}"))
            else:
                if not equal(got, clean):
                    (unseen if schema == 1 and unchecked_in_schema1(key) else wrong).append((key, kind, "read as data"))
                kept.append((key, kind))
            finally:
                path.write_bytes(original)
    assert not wrong, "\n".join(map(str, wrong))
    assert equal(read_everything(str(store), shards), clean)
    assert len(errors) > (2 if schema == 1 else 10) * len(kept), kept  # nearly every kind of damage is seen
    assert bool(unseen) == (schema == 1)
