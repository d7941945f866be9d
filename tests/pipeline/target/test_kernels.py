"""The linear-attention path is read from the calls, not assumed."""

import gc
import json
import logging
import sys
import types
import weakref

import pytest
import torch

from pipeline.target.kernels import UNDECIDED, KernelRecorder, family, select_linear_attention, served_by
from store.errors import ConfigError
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from tests import fla_standin
from tests.processes import cli_args


def _module(name: str, **functions) -> types.ModuleType:
    """A module named `name` holding functions whose code runs with that module's globals."""
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    for fn_name, fn in functions.items():
        if fn is not None:
            fn = types.FunctionType(fn.__code__, mod.__dict__, fn_name, fn.__defaults__, fn.__closure__)
        setattr(mod, fn_name, fn)
    return mod


def _closure_dispatch(implementation):
    """transformers 5.24's shape: a function of its integrations module closing over the implementation."""
    return _module("transformers.integrations.fake_closure", wrapped=lambda *a, **k: implementation(*a, **k)).wrapped


def _module_dispatch(by_device: dict):
    """transformers 5.25's shape: a `kernels` module object calling a dispatch that picks the
    implementation by the inputs' device (here a number's sign stands for the device)."""
    wrapped = _module(
        "transformers.integrations.fake_device", wrapped=lambda x: (by_device["cuda"] if x > 0 else by_device["cpu"])(x)
    ).wrapped
    forward = _module("kernels.fake_layer", forward=lambda self, x: wrapped(x)).forward
    return type("Func", (torch.nn.Module,), {"forward": forward})()


FLA = _module("fla.ops.fake", chunk=lambda x: x + 1).chunk
TORCH = _module("transformers.models.fake.modeling_fake", chunk=lambda x: x - 1).chunk
HUB = _module("kernels_hub_fake_0123", chunk=lambda x: x * 10).chunk


def test_family_from_the_package_of_the_code():
    assert family("fla.ops.gated_delta_rule.chunk") == "fla"
    assert family("transformers.models.qwen3_5.modeling_qwen3_5") == "torch"
    assert family("causal_conv1d.cpp_functions") == "causal_conv1d"
    assert family("kernels_hub_fake_0123") == "kernels_hub_fake_0123"
    for routing in (
        "transformers.integrations.hub_kernels",
        "transformers.utils.import_utils",
        "torch.nn.modules.module",
        "kernels._internals.layer.layer",
        "functools",
        "logging",
        "posixpath",
    ):
        assert family(routing) is None, routing


def test_a_warning_logged_on_the_way_is_routing():
    """transformers warns on a fallback's first call (unless its verbosity is lowered): logging then
    reaches os.path before the reference runs, which must not be taken for an implementation."""
    log, reference = logging.getLogger("dflash-test-fallback"), TORCH
    warn_first = _module(
        "transformers.integrations.fake_warn", f=lambda x: (log.warning("falls back"), reference(x))[1]
    ).f
    assert served_by(_closure_dispatch(warn_first), 3) == (2, "torch")


@pytest.mark.parametrize("impl,expect", [(FLA, "fla"), (TORCH, "torch"), (HUB, "kernels_hub_fake_0123")])
def test_served_by_names_the_code_that_ran_through_either_dispatch_shape(impl, expect):
    for dispatch in (_closure_dispatch(impl), _module_dispatch({"cuda": impl, "cpu": impl})):
        assert served_by(dispatch, 3) == (impl(3), expect)


def test_served_by_decides_per_call_not_per_wrapper():
    """One 5.25-shaped wrapper serving fla for one input and its PyTorch reference for another: each
    call is named by what served it (a wrapper's shape would name both the same)."""
    dispatch = _module_dispatch({"cuda": FLA, "cpu": TORCH})
    assert served_by(dispatch, 5) == (6, "fla")
    assert served_by(dispatch, -5) == (-6, "torch")


def test_a_call_that_reaches_no_known_code_is_undecided_and_profiling_is_restored():
    seen = []

    def outer_profiler(frame, event, arg):
        seen.append(event)

    routing_only = _module("transformers.integrations.fake_routing", f=lambda x: abs(x)).f
    sys.setprofile(outer_profiler)
    try:
        assert served_by(_closure_dispatch(routing_only), -2) == (2, UNDECIDED)
        assert sys.getprofile() is outer_profiler
        served_by(_module_dispatch({"cuda": FLA, "cpu": FLA}), 1)  # decided early: profiling handed back
        assert sys.getprofile() is outer_profiler
    finally:
        sys.setprofile(None)
    assert served_by(FLA, 1) == (2, "fla") and sys.getprofile() is None


# A fake package whose object runs code of its own when finalized (a class with __del__ needs the
# module's globals, so the source runs in them).
_OWNER_SOURCE = """
class Held:
    def __del__(self):
        clean_up()


def clean_up():
    return 0
"""

# Routing that has an owner's object finalized before it reaches fla: by a collection (a cycle), by
# its last reference, or through weakref.finalize.
_FINALIZING_ROUTING_SOURCE = """
def collected(x):
    held = owner.Held()
    held.cycle = held
    del held
    gc.collect()
    return fla(x)


def dropped(x):
    owner.Held()
    return fla(x)


class Plain:
    pass


def finalized(x):
    plain = Plain()
    weakref.finalize(plain, owner.clean_up)
    del plain
    return fla(x)
"""


def _finalizing_routing():
    """Routing code that, before it reaches fla, has an object of another package finalized."""
    owner = _module("finalizing_owner_fake")
    exec(_OWNER_SOURCE, owner.__dict__)
    routing = _module("transformers.integrations.fake_finalizing")
    routing.__dict__.update(gc=gc, weakref=weakref, owner=owner, fla=FLA)
    exec(_FINALIZING_ROUTING_SOURCE, routing.__dict__)
    return routing


@pytest.mark.parametrize("path", ["collected", "dropped", "finalized"])
def test_a_finalizer_run_on_the_way_is_not_the_implementation(path):
    """Finalizers run wherever a collection or a last reference falls, inside a 5.25 wrapper too:
    the package that owns the finalized object did not serve the call."""
    routing = getattr(_finalizing_routing(), path)
    gc_callbacks = list(gc.callbacks)
    for dispatch in (_closure_dispatch(routing), _module_dispatch({"cuda": routing, "cpu": routing})):
        assert served_by(dispatch, 3) == (4, "fla")
    assert gc.callbacks == gc_callbacks


@pytest.mark.parametrize(
    "dispatch_shape", [_closure_dispatch, lambda impl: _module_dispatch({"cuda": impl, "cpu": impl})]
)
@pytest.mark.parametrize("impl,expect", [(FLA, "fla"), (TORCH, "torch")])
def test_recorder_counts_what_served_each_call(dispatch_shape, impl, expect):
    model_mod = _module(f"transformers.models.fake_{expect}.modeling", torch_chunk_gated_delta_rule=None)
    model_mod.torch_chunk_gated_delta_rule = dispatch_shape(impl)
    model_cls = type("FakeModel", (), {"__module__": model_mod.__name__})
    rec = KernelRecorder(model_cls())
    assert rec.summary()["linear_attention"] == "none"  # nothing ran yet
    with rec.recording():
        assert model_mod.torch_chunk_gated_delta_rule(1) == impl(1)
        model_mod.torch_chunk_gated_delta_rule(2)
    model_mod.torch_chunk_gated_delta_rule(3)  # outside recording: not counted, wrapper removed
    s = rec.summary()
    assert s["linear_attention"] == expect and s["calls"] == {f"torch_chunk_gated_delta_rule:{expect}": 2}


def test_an_undecided_call_makes_the_summary_undecided():
    model_mod = _module("transformers.models.fake_undecided.modeling", torch_chunk_gated_delta_rule=None)
    model_mod.torch_chunk_gated_delta_rule = _closure_dispatch(_module("transformers.fake_moved", f=lambda x: abs(x)).f)
    rec = KernelRecorder(type("FakeModel", (), {"__module__": model_mod.__name__})())
    with rec.recording():
        model_mod.torch_chunk_gated_delta_rule(-1)
    assert rec.summary()["linear_attention"] == UNDECIDED


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


def _standin_extract(tmp_path, small_dataset, choice: str):
    """Shard 0 of the small store under the stand-in fla (tests/fla_standin.py): the store, and the
    stand-in's calls."""
    store, calls = tmp_path / f"{choice}.zarr", tmp_path / f"{choice}.calls.json"
    p = fla_standin.run([*cli_args(store, small_dataset, "0"), "--linear-attention", choice], calls)
    assert p.returncode == 0, p.stderr[-3000:]
    return HiddenStore(str(store)), json.loads(calls.read_text())


def test_transformers_fla_dispatch_serves_the_calls_and_the_store_says_so(tmp_path, small_dataset):
    """What a GPU does, on any CPU: transformers dispatches the Gated DeltaNet calls to (a stand-in)
    fla, which serves prefill, decode and capture; the store records fla. With torch chosen the
    stand-in is never called and the store records torch. The states agree within fp32 rounding
    (the stand-in's naive recurrence against transformers' chunked reference), so its outputs
    really were the forward's."""
    fla, fla_calls = _standin_extract(tmp_path, small_dataset, "fla")
    torch_store, torch_calls = _standin_extract(tmp_path, small_dataset, "torch")
    assert fla_calls["chunk_gated_delta_rule"] > 0 and fla_calls["fused_recurrent_gated_delta_rule"] > 0
    assert torch_calls == {}
    for store, choice in ((fla, "fla"), (torch_store, "torch")):
        b = store.attrs.backends
        assert (b.linear_attention, b.linear_attention_requested, store.attrs.compat.linear_attention) == (choice,) * 3
        assert {k for k in b.kernel_calls if "gated_delta_rule" in k} == {
            f"torch_chunk_gated_delta_rule:{choice}",
            f"torch_recurrent_gated_delta_rule:{choice}",
        }, b.kernel_calls
        assert store.commit_record(0).run["backends"]["linear_attention"] == choice
    at_commit = fla.commit_record(0).run["backends"]["kernel_calls"]  # the probe's calls and the shard's
    assert sum(n for k, n in at_commit.items() if k.endswith("gated_delta_rule:fla")) == sum(fla_calls.values())
    for a, f in zip(ShardReader(torch_store, 0), ShardReader(fla, 0), strict=True):
        assert torch.equal(a.tokens, f.tokens)
        assert float((a.hidden.float() - f.hidden.float()).abs().max()) < 0.05
