import numpy as np
import torch
import zarr

from store.format import layout


def special_bf16() -> torch.Tensor:
    """Every bit pattern of bf16: normals, denormals, +-0, +-inf and NaNs."""
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_bits_round_trip_is_exact():
    x = special_bf16()
    y = layout.from_bits(layout.to_bits(x))
    assert y.dtype == torch.bfloat16
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))  # bit for bit, NaNs included


def test_round_trip_through_zarr_is_exact(tmp_path):
    torch.manual_seed(0)
    x = (torch.randn(300, 3, 64) * 40).to(torch.bfloat16)  # [T, n_taps, H]
    x.view(-1)[: 1 << 12] = special_bf16()[::16]
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w")
    arr = g.create_array(
        "hidden",
        shape=x.shape,
        dtype=np.uint16,
        chunks=(32, 3, 64),
        shards=(64, 3, 64),
        compressors=layout.hidden_codecs(layout.DEFAULT_LEVEL),
        fill_value=0,
    )
    arr[:] = layout.to_bits(x)
    back = layout.from_bits(zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["hidden"][:])
    assert torch.equal(x.view(torch.int16), back.view(torch.int16))
    assert torch.equal(x[~x.isnan()], back[~back.isnan()])


def test_first_pairs_is_the_first_anchor_of_each_sample():
    """The per-sample index the store writes agrees with the anchor rule (pipeline/drafter/blocks.py)
    on random masks: first_pairs[i] is the first anchor of sample i, -1 when it has none."""
    from pipeline.drafter.blocks import anchor_mask

    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 12, rng.integers(1, 20))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        mask = (rng.random(offsets[-1]) < rng.random()).astype(np.uint8)
        expected = []
        for a, b in zip(offsets[:-1], offsets[1:]):
            anchors = np.flatnonzero(anchor_mask(mask[a:b].astype(bool)))
            expected.append(int(anchors[0]) if len(anchors) else -1)
        assert layout.first_pairs(mask, offsets).tolist() == expected
