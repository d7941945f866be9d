"""pipeline/target/parameter_count.py: a target's parameters from its config alone, against the tensors
transformers builds (on the meta device) and against the shipped tiny target's weights."""

from __future__ import annotations

import math
import sys

import pytest
from safetensors import safe_open

from pipeline import TINY_TARGET
from pipeline.errors import TargetError
from pipeline.target.architectures import ARCHS
from pipeline.target.parameter_count import parameters, read_config, weight_bytes
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
try:
    import make_target
finally:
    sys.path.pop(0)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_each_published_architecture_counts_as_transformers_builds_it(name):
    arch = ARCHS[name]
    tensors, _ = make_target.checkpoint_tensors(make_target.hf_config(arch, arch.full_layers))
    assert parameters(arch.text_config(arch.full_layers)) == sum(t.nbytes for t in tensors) // 2


def test_the_published_figures():
    """Qwen3.5-35B-A3B's text decoder: 34,660,610,688 as published; Qwen3.6-27B: 53.8 GB in bf16."""
    moe, dense = ARCHS["qwen3.5-35b-a3b"], ARCHS["qwen3.6-27b"]
    assert parameters(moe.text_config(moe.full_layers)) == 34_660_610_688
    assert weight_bytes(dense.text_config(dense.full_layers)) == 53_791_996_928
    assert parameters(dense.text_config(4)) < parameters(dense.text_config(8))


def test_the_tiny_target_counts_as_its_weights():
    with safe_open(str(TINY_TARGET / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert parameters(read_config(TINY_TARGET)) == stored


def test_a_directory_without_a_config_is_refused(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        read_config(tmp_path)
