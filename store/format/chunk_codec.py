"""What this package's zarr codecs share: `PackedCodec`, a codec whose subclass packs and unpacks a
chunk's bytes with numpy (zarr's sync and async entry points, run in threads), the uint32 length
header that frames a packed chunk's parts, and the zstd levels both accept. A chunk's checksum is
zarr's `crc32c` codec, next in every chain (store/format/hidden_formats.py `HiddenFormat.codecs`).

The codecs themselves, one module per hidden format: store/format/bf16_codec.py (`dflash.bf16_planes`) and
store/format/fp8_codec.py (`dflash.fp8_e4m3`).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import numpy as np
import zarr
from zarr.abc.codec import BytesBytesCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

LEVELS = (-7, 22)  # the zstd levels of a codec's zstd-coded part
HEADER = np.dtype("<u4")  # the length that starts a packed chunk


class PackedCodec(BytesBytesCodec):
    """A zarr codec of this package whose subclass packs and unpacks a chunk's bytes (numpy):
    zarr's sync and async entry points, run in threads (zstd and LZ4 release the GIL)."""

    is_fixed_size = False
    name: ClassVar[str]

    def pack(self, data: np.ndarray) -> bytes:
        """data: the chunk's bytes (uint8). Returns the encoded chunk."""
        return b"".join(self.pack_parts(data))

    def pack_parts(self, data: np.ndarray) -> list:
        """The encoded chunk as the pieces it is made of (joined, they are `pack`'s bytes), so a
        writer can hand them to the file without another copy."""
        raise NotImplementedError

    def unpack(self, data: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def for_states(cls, level: int, hidden_size: int) -> PackedCodec:
        """The codec of a store's states of width hidden_size, its zstd at `level`."""
        raise NotImplementedError

    def decode_values(self, body: np.ndarray, values: int, first: int, out: np.ndarray, buffer) -> None:
        """How a span is read (store/span_reader.py): values first..first + out.size of a chunk's
        checked bytes into out."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data):
        _, config = parse_named_configuration(data, cls.name)
        return cls(**config)

    def _encode_sync(self, chunk_bytes, chunk_spec):
        return chunk_spec.prototype.buffer.from_bytes(self.pack(chunk_bytes.as_numpy_array()))

    def _decode_sync(self, chunk_bytes, chunk_spec):
        return chunk_spec.prototype.buffer.from_array_like(self.unpack(chunk_bytes.as_numpy_array()))

    async def _encode_single(self, chunk_bytes, chunk_spec):  # chunks in parallel
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    async def _decode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, input_byte_length: int, chunk_spec) -> int:
        raise NotImplementedError


def register(cls: type[PackedCodec]) -> None:
    """Register a codec with zarr under its id, and name this class as the one zarr uses for it: an
    installation whose `zarr.codecs` entry points still name an earlier module for the id (an
    editable install from before a module was renamed) then cannot hand zarr another class."""
    register_codec(cls.name, cls)
    zarr.config.set({"codecs": {**zarr.config.get("codecs"), cls.name: f"{cls.__module__}.{cls.__qualname__}"}})
