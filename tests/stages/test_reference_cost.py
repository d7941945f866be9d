"""`pipeline extract` says what regenerated references cost at a large target, before it loads."""

import json
import shutil
import struct

import pytest

from pipeline import TINY_TARGET
from pipeline.errors import TargetError
from stages.extract import reference_cost
from stages.extract.config import ExtractConfig
from stages.extract.run import run


def large_target(path, rows=65_536, cols=65_536):
    """A model directory whose one safetensors tensor holds rows x cols bf16 (4.3B by default): its
    header as written, its data a hole in a sparse file (no disk used, nothing loadable)."""
    path.mkdir()
    shutil.copy(TINY_TARGET / "config.json", path / "config.json")
    size = rows * cols * 2
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, size]}}
    ).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + size)
    return path


def test_a_large_target_is_told_the_cost_of_regenerate_and_the_server_flags(tmp_path):
    big = large_target(tmp_path / "big")
    assert reference_cost.parameters(big) == 65_536 * 65_536
    said = []
    with pytest.raises(TargetError):  # it cannot load: the notice came first, before the load
        run(ExtractConfig(store=str(tmp_path / "hs.zarr"), target=str(big), shards="0", num_shards=4), log=said.append)
    notice = [m for m in said if m.startswith("--responses regenerate")]
    assert len(notice) == 1
    for part in (
        "4.3B-parameter",
        "2,000-4,000 GPU-h",
        "210-350",
        f"vllm serve {big} --port 8000",
        "--responses server --server-url http://127.0.0.1:8000",
    ):
        assert part in notice[0], part
    assert not (tmp_path / "hs.zarr").exists()
    server = ExtractConfig(target=str(big), responses="server", server_url="http://127.0.0.1:8000")
    assert reference_cost.notice(server) is None  # already through an engine
    inside = ExtractConfig(target=str(big), capture="vllm", device="cpu")
    assert reference_cost.notice(inside) is None  # the capturing engine makes them


def test_the_shipped_tiny_target_is_not_told(target):
    assert reference_cost.parameters(TINY_TARGET) == sum(t.numel() for t in target.model.state_dict().values())
    assert reference_cost.parameters(TINY_TARGET) < reference_cost.LARGE
    assert reference_cost.notice(ExtractConfig()) is None
