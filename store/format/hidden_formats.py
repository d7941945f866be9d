"""The hidden formats a store's states come in, one record each: every question about a format is
asked of its record here, never by comparing names.

  name  recorded (compat.hidden_format)  codec (compat.codec)  zarr codec          rounding              stored fraction
  bf16  None (absent)                    "planes"              dflash.bf16_planes  none: bit for bit     0.70
  fp8   "fp8"                            "fp8"                 dflash.fp8_e4m3     e4m3 x 2^k per token  0.45
                                                                                   and tap (fp8_codec.quantize)

A store's format is fixed when it is created (`pipeline extract --hidden-format`). bf16 is recorded
as no value so that stores made before fp8 existed keep their fingerprints. The stored fraction is
the disk check's conservative estimate of a format's states on disk over their raw bf16 bytes
(measured 0.504-0.651 for bf16 and 0.275-0.41 for fp8: docs/performance.md). A span of states is
decoded by its codec's `decode_values` (store/span_reader.py); each codec is lossless on what it is
given, so rounding, when a format has it, is done once before writing (on the target's device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from zarr.codecs import Crc32cCodec

from store.errors import ConfigError, NotAStore
from store.format import fp8_codec
from store.format.bf16_codec import Bf16Planes
from store.format.chunk_codec import PackedCodec
from store.format.fp8_codec import Fp8E4m3

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class HiddenFormat:
    """One hidden format: how it is named, recorded, coded, rounded and sized."""

    name: str  # --hidden-format
    recorded: str | None  # compat.hidden_format (None: absent from the JSON)
    codec: str  # compat.codec
    codec_class: type[PackedCodec]  # its zarr codec; codec_class.name is the id in a shard's zarr.json
    rounding: Callable[[torch.Tensor], torch.Tensor] | None  # [..., H] bf16 -> the stored values (None: as captured)
    stored_fraction: float  # stored bytes of its states over their raw bf16 bytes, at most (the disk check's)

    def codecs(self, level: int, hidden_size: int) -> list:
        """The codec chain of a shard's `hidden` array in this format, a crc32c last; lossless on
        what it is given (fp8: states already rounded)."""
        return [self.codec_class.for_states(level, hidden_size), Crc32cCodec()]

    def round(self, states: torch.Tensor) -> torch.Tensor:
        """states: [..., H] bf16 -> the values this format stores (the same tensor when it keeps them)."""
        return states if self.rounding is None else self.rounding(states)


BF16 = HiddenFormat(
    name="bf16", recorded=None, codec="planes", codec_class=Bf16Planes, rounding=None, stored_fraction=0.70
)
FP8 = HiddenFormat(
    name="fp8", recorded="fp8", codec="fp8", codec_class=Fp8E4m3, rounding=fp8_codec.quantize, stored_fraction=0.45
)
FORMATS = {f.name: f for f in (BF16, FP8)}
NAMES = tuple(FORMATS)  # --hidden-format's choices
CODECS = tuple(f.codec for f in FORMATS.values())  # the compat.codec values this version writes
CODEC_CLASSES = tuple(f.codec_class for f in FORMATS.values())  # the codecs store/span_reader.py decodes


def of(name: str) -> HiddenFormat:
    """The format called `name` (--hidden-format); an unknown name is refused, naming the field."""
    if name not in FORMATS:
        raise ConfigError("--hidden-format", name, f"expected one of {', '.join(NAMES)}")
    return FORMATS[name]


def of_recorded(recorded: str | None, where: str) -> HiddenFormat:
    """The format a store's compat.hidden_format records (None: bf16). where: the store, for the error."""
    for f in FORMATS.values():
        if f.recorded == recorded:
            return f
    raise NotAStore(
        f"{where}: compat.hidden_format {recorded!r} is not a hidden format this version knows "
        f"({', '.join(NAMES)}); upgrade dflash-pipeline"
    )
