"""A store's layout and what reading it verifies, derived in one place: `Layout` is read once from the
root (schema_version, format_revision or what the root's records show, compat.codec,
compat.hidden_format), and every reader (ShardReader, the sample index), the writer's check,
`pipeline info` and `pipeline verify` ask it or `read_checks` rather than combining schema numbers,
revisions and codec names themselves, so a new layout is added here and nowhere else. What varies
per shard (its chunk keys' separator, whether every chunk was written) is read from its commit file.

The format's revisions (a root records its own as `format_revision` from revision 4 on; an older
root is read as the revision its records show, `revision_of`):

  1  schema 1: states blosc zstd; no chunk checksums, no first_pairs. Read-only.
  2  schema 2: states in the byte-plane codec, a crc32c ending every state and token chunk that
     every read verifies; first_pairs; the `--codec blosc` option still wrote schema 2 without
     chunk checksums.
  3  commit files sealed by their own checksum and holding the CRC-32 of every metadata file zarr
     parses; every chunk written, all-zero ones included, so a missing chunk file is damage
     (`every_chunk` in a shard's commit file).
  4  the revision recorded on the root; states always byte-plane coded (`--codec` retired), or, in a
     store made with `--hidden-format fp8`, fp8 coded (`dflash.fp8_e4m3`, checksummed alike).
  5  chunk keys "."-separated (c.K.0.0, a file beside the array's metadata; before, c/K/0/0 made a
     directory per key level: a 27B-job shard's inodes 1,554 -> 571 at --shard-tokens 4096, and 205
     at the new default of 16384). Each array's metadata names its encoding; a shard's commit file
     records it too (`chunk_separator` below), so a chunk can be named before the metadata is read.

A store can hold shards of several revisions (a later extraction adds shards to an earlier root),
so what holds per shard is read from its commit file, not from the root.
"""

from __future__ import annotations

from dataclasses import dataclass

from store.format import layout
from store.format.hidden_formats import HiddenFormat
from store.format.ranges import format_ranges
from store.format.schema import SCHEMA_VERSION, RootCommit, ShardCommit, StoreAttrs


@dataclass(frozen=True)
class Layout:
    """How a store's root says its shards are laid out: the one value readers and the writer ask."""

    schema: int  # schema_version: 1 blosc (read-only), 2 byte-plane codecs with chunk checksums
    revision: int  # the root's format revision (`revision_of`)
    format: HiddenFormat  # the states' hidden format (compat.hidden_format)
    codec: str  # the states' codec (compat.codec; "blosc" where absent: schema 1)
    final_state: bool = False  # every shard holds a `final_state` array (compat.final_state)

    @property
    def format_coded(self) -> bool:
        """The states are coded by their format's codec, a crc32c ending every state and token
        chunk (else blosc: schema 1 and the retired --codec blosc, which zarr reads)."""
        return self.schema >= 2 and self.codec == self.format.codec

    @property
    def writable(self) -> bool:
        """This version may add shards to it (else it is read-only: new shards go into a new store)."""
        return self.schema == SCHEMA_VERSION and self.format_coded

    def describe(self) -> str:
        """`pipeline info`'s words for it."""
        final = ", with the final state" if self.final_state else ""
        return f"schema {self.schema}, {self.format.name} states{final}, codec {self.codec}"


def layout_of(attrs: StoreAttrs, root: RootCommit) -> Layout:
    """The layout the root's attributes and commit record say."""
    return Layout(
        schema=attrs.schema_version,
        revision=revision_of(attrs, root),
        format=attrs.compat.format,
        codec=attrs.compat.codec or "blosc",
        final_state=bool(attrs.compat.final_state),
    )


@dataclass(frozen=True)
class ReadChecks:
    """What reading the store (or the shards asked about) can check."""

    location: str
    revision: int  # the root's format revision
    schema: int
    chunk_checksums: bool  # every state and token chunk ends in a crc32c that every read verifies
    direct_reads: bool  # spans are read straight from their chunk files (store/span_reader.py), else by zarr
    zero_filled: tuple[int, ...]  # shards whose missing chunk files read as zeros (committed before revision 3)

    def every_chunk(self, shard: int) -> bool:
        """Whether a missing chunk file of `shard` is damage (every chunk of it was written)."""
        return self.chunk_checksums and shard not in self.zero_filled

    def describe(self) -> str:
        """One line for `pipeline info`."""
        if not self.chunk_checksums:
            return f"format revision {self.revision}: no chunk checksums (whole-array checksums only)"
        partial = f", except shards {format_ranges(self.zero_filled)}" if self.zero_filled else ""
        return f"format revision {self.revision}: a checksum per chunk, every chunk written{partial}"

    def warning(self) -> str | None:
        """What reading cannot check, as a warning for the reader to print; None when everything is."""
        if not self.chunk_checksums:
            layout = (
                f"a schema-{self.schema} store"
                if self.schema < 2
                else f"a format-revision-{self.revision} store written with --codec blosc"
            )
            return (
                f"{self.location} is {layout}: its chunks carry no checksums, so damage inside a state or token "
                f"chunk is not seen while reading (its metadata and per-sample arrays still are); run "
                f"`pipeline verify {self.location}` before using it, or extract it again into a new store"
            )
        if not self.zero_filled:
            return None
        shards = format_ranges(self.zero_filled)
        return (
            f"{self.location}: shards {shards} were committed before format revision 3 wrote every chunk: a chunk "
            f"file deleted from them reads as zeros, not as an error; run `pipeline verify {self.location} --shards "
            f"{shards}` before using them, or extract them again (delete their commit files, then run `pipeline "
            f"extract` with the store's settings)"
        )


def chunk_separator(record: ShardCommit) -> str:
    """The separator of the shard's chunk keys: "." from revision 5, "/" before (store/format/layout.py)."""
    return record.chunk_separator or layout.OLD_SEPARATOR


def first_chunk(record: ShardCommit) -> str:
    """The key of a one-chunk array's chunk (the per-sample arrays) in the shard: c.0, or c/0 before revision 5."""
    return layout.chunk_key(chunk_separator(record), 0)


def revision_of(attrs: StoreAttrs, root: RootCommit) -> int:
    """The root's format revision: recorded, or read from what its records hold."""
    if attrs.format_revision is not None:
        return attrs.format_revision
    if attrs.schema_version < 2:
        return 1
    return 2 if root.metadata is None else 3


def read_checks(location: str, shape: Layout, records: dict[int, ShardCommit]) -> ReadChecks:
    """What reading the shards of `records` checks, for the store at `location` laid out as `shape`."""
    coded = shape.format_coded
    return ReadChecks(
        location=location,
        revision=shape.revision,
        schema=shape.schema,
        chunk_checksums=coded,
        direct_reads=coded,
        zero_filled=tuple(s for s, r in sorted(records.items()) if coded and not r.every_chunk),
    )
