"""The fp8 hidden format: quantization error within e4m3's, no saturation, and a codec that is
bit-exact on quantized states (through zarr too) and refuses anything else."""

import numpy as np
import pytest
import torch
import zarr
from zarr.codecs import Crc32cCodec

from store.format.fp8_codec import K_RANGE, Fp8E4m3, exponents, quantize
from store.format.layout import from_bits, to_bits

H = 64


def states(tokens: int = 40, taps: int = 3) -> torch.Tensor:
    """Heavy-tailed bf16 states with the rows a store meets: a zero row, a tiny one, a huge one, -0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, taps, H, generator=g) * torch.exp(torch.randn(H, generator=g))
    x[:, :, :2] *= 300  # massive channels
    x[0, 0] = 0
    x[1, 1] = x[1, 1] * 1e-30
    x[2, 2] = x[2, 2] * 1e30
    x[3, 0, 5] = -0.0
    return x.to(torch.bfloat16)


def test_quantized_values_stay_within_e4m3_rounding_and_never_saturate():
    x = states()
    q = quantize(x)
    k = exponents(x.view(torch.int16)).float()
    scale = torch.exp2(k)
    err = (q.float() - x.float()).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value (normals) or 2^-10 x scale (subnormals)
    assert bool((err <= torch.maximum(x.float().abs() * 2**-4, scale * 2**-10)).all())
    assert bool((q.float().abs() <= 448 * scale).all())
    assert torch.equal(quantize(q), q)  # idempotent: quantizing what is stored changes nothing


def test_the_codec_round_trips_quantized_states_bit_exact():
    q = to_bits(quantize(states()))
    codec = Fp8E4m3(group=H)
    encoded = np.frombuffer(codec.pack(q.view(np.uint8)), np.uint8)
    assert np.array_equal(codec.unpack(encoded).view(np.uint16).reshape(q.shape), q)
    assert len(encoded) < q.nbytes * 0.6  # one byte a value at most, and entropy coded


def test_the_codec_refuses_states_that_were_not_quantized():
    with pytest.raises(ValueError, match="quantize them first"):
        Fp8E4m3(group=H).pack(to_bits(states()).view(np.uint8))


def test_non_finite_states_stay_non_finite():
    x = states()
    x[4, 0, 7], x[5, 1, 3] = float("nan"), float("inf")
    q = quantize(x)
    assert not bool(q[4, 0, 7].isfinite()) and not bool(q[5, 1, 3].isfinite())


def test_plain_zarr_reads_and_writes_through_the_codec(tmp_path):
    q = to_bits(quantize(states()))
    a = zarr.create_array(
        str(tmp_path / "hidden"),
        shape=q.shape,
        chunks=(16, 3, H),
        dtype=np.uint16,
        compressors=[Fp8E4m3(group=H), Crc32cCodec()],
        fill_value=0,
    )
    a[:] = q
    back = zarr.open_array(str(tmp_path / "hidden"), mode="r")[:]
    assert np.array_equal(back, q)
    assert torch.equal(from_bits(back), quantize(states()))


def test_plain_zarr_decodes_it_without_an_import_and_the_documented_format_holds(tmp_path):
    """Through the `zarr.codecs` entry point (no import of this package), and by hand from a chunk
    file's bytes as docs/store.md describes them: uint32 G, G int8 exponents, a zstd frame of G x H
    e4m3 bytes, the crc32c last; value = e4m3 x 2^k."""
    import subprocess
    import sys

    from numcodecs import Zstd

    q = to_bits(quantize(states()))
    zarr.create_array(
        str(tmp_path / "hidden"),
        shape=q.shape,
        chunks=(40, 3, H),
        dtype=np.uint16,
        compressors=[Fp8E4m3(group=H), Crc32cCodec()],
        fill_value=0,
    )[:] = q
    np.save(tmp_path / "q.npy", q)
    code = (
        "import sys, numpy, zarr; a = zarr.open_array(sys.argv[1], mode='r'); "
        "assert numpy.array_equal(a[:], numpy.load(sys.argv[2])); print('ok')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "hidden"), str(tmp_path / "q.npy")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == "ok", r.stderr
    data = (tmp_path / "hidden" / "c" / "0" / "0" / "0").read_bytes()[:-4]  # less the crc32c
    groups = int(np.frombuffer(data[:4], "<u4")[0])
    k = np.frombuffer(data[4 : 4 + groups], np.int8).astype(np.float32)
    e4m3 = np.frombuffer(Zstd().decode(data[4 + groups :]), np.uint8).reshape(groups, H)
    values = torch.from_numpy(e4m3.copy()).view(torch.float8_e4m3fn).float() * torch.from_numpy(2.0**k)[:, None]
    assert groups == 40 * 3 and torch.equal(values.to(torch.bfloat16).reshape(q.shape), from_bits(q))


@pytest.mark.parametrize("group", [64, 2048])
def test_both_lookups_decode_every_byte_at_every_scale(group):
    """Narrow groups take the joined index, wide ones a table row per group: the same bits."""
    codec = Fp8E4m3(group=group)
    ks = np.arange(*K_RANGE, dtype=np.int8)
    codes = (np.arange(len(ks) * group) % 256).astype(np.uint8).reshape(len(ks), group)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN bytes are never written
    expect = (
        torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).double()
        * torch.exp2(torch.from_numpy(ks).double())[:, None]
    ).to(torch.bfloat16)
    assert torch.equal(from_bits(codec.decode_codes(codes, ks)), expect)


def test_rounding_is_the_float64_reference_and_flush_to_zero_changes_nothing():
    """The bf16 products equal an exact float64 rounding; with denormals flushed (as the CLIs run) the
    rounded states, and what the codec keeps of them, are the same, down to groups at the clamp."""
    x = states()
    x[6, 0] = x[6, 0] * 2.0**-118  # a group below every scale: k clamped, its small values lost
    k = exponents(x.view(torch.int16)).double()
    reference = ((x.double() * torch.exp2(-k)).float().to(torch.float8_e4m3fn).double() * torch.exp2(k)).bfloat16()
    assert int(k.min()) == K_RANGE[0] and torch.equal(quantize(x), reference)
    torch.set_flush_denormal(True)  # left on: every in-process run of a stage turns it on (device.prepare_cpu)
    q = quantize(x)
    codec = Fp8E4m3(group=H)
    back = codec.unpack(np.frombuffer(codec.pack(to_bits(q).view(np.uint8)), np.uint8))
    assert torch.equal(q, reference) and np.array_equal(back.view(np.uint16).reshape(q.shape), to_bits(q))
