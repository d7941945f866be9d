"""The store's typed records read what earlier versions wrote, and write it back unchanged.

tests/data/schema1/ holds the root attributes and a commit file of a store, and the config.json of
a drafter checkpoint, all written by the code before these records existed (commit 40a4f21:
`pipeline extract --shards 0-1 --max-new-tokens 16 --max-length 200 --dtype fp32`, then
`train.py --max-steps 2 --num-layers 1`)."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline import fingerprint
from pipeline.drafter.config import OUR_KEY, read_config
from store.errors import NotAStore, StoreCorrupt
from store.format import hidden_formats
from store.format.schema import (
    CONDITIONING,
    PLACEMENT,
    Compat,
    Sampling,
    ShardCommit,
    StoreAttrs,
    to_json,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "schema1"
REV4 = DATA.parent / "rev4_store"
# The digests of stores made before the roles and compat.conv1d existed (computed at 38531f2, from
# CONDITIONING and PLACEMENT as hand-kept lists): tests/data/rev4_store, and the conftest's small store
# extracted afresh (its conditioning without the conv1d kernel it now records).
REV4_CONDITIONING = "1387c9ce4dcd3d64c17e246013d53df73ba48aaf8d73c51ae1256af57fb8671a"
REV4_PLACEMENT = "3641cd28f6c85887a5d0f0e1ed38ca7041b69df2e17b65ad2318b98dd23db993"
REV4_FINGERPRINT = "9d9ae5d51a200796add9db8264e4a611e2444fdbcf18052497432f3a3cb363cf"
SMALL_CONDITIONING = REV4_CONDITIONING  # the same target, kernels, taps and token space
SMALL_PLACEMENT = "70e82bbaa929a5124993b7282684839c969ae3e085f8f7eb09afe948e22afa7c"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def test_old_root_attributes_round_trip_exactly():
    old = load("root_attributes.json")
    attrs = StoreAttrs.from_json(old, "old store")
    assert to_json(attrs) == old
    assert attrs.target.tokenizer_class is None and attrs.target.non_text_tensors is None  # not recorded then
    assert attrs.taps == (1, 2, 3, 4, 5) and attrs.compat.taps == attrs.taps and attrs.hidden_size == 128
    assert attrs.target.model_class.endswith("Qwen3_5ForCausalLM") and attrs.backends.linear_attention == "torch"


def test_the_fingerprint_is_the_hash_of_the_compat_record():
    old = load("root_attributes.json")
    attrs = StoreAttrs.from_json(old, "old store")
    assert fingerprint.sha256_json(to_json(attrs.compat)) == old["fingerprint"]
    changed = replace(attrs.compat, max_length=attrs.compat.max_length + 1)
    assert attrs.compat.differences(changed) == {"max_length": (200, 201)}
    assert fingerprint.sha256_json(to_json(changed)) != old["fingerprint"]


def test_the_placement_follows_the_rows_each_shard_holds_not_the_conditioning():
    """Stores of the same dataset and shard count number the same prompts alike (fp8 beside bf16, other
    lengths or kernels); another dataset, row count or shard count does not."""
    compat = StoreAttrs.from_json(load("root_attributes.json"), "old store").compat
    alike = [compat.as_format("fp8"), replace(compat, max_length=compat.max_length + 1, linear_attention="fla")]
    assert {c.placement() for c in alike} == {compat.placement()}
    assert compat.as_format("fp8").conditioning() != compat.conditioning()
    for change in (
        {"dataset_sha256": "0" * 64},
        {"dataset_rows": compat.dataset_rows + 1},
        {"num_shards": compat.num_shards + 1},
    ):
        assert replace(compat, **change).placement() != compat.placement(), change


def test_old_commit_record_round_trips_with_the_extractors_notes():
    old = load("commit_00000.json")
    record = ShardCommit.from_json(old, "commit")
    assert record.to_json() == old and record.agreement is None  # checked since; absent before
    assert record.samples == 10 and set(record.run) == {
        "backends",
        "batch_size",
        "committed_at",
        "device",
        "host",
        "pid",
        "wall_s",
    }


def test_old_checkpoint_provenance_reads():
    cfg = load("checkpoint_config.json")
    config, record = read_config(DATA / "checkpoint_config.json")
    assert record.store_fingerprint == load("root_attributes.json")["fingerprint"]
    assert (record.train_shards, record.eval_shards, record.step) == ("0", "1", 2)
    assert config.to_hf(record)[OUR_KEY] == cfg[OUR_KEY]


@pytest.mark.parametrize(
    "edit,error,needle",
    [
        (lambda d: d.pop("compat"), NotAStore, "missing field 'compat'"),
        (lambda d: d["target"].pop("fingerprint"), NotAStore, "root attributes.target: missing field 'fingerprint'"),
        (lambda d: d.update(kind="something else"), NotAStore, "not a hidden-state store"),
        (lambda d: d.update(schema_version=99), NotAStore, "newer than this tool's"),
    ],
)
def test_unreadable_roots_are_named(edit, error, needle):
    d = load("root_attributes.json")
    edit(d)
    with pytest.raises(error, match=needle):
        StoreAttrs.from_json(d, "old store")


def test_a_commit_record_without_its_counts_is_corrupt(tmp_path, small_store):
    from store.hidden_store import HiddenStore

    copy = tmp_path / "copy.zarr"
    shutil.copytree(small_store, copy)
    path = copy / "_commits" / "00001.json"
    d = json.loads(path.read_text())
    del d["tokens"]
    path.write_text(json.dumps(d))  # still sealed: the edit breaks the seal
    with pytest.raises(StoreCorrupt, match="_commits/00001.json: damaged commit file .* self_crc32"):
        HiddenStore(str(copy)).committed()
    del d["self_crc32"]
    path.write_text(json.dumps(d))  # as a file written before seals: read, and its fields checked
    with pytest.raises(StoreCorrupt, match="_commits/00001.json: missing field 'tokens'"):
        HiddenStore(str(copy)).committed()


def test_a_schema1_store_still_trains_and_evaluates_but_takes_no_new_shards(tmp_path):
    """tests/data/schema1_store: shards 0-1 of 64 written by schema 1 (blosc, no chunk checksums;
    `pipeline extract --shards 0-1 --max-new-tokens 16 --max-length 128 --chunk-tokens 32
    --shard-tokens 64 --dtype fp32` at dcfe32e)."""
    from stages.evaluate.config import EvalConfig
    from stages.evaluate.run import run as evaluate
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run as extract
    from store.errors import StoreMismatch
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader
    from store.verify import verify
    from tests.processes import TINY, train

    path = tmp_path / "v1.zarr"
    shutil.copytree(DATA.parent / "schema1_store", path)
    store = HiddenStore(str(path))
    assert store.attrs.schema_version == 1 and store.attrs.compat.codec is None and verify(store).ok
    assert len(ShardReader(store, 0)[0].tokens) > 0
    r = train(["--store", path, "--out", tmp_path / "run", "--eval-shards", 1, "--max-steps", 2, *TINY])
    assert r.returncode == 0, r.stderr
    unchecked = "is a schema-1 store: its chunks carry no checksums"
    assert unchecked in r.stdout + r.stderr
    report = evaluate(
        EvalConfig(
            store=str(path), checkpoints=(str(tmp_path / "run" / "final"),), out=str(tmp_path / "rep"), ddtree=(4,)
        ),
        log=lambda m: None,
    )
    assert report["checkpoints"][0]["tau"] >= 1 and any(unchecked in w for w in report["warnings"])
    with pytest.raises(StoreMismatch, match="is a schema-1 store .* new shards go into a new store"):
        extract(
            ExtractConfig(
                store=str(path),
                shards="2",
                max_new_tokens=16,
                max_length=128,
                chunk_tokens=32,
                shard_tokens=64,
                dtype="fp32",
                device="cpu",
            ),
            log=lambda m: None,
        )


def test_each_role_names_fields_of_the_record_and_no_field_twice():
    """The roles are read from the fields, so none can name a field that is not there; these are the
    lists they replaced (the conv1d kernel and the capture engine added), so a role dropped or misspelt is seen."""
    assert CONDITIONING == (
        "target_fingerprint",
        "model_class",
        "tokenizer_sha256",
        "taps",
        "mask_token_id",
        "dtype",
        "device_type",
        "linear_attention",
        "attention",
        "hidden_format",
        "conv1d",
        "capture",
    )
    assert PLACEMENT == ("dataset_sha256", "dataset_rows", "num_shards")
    names = {f for f in Compat.__dataclass_fields__}
    assert set(CONDITIONING) <= names and set(PLACEMENT) <= names and not set(CONDITIONING) & set(PLACEMENT)


def test_every_conditioning_field_changes_the_digest_and_no_other_does():
    compat = StoreAttrs.from_json(json.loads((REV4 / "zarr.json").read_text())["attributes"], "rev4").compat
    changed = {f: replace(compat, **{f: "other"}) for f in Compat.__dataclass_fields__ if f != "schema_version"}
    assert {f for f, c in changed.items() if c.conditioning() != compat.conditioning()} == set(CONDITIONING)
    assert {f for f, c in changed.items() if c.placement() != compat.placement()} == set(PLACEMENT)


def test_the_digests_of_existing_stores_are_unchanged(small_store):
    """compat.conv1d, absent from a store made before it was recorded, leaves its digests and its
    fingerprint as they were; a new store records its kernel, and without it has the old digest."""
    from store.hidden_store import HiddenStore

    old = HiddenStore(str(REV4)).attrs
    assert old.compat.conv1d is None and "conv1d" not in to_json(old.compat)
    assert (old.compat.conditioning(), old.compat.placement()) == (REV4_CONDITIONING, REV4_PLACEMENT)
    assert old.fingerprint == fingerprint.sha256_json(to_json(old.compat)) == REV4_FINGERPRINT
    new = HiddenStore(str(small_store)).attrs.compat
    assert new.conv1d == "torch" and new.conditioning() != SMALL_CONDITIONING
    assert replace(new, conv1d=None).conditioning() == SMALL_CONDITIONING and new.placement() == SMALL_PLACEMENT


def test_old_stores_read_as_greedy_and_a_sampled_record_round_trips():
    """compat.sampling: absent (greedy) in every store made before it; a sampled store's record is read
    back as written, changes the fingerprint, and neither the conditioning nor the placement."""
    old = StoreAttrs.from_json(load("root_attributes.json"), "old store")
    assert old.compat.sampling is None
    sampled = replace(old.compat, sampling=Sampling(temperature=0.7, top_p=0.95, seed=3))
    body = to_json(sampled)
    assert body["sampling"] == {"temperature": 0.7, "top_p": 0.95, "seed": 3}  # the cut not made left out
    back = StoreAttrs.from_json({**load("root_attributes.json"), "compat": body}, "sampled").compat
    assert back == sampled and back.sampling.describe() == "temperature 0.7, top-p 0.95, seed 3"
    assert fingerprint.sha256_json(body) != fingerprint.sha256_json(to_json(old.compat))
    assert (sampled.conditioning(), sampled.placement()) == (old.compat.conditioning(), old.compat.placement())


def test_a_store_in_a_hidden_format_this_version_does_not_know_is_refused_naming_the_field():
    old = load("root_attributes.json")
    with pytest.raises(
        NotAStore, match="old store: root attributes: compat.hidden_format 'fp4' is not a hidden format"
    ):
        StoreAttrs.from_json({**old, "compat": {**old["compat"], "hidden_format": "fp4"}}, "old store")
    assert [StoreAttrs.from_json(old, "s").compat.as_format(f).format for f in hidden_formats.NAMES] == [
        hidden_formats.BF16,
        hidden_formats.FP8,
    ]
