"""The byte-plane codec (store/format/bf16_codec.py): bit-exact, finds repeated rows, every read checked,
readable by plain zarr through the package's entry point."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import Crc32cCodec

from store.format import layout
from store.format.bf16_codec import Bf16Planes
from tests.store.format.test_layout import special_bf16


def write(path, x: np.ndarray, low: str) -> zarr.Array:
    a = zarr.create_array(
        str(path),
        shape=x.shape,
        dtype=np.uint16,
        chunks=(32, *x.shape[1:]),
        shards=(64, *x.shape[1:]),
        compressors=[Bf16Planes(level=1, low=low), Crc32cCodec()],
        fill_value=0,
    )
    a[:] = x
    return a


def size(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def states(tokens: int, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return layout.to_bits((torch.randn(tokens, 3, 64, generator=g) * 3).to(torch.bfloat16))


@pytest.mark.parametrize("low", ["lz4", "raw"])
def test_every_bf16_pattern_round_trips_bit_for_bit(tmp_path, low):
    x = layout.to_bits(special_bf16()).reshape(-1, 4, 64)[:250]  # 250 rows: the last chunk is partial
    write(tmp_path / "a.zarr", x, low)
    assert np.array_equal(zarr.open_array(str(tmp_path / "a.zarr"), mode="r")[:], x)


def test_the_low_plane_finds_repeated_rows_and_costs_nothing_on_random_ones(tmp_path):
    """Two short samples in one chunk that share a 12-token prefix give identical rows: LZ4 on the
    low plane finds them, a raw low plane cannot; on rows without repeats LZ4 stays within 1% of raw."""
    unique = states(256)
    repeated = unique.copy()
    for start in range(0, 256, 32):  # each 32-token chunk: two 16-token samples, the same first 12 rows
        repeated[start + 16 : start + 28] = repeated[start : start + 12]
    sizes = {
        (kind, low): size(write(tmp_path / f"{kind}-{low}.zarr", data, low).store_path.store.root)
        for kind, data in (("unique", unique), ("repeated", repeated))
        for low in ("lz4", "raw")
    }
    assert sizes["repeated", "lz4"] < 0.85 * sizes["repeated", "raw"]
    assert sizes["unique", "lz4"] <= 1.01 * sizes["unique", "raw"]


def test_a_flipped_byte_fails_the_read(tmp_path):
    x = states(128)
    write(tmp_path / "a.zarr", x, "lz4")
    shard = tmp_path / "a.zarr" / "c" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # inside the first chunk
    shard.write_bytes(bytes(data))
    a = zarr.open_array(str(tmp_path / "a.zarr"), mode="r")
    with pytest.raises(ValueError, match="checksum"):
        a[:32]
    assert np.array_equal(a[64:], x[64:])  # the other shard file is untouched


def test_plain_zarr_reads_it_with_the_package_installed(tmp_path):
    """No import of this package: zarr finds the codec through the `zarr.codecs` entry point."""
    x = states(100)
    write(tmp_path / "a.zarr", x, "lz4")
    np.save(tmp_path / "x.npy", x)
    code = (
        "import sys, numpy, zarr; a = zarr.open_array(sys.argv[1], mode='r'); "
        "assert numpy.array_equal(a[:], numpy.load(sys.argv[2])); print('ok')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a.zarr"), str(tmp_path / "x.npy")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == "ok", r.stderr


def test_settings_are_checked():
    with pytest.raises(ValueError, match="low plane 'zip'"):
        Bf16Planes(low="zip")
    with pytest.raises(ValueError, match="2-byte values"):
        zarr.create_array(store={}, shape=(4,), dtype=np.float32, compressors=[Bf16Planes()])
