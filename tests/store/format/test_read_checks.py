"""What reading each layout checks (store/format/read_checks.py): today's store, schema 1, the retired
--codec blosc, shards committed before every chunk was written; and what info and verify make of it."""

import dataclasses
import shutil
from pathlib import Path

import pytest

from store.errors import StoreMismatch
from store.format.read_checks import ReadChecks
from store.format.schema import FORMAT_REVISION
from store.hidden_store import HiddenStore
from store.store_writer import StoreWriter
from store.summary import render, summarize
from store.verify import verify

DATA = Path(__file__).parents[2] / "data"
# Shards 0-1 of 64 written with the retired --codec blosc (schema 2, every chunk written, no chunk
# checksums): `pipeline extract --shards 0-1 --max-new-tokens 16 --max-length 128 --chunk-tokens 32
# --shard-tokens 64 --dtype fp32 --codec blosc` at 408d8ec.
BLOSC = DATA / "blosc_store"
SCHEMA1 = DATA / "schema1_store"


def copied(src: Path, tmp_path) -> HiddenStore:
    shutil.copytree(src, tmp_path / src.name)
    return HiddenStore(str(tmp_path / src.name))


def test_a_store_written_today_checks_everything(small_store):
    store = HiddenStore(str(small_store))
    checks = store.read_checks()
    assert checks == ReadChecks(
        location=str(small_store),
        revision=FORMAT_REVISION,
        schema=2,
        chunk_checksums=True,
        direct_reads=True,
        zero_filled=(),
    )
    assert store.attrs.format_revision == FORMAT_REVISION and checks.warning() is None
    assert all(checks.every_chunk(s) for s in range(4))
    assert f"checks       format revision {FORMAT_REVISION}: a checksum per chunk, every chunk written" in render(
        summarize(store)
    )


@pytest.mark.parametrize(
    "src,revision,schema,says",
    [
        (SCHEMA1, 1, 1, "is a schema-1 store: its chunks carry no checksums"),
        (BLOSC, 3, 2, "is a format-revision-3 store written with --codec blosc: its chunks carry no checksums"),
    ],
)
def test_older_layouts_say_what_reading_cannot_check(tmp_path, src, revision, schema, says):
    store = copied(src, tmp_path)
    checks = store.read_checks()
    assert (checks.revision, checks.schema, checks.chunk_checksums, checks.direct_reads) == (
        revision,
        schema,
        False,
        False,
    )
    assert not checks.every_chunk(0) and says in checks.warning()
    assert f"format revision {revision}: no chunk checksums" in render(summarize(store))
    report = verify(store, sample=0.1)  # a sample of unchecked chunks proves nothing: every byte is read
    assert report.ok and report.whole and report.chunks[0] == report.chunks[1]
    assert "every byte: this layout has no chunk checksums" in report.verdict()


def test_a_blosc_store_takes_no_new_shards(tmp_path):
    store = StoreWriter(copied(BLOSC, tmp_path).location)
    with pytest.raises(StoreMismatch, match="coded with blosc .* new shards go into a new store"):
        store.check_compatible(store.attrs.compat)


def test_shards_committed_before_every_chunk_was_written_are_named(store_copy):
    store = StoreWriter(str(store_copy))
    for shard in (0, 2, 3):
        store.write_commit(dataclasses.replace(store.commit_record(shard), every_chunk=None, metadata=None))
    checks = HiddenStore(str(store_copy)).read_checks()
    assert checks.chunk_checksums and checks.zero_filled == (0, 2, 3)
    assert checks.every_chunk(1) and not checks.every_chunk(2)
    assert "except shards 0,2-3" in checks.describe() and "shards 0,2-3 were committed before" in checks.warning()


def test_a_sampled_verify_sees_a_deleted_chunk_file(store_copy):
    """Sampled chunks are read from the chunk files themselves: a deleted one is damage, not zeros."""
    victim = sorted(p for p in (store_copy / "shards/00001/hidden").glob("c.*"))[0]
    victim.unlink()
    report = verify(HiddenStore(str(store_copy)), sample=1.0)
    assert list(report.problems) == [1] and "is missing" in report.problems[1][0]
