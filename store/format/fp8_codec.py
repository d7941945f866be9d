"""`dflash.fp8_e4m3`: bf16 states kept as FP8 (e4m3) values with one power-of-two scale per group.

The store's fp8 hidden format (store/format/hidden_formats.py). `quantize` rounds bf16 states, per
token and tap (a group is the last axis, H values), to e4m3 x 2^k: k is the smallest exponent that
keeps the group's largest magnitude within e4m3's 448, so no value saturates; values below e4m3's
smallest subnormal at that scale (2^(k-9)) become zero. A power of two, not amax / 448, so that
every quantized value is a bf16 exactly and decoding is a table lookup, bit-exact.

The codec is lossless on quantized values (it refuses anything else: quantize first), so every
checksum the store keeps of a shard's states holds for what reading returns. Encoded chunk:
uint32 little-endian G (groups), G int8 exponents k, then a zstd frame of the G x group e4m3 bytes.
Decoding: value = e4m3(byte) * 2^k, as bf16 bits.

torch is imported in the functions that use it: zarr imports this codec with the store, and the
store's read view opens without torch (docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from numcodecs import Zstd

from store.format.chunk_codec import HEADER, LEVELS, PackedCodec, register

if TYPE_CHECKING:
    import torch

NAME = "dflash.fp8_e4m3"
# The scale exponents kept. From -117 up, the smallest value kept, 2^(k-9), is a normal bf16 (2^-126), so
# neither rounding nor decoding meets a subnormal (which flush-to-zero on CPU would change); a group
# whose largest magnitude is below about 2^-109 uses -117 and loses its values under 2^-126.
K_RANGE = (-117, 120)
_ROW_LOOKUP = 1024  # groups at least this wide are decoded a group at a time


def exponents(bits: torch.Tensor) -> torch.Tensor:
    """bits: [..., group] int16 (bf16 bits). The smallest k with max |x| / 2^k <= 448, as int16
    [..., 1]: from the largest magnitude's bf16 exponent E and mantissa M, k = E - 135, plus one
    when 1.M > 1.75 (448 = 1.75 x 2^8)."""
    import torch

    mag = (bits & 0x7FFF).amax(-1, keepdim=True)
    k = (mag >> 7) - 135 + ((mag & 0x7F) > 0x60).to(torch.int16)
    return k.clamp(*K_RANGE)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x: [..., group] bf16 -> the same shape, bf16 values e4m3 x 2^k with one k per group. NaN and
    Inf stay non-finite, so a finiteness check after it still sees them."""
    import torch

    assert x.dtype == torch.bfloat16, x.dtype
    k = exponents(x.view(torch.int16)).float()
    return _e4m3(x, k).to(torch.bfloat16) * torch.exp2(k).to(torch.bfloat16)  # exact: powers of two, no subnormals


def _e4m3(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x: [..., group] bf16, k: [..., 1] float -> e4m3(x / 2^k). The division is a bf16 product by a
    power of two, exact (3x a float32 one on CPU), and the cast rounds to nearest even."""
    import torch

    return (x * torch.exp2(-k).to(torch.bfloat16)).to(torch.float8_e4m3fn)


def _table() -> np.ndarray:
    """[65536] uint16: index (k + 128) << 8 | byte -> bf16 bits of e4m3(byte) * 2^k."""
    import torch

    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values[torch.isnan(values)] = 0  # 0x7f, 0xff: never written
    scales = torch.exp2(torch.arange(256, dtype=torch.float32) - 128)
    table = (scales[:, None] * values[None, :]).to(torch.bfloat16)
    return table.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()


@dataclass(frozen=True)
class Fp8E4m3(PackedCodec):
    name: ClassVar[str] = NAME
    group: int  # values sharing one scale: the states' hidden size
    level: int = 1  # zstd level of the e4m3 bytes

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"{NAME}: group {self.group}, expected at least 1")
        if not LEVELS[0] <= self.level <= LEVELS[1]:
            raise ValueError(f"{NAME}: zstd level {self.level}, expected {LEVELS[0]} to {LEVELS[1]}")

    @classmethod
    def for_states(cls, level: int, hidden_size: int) -> Fp8E4m3:
        """The codec of a store's fp8 states: one scale per token and tap (a group of hidden_size)."""
        return cls(group=hidden_size, level=level)

    def to_dict(self):
        return {"name": NAME, "configuration": {"group": self.group, "level": self.level}}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        if dtype.to_native_dtype().itemsize != 2 or shape[-1] % self.group:
            raise ValueError(f"{NAME} takes bf16 bits (2-byte values) in groups of {self.group}, not {dtype} {shape}")

    @cached_property
    def _zstd(self) -> Zstd:
        return Zstd(level=self.level)

    @cached_property
    def _table(self) -> np.ndarray:
        return _table()

    @cached_property
    def _rows(self) -> list[np.ndarray]:
        """The table's 256 entries of each scale exponent k, at [k + 128]."""
        return list(self._table.reshape(256, 256))

    def pack_parts(self, data: np.ndarray) -> list:
        """data: the chunk's bytes, little-endian bf16 bits of quantized values."""
        import torch

        bits = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).reshape(-1, self.group))
        k = exponents(bits)
        e4m3 = _e4m3(bits.view(torch.bfloat16), k.float())
        codes = e4m3.view(torch.uint8).numpy()
        ks = k.to(torch.int8).numpy().reshape(-1)
        if not np.array_equal(self.decode_codes(codes, ks), bits.numpy().view(np.uint16)):
            raise ValueError(
                f"{NAME}: values that are not e4m3 x 2^k per group of {self.group} (store.format.fp8_codec."
                "quantize them first)"
            )
        return [np.array([len(ks)], HEADER).tobytes(), ks.tobytes(), self._zstd.encode(codes)]

    def decode_codes(self, codes: np.ndarray, ks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """codes: [G, group] uint8 e4m3 bytes, ks: [G] int8 -> [G, group] uint16 bf16 bits (into out).
        Wide groups look up their scale's 256 table entries, a group at a time (twice the speed of
        one lookup over a joined index at hidden 5120); narrow ones, where a loop would cost more
        than it saves, take the joined index."""
        if self.group < _ROW_LOOKUP:
            index = (ks.astype(np.int16) + 128).astype(np.uint16)[:, None] << 8 | codes
            return np.take(self._table, index, out=out, mode="clip")  # indices always in range: no bounds check
        out = np.empty(codes.shape, np.uint16) if out is None else out
        rows = self._rows
        for g, k in enumerate(ks.tolist()):
            rows[k + 128].take(codes[g], out=out[g], mode="clip")  # a byte indexes 256 entries: in range
        return out

    def codes(self, data: np.ndarray, into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """An encoded chunk (uint8) -> its e4m3 bytes [G, group] and exponents [G]. into: a uint8
        array of the chunk's values to decode the bytes into (a reader reuses it from chunk to chunk)."""
        groups = int(data[:4].view(HEADER)[0])
        ks = data[4 : 4 + groups].view(np.int8)
        frame = data[4 + groups :]
        codes = (
            np.frombuffer(self._zstd.decode(frame), np.uint8) if into is None else self._zstd.decode(frame, out=into)
        )
        if len(codes) != groups * self.group:
            raise ValueError(f"{NAME}: {len(codes)} bytes for {groups} groups of {self.group}")
        return codes.reshape(groups, self.group), ks

    def unpack(self, data: np.ndarray) -> np.ndarray:
        """data: an encoded chunk (uint8). Returns the chunk's bytes (uint8), bf16 bits little-endian."""
        return self.decode_codes(*self.codes(data)).reshape(-1).view(np.uint8)

    def decode_values(self, body: np.ndarray, values: int, first: int, out: np.ndarray, buffer) -> None:
        """How a span is read: the chunk `body` (checked bytes, `values` values) -> its values
        first..first + out.size (whole groups) into out (uint16 bf16 bits), looked up straight into it.
        buffer(slot, nbytes): a reusable uint8 buffer (store/span_reader.py) the e4m3 bytes go to."""
        codes, ks = self.codes(body, into=buffer("codes", values))
        g, n = first // self.group, out.size // self.group
        self.decode_codes(codes[g : g + n], ks[g : g + n], out=out.reshape(n, -1))


register(Fp8E4m3)
