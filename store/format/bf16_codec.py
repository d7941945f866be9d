"""`dflash.bf16_planes`: the bf16 hidden format's codec, lossless on bf16 bits, byte plane by byte plane.

In bf16 hidden states the high byte of each value (sign, 7 exponent bits) carries about 3 bits of
information and the low byte (1 exponent bit, 7 mantissa bits) almost 8. Compressing the two
together spends a strong coder's effort on the nearly random half; this codec splits a chunk's
little-endian 2-byte values into a high-byte plane, compressed with zstd, and a low-byte plane
that is either kept raw or passed through LZ4, which costs little on random bytes and still finds
whole repeated rows (a shared prompt prefix gives a causal model identical states).

Encoded chunk: uint32 little-endian length of the high plane's zstd frame, that frame, then the
low plane (raw bytes, or an LZ4 block with numcodecs' 4-byte size header). Registered with zarr
under its name on import and through the package's `zarr.codecs` entry point, so plain zarr with
this package installed reads the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np
from numcodecs import LZ4, Zstd

from store.format.chunk_codec import HEADER, LEVELS, PackedCodec, register

NAME = "dflash.bf16_planes"
LOW_PLANES = ("lz4", "raw")


@dataclass(frozen=True)
class Bf16Planes(PackedCodec):
    name: ClassVar[str] = NAME
    level: int = 1  # zstd level of the high-byte plane
    low: str = "lz4"  # the low-byte plane: "lz4" or "raw"

    def __post_init__(self) -> None:
        if self.low not in LOW_PLANES:
            raise ValueError(f"{NAME}: low plane {self.low!r}, expected one of {LOW_PLANES}")
        if not LEVELS[0] <= self.level <= LEVELS[1]:
            raise ValueError(f"{NAME}: zstd level {self.level}, expected {LEVELS[0]} to {LEVELS[1]}")

    @classmethod
    def for_states(cls, level: int, hidden_size: int) -> Bf16Planes:
        """The codec of a store's bf16 states at zstd level `level` (any hidden size)."""
        return cls(level=level, low="lz4")

    def to_dict(self):
        return {"name": NAME, "configuration": {"level": self.level, "low": self.low}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        if dtype.to_native_dtype().itemsize != 2:
            raise ValueError(f"{NAME} takes 2-byte values (bf16 bits as uint16), not {dtype}")

    @cached_property
    def _high(self) -> Zstd:
        return Zstd(level=self.level)

    @cached_property
    def _low(self) -> LZ4 | None:
        return LZ4(acceleration=1) if self.low == "lz4" else None

    def pack_parts(self, data: np.ndarray) -> list:
        """data: the chunk's bytes, little-endian 2-byte values."""
        pairs = data.reshape(-1, 2)
        high = self._high.encode(np.ascontiguousarray(pairs[:, 1]))
        low = np.ascontiguousarray(pairs[:, 0])
        low = self._low.encode(low) if self._low is not None else low.tobytes()
        return [np.array([len(high)], HEADER).tobytes(), high, low]

    def unpack(self, data: np.ndarray) -> np.ndarray:
        """data: an encoded chunk (uint8). Returns the chunk's bytes (uint8), values little-endian."""
        high, low = self.planes(data)
        out = np.empty(len(high), np.uint16)
        interleave(high, low, out)
        return out.view(np.uint8)

    def planes(self, data: np.ndarray, into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """An encoded chunk's high and low byte planes (uint8, one byte per value each). into: a
        [2, values] uint8 array to decode them into, which a reader reuses from chunk to chunk:
        fresh buffers of a 13 MB chunk cost more in page faults than the decoding."""
        n_high = int(data[:4].view(HEADER)[0])
        frame, low = data[4 : 4 + n_high], data[4 + n_high :]
        if into is None:
            high = np.frombuffer(self._high.decode(frame), np.uint8)
            low = np.frombuffer(self._low.decode(low), np.uint8) if self._low is not None else low
        else:
            high = self._high.decode(frame, out=into[0])
            low = self._low.decode(low, out=into[1]) if self._low is not None else low
        if len(low) != len(high):
            raise ValueError(f"{NAME}: planes of {len(high)} and {len(low)} bytes")
        return high, low

    def decode_values(self, body: np.ndarray, values: int, first: int, out: np.ndarray, buffer) -> None:
        """How a span is read: the chunk `body` (checked bytes, `values` bf16 values) -> its values
        first..first + out.size into out (uint16, C-contiguous). buffer(slot, nbytes): a reusable
        uint8 buffer (store/span_reader.py); the planes are decoded into it, then interleaved."""
        high, low = self.planes(body, into=buffer("planes", 2 * values).reshape(2, -1))
        interleave(high[first : first + out.size], low[first : first + out.size], out)


def interleave(high: np.ndarray, low: np.ndarray, out: np.ndarray) -> None:
    """Write the values made of two byte planes into out (a C-contiguous uint16 array of as many
    values): high << 8 | low, in two vectorised passes (3x a strided byte copy)."""
    assert out.dtype == np.uint16 and out.flags.c_contiguous, (out.dtype, out.flags)
    values = out.reshape(-1)
    np.left_shift(high, 8, out=values, dtype=np.uint16)
    np.bitwise_or(values, low, out=values)


register(Bf16Planes)
