"""The linear-attention path is read from the calls, not assumed."""

import sys
import types

import pytest

from pipeline.target.kernels import KernelRecorder, family, implementation_of, select_linear_attention
from store.errors import ConfigError


def _module(name: str, **functions) -> types.ModuleType:
    mod = types.ModuleType(name)
    for fn_name, fn in functions.items():
        fn.__module__ = name
        setattr(mod, fn_name, fn)
    sys.modules[name] = mod
    return mod


def _dispatcher(implementation):
    """The shape of transformers' kernel wrapper: a closure over `implementation`."""
    def wrapped(*args, **kwargs):
        return implementation(*args, **kwargs)
    return wrapped


def test_family_from_the_implementations_package():
    fla_fn = _module("fla.ops.fake", chunk=lambda: None).chunk
    torch_fn = _module("transformers.models.fake.modeling_fake", f=lambda: None).f
    hub_fn = _module("kernels_hub_fake", f=lambda: None).f
    assert family(fla_fn) == "fla" and family(torch_fn) == "torch" and family(hub_fn) == "kernels_hub_fake"
    assert implementation_of(_dispatcher(fla_fn)) is fla_fn
    assert implementation_of(torch_fn) is torch_fn


@pytest.mark.parametrize("impl_module,expect", [("fla.ops.fake2", "fla"), ("transformers.fake_ref", "torch")])
def test_recorder_counts_what_served_each_call(impl_module, expect):
    impl = _module(impl_module, rule=lambda x: x + 1).rule
    model_mod = _module(f"transformers.models.fake_{expect}.modeling", torch_chunk_gated_delta_rule=_dispatcher(impl))
    model_mod.torch_chunk_gated_delta_rule.__module__ = model_mod.__name__
    model_cls = type("FakeModel", (), {"__module__": model_mod.__name__})
    rec = KernelRecorder(model_cls())
    assert rec.summary()["linear_attention"] == "none"  # nothing ran yet
    with rec.recording():
        assert model_mod.torch_chunk_gated_delta_rule(1) == 2
        model_mod.torch_chunk_gated_delta_rule(2)
    model_mod.torch_chunk_gated_delta_rule(3)  # outside recording: not counted, wrapper removed
    s = rec.summary()
    assert s["linear_attention"] == expect and s["calls"] == {f"torch_chunk_gated_delta_rule:{expect}": 2}


def test_fla_is_blocked_without_cuda(monkeypatch):
    assert select_linear_attention("cpu", "auto") == "torch"
    assert sys.modules["fla"] is None
    with pytest.raises(ConfigError, match="needs CUDA .* or Triton's interpreter"):
        select_linear_attention("cpu", "fla")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # allowed under the interpreter, where fla and triton must import
    assert select_linear_attention("cpu", "auto") == "torch"
    with pytest.raises(ConfigError, match="needs flash-linear-attention with triton installed"):
        select_linear_attention("cpu", "fla")
    with pytest.raises(ConfigError, match="expected auto, fla or torch"):
        select_linear_attention("cpu", "triton")
