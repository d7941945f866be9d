"""The --served engine's device: the node's GPU it is shown, its memory share, refused up front."""

import pytest
import torch

from pipeline.errors import EngineError
from stages.evaluate.engine_device import EngineDevice, choose, default_share, node_gpu

GIB = 2**30


def test_a_gpu_is_named_as_the_node_numbers_it():
    assert node_gpu(3, None) == node_gpu(3, "") == "3"
    assert node_gpu(1, "4,6, 7") == "6"  # this process's cuda:1 is the node's GPU 6
    assert node_gpu(0, "GPU-5d2c") == "GPU-5d2c"
    with pytest.raises(EngineError, match="CUDA_VISIBLE_DEVICES=4,6 shows this process 2 GPU"):
        node_gpu(2, "4,6")


def test_the_default_share_is_vllms_unless_less_is_free():
    assert default_share(141 * GIB, 141 * GIB) == 0.9
    assert default_share(int(139.9 * GIB), 141 * GIB) == 0.9  # an evaluator's CUDA context left beside it
    assert default_share(80 * GIB, 141 * GIB) == 0.53  # 0.567 free, less 0.03, rounded down
    assert default_share(3 * GIB, 141 * GIB) < 0.05  # then choose() refuses it


def test_on_cpu_the_engine_gets_no_gpu_and_the_share_only_when_given():
    e = choose("cpu", None)
    assert e == EngineDevice("cpu") and e.env() == {} and e.text() == "cpu"  # vLLM's own default
    e = choose("cpu", 0.5)  # vLLM's CPU backend: a share of host memory
    assert e.memory_share == 0.5 and e.env() == {} and e.text() == "cpu, share 0.50 of host memory"


def test_a_gpu_this_process_does_not_see_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    with pytest.raises(EngineError, match=r"--served-device cuda:1: this process sees 0 GPU\(s\)"):
        choose("cuda:1", None)


def fake_gpu(monkeypatch, free: float, total: float = 141.0, visible: str | None = None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (int(free * GIB), int(total * GIB)))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_the_engine_sees_its_gpu_alone_with_the_share_checked_against_what_is_free(monkeypatch):
    fake_gpu(monkeypatch, free=140.2, visible="0,1,2,3,4,5,6,7")
    e = choose("cuda:3", None)
    assert e.env() == {"CUDA_VISIBLE_DEVICES": "3"} and e.memory_share == 0.9 and e.free_gib == 140.2
    assert "cuda:3 (GPU 3 of the node), share 0.90 of 141.0 GiB, 140.2 GiB free at start" == e.text()
    assert choose("cuda", 0.5).device == "cuda:0"
    fake_gpu(monkeypatch, free=80.0)  # the evaluator (or someone else) still holds 61 GiB
    assert choose("cuda:0", None).memory_share == 0.53
    with pytest.raises(EngineError, match=r"cuda:0: 80.0 of 141.0 GiB free, the engine needs share 0.90"):
        choose("cuda:0", 0.9)
    fake_gpu(monkeypatch, free=3.0)
    with pytest.raises(EngineError, match="give --served-device another GPU"):
        choose("cuda:0", None)
