"""Which linear-attention kernels actually run: selected before import, observed at run time.

Transformers resolves the Gated DeltaNet functions when the modeling module is imported: the fla
kernels if `fla` imports, otherwise its PyTorch reference. On a machine without CUDA the fla path
must stay off (`fla` imports fine but its triton kernels crash), so `select_linear_attention`
blocks it before the model code loads. `KernelRecorder` then wraps the functions the model
module calls and records, for each call, the implementation that served it, so the store states
what ran, not what was intended.

Which implementation served a call is read from the call itself (`served_by`): the first code it
reaches past the wrappers that route it. transformers has changed those wrappers from release to
release (5.25 turned each function into a `kernels` module object that dispatches by the inputs'
device, to a hub kernel, the package, or its PyTorch reference), and a record inferred from a
wrapper's shape silently flipped; a record read from the frames that ran does not depend on it.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import threading
import weakref
from collections import Counter
from contextlib import contextmanager

from store.errors import ConfigError

# Functions that transformers' hybrid models (qwen3_5, qwen3_next, ...) call for linear attention.
LINEAR_ATTENTION_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def select_linear_attention(device_type: str, choice: str) -> str:
    """Pick the Gated DeltaNet path. Must run before the target's model code is imported.

    auto: fla on CUDA when fla and triton are installed, else torch. torch: block fla (always
    so without CUDA, where fla imports but its kernels crash, unless fla is asked for under
    Triton's interpreter). fla: require it, on CUDA or, without CUDA, with TRITON_INTERPRET=1 (the
    kernels' own code run by the interpreter on CPU tensors: slow, for parity checks).
    Returns the path requested: "fla" or "torch".
    """
    if choice not in ("auto", "fla", "torch"):
        raise ConfigError("--linear-attention", choice, "expected auto, fla or torch")
    if choice == "fla" and device_type != "cuda" and not interpreted():
        raise ConfigError(
            "--linear-attention",
            "fla",
            f"needs CUDA (this run's device is {device_type}), or "
            "Triton's interpreter (TRITON_INTERPRET=1) to run the kernels' code on CPU",
        )
    if choice == "fla" and not fla_installed():
        raise ConfigError("--linear-attention", "fla", "needs flash-linear-attention with triton installed")
    if choice == "fla":
        return "fla"
    if device_type != "cuda" or choice == "torch":
        sys.modules["fla"] = None  # an import of fla now fails, so transformers takes its torch path
        return "torch"
    return "fla" if fla_installed() else "torch"


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1) rather than compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fla_installed() -> bool:
    if sys.modules.get("fla", ...) is None:
        return False
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


# Top-level packages whose code only routes a call to the implementation that serves it: module
# and hub-kernel wrappers (torch.nn, kernels), transformers' dispatch and what it calls on the way
# (device and compile checks, logging). transformers' modeling code is not among them: it holds
# the PyTorch reference (`family`).
ROUTING = frozenset(
    {
        "torch",
        "kernels",
        "transformers",
        "functools",
        "contextlib",
        "logging",
        "warnings",
        "inspect",
        "typing",
        "abc",
        "threading",
        "importlib",
        "weakref",
        "collections",
        "copy",
    }
)
UNDECIDED = "undecided"


def family(module_name: str) -> str | None:
    """The implementation family of code in `module_name`: 'torch' for transformers' modeling
    code (its PyTorch reference), None for routing code, else the top-level package ('fla',
    'causal_conv1d', or a hub kernel's module)."""
    if module_name.startswith("transformers.models."):
        return "torch"
    root = module_name.split(".")[0]
    # The standard library never serves a kernel, but is reached on the way: a fallback's first call
    # warns, and logging then runs os.path, threading and multiprocessing code before the reference.
    return None if root in ROUTING or root in sys.stdlib_module_names or not root else root


class _FirstImplementation:
    """A profile function for one call: the family of the first code the call reaches past its
    routing, read from the frames that actually ran. Profiling stops once it is known.

    Code that runs inside the call without being called by it is set aside: a logging call's
    handlers, and finalizers (`__del__`, `weakref.finalize`, anything a garbage collection runs),
    which run wherever an allocation or a last reference happens to fall: a collection inside a
    5.25-shaped wrapper would otherwise name a call it routed to fla after the package owning the
    collected object. (A weakref's bare callback run by a last reference is not told apart.)"""

    def __init__(self, previous, origin: int) -> None:
        self.previous = previous
        # id() of the frame that made the call, where the walk for finalizers stops (the frame itself
        # would make a cycle through its locals that keeps the call's arguments alive until a collection)
        self.origin = origin
        self.found: str | None = None
        self.collecting = False
        self.thread = threading.get_ident()

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or self.found is not None or self.collecting or frame.f_code is _GC_PHASE:
            return
        if _aside(frame, self.origin):
            return
        self.found = family(frame.f_globals.get("__name__") or "")
        if self.found is not None:
            sys.setprofile(self.previous)

    def gc_phase(self, phase: str, info: dict) -> None:
        """A `gc.callbacks` entry: what runs between a collection's start and stop (on the call's
        thread) is a finalizer."""
        if threading.get_ident() == self.thread:
            self.collecting = phase == "start"


_GC_PHASE = _FirstImplementation.gc_phase.__code__


def _aside(frame, origin: int) -> bool:
    """Whether frame runs inside a logging call or a finalizer, below origin: what a message's
    handlers run (anyone's: a test runner's, a launcher's) or an object's clean-up is never the
    implementation."""
    while frame is not None and id(frame) != origin:
        code = frame.f_code
        if code.co_name == "__del__" or code is _FINALIZE_CALL:
            return True
        if (frame.f_globals.get("__name__") or "").split(".")[0] == "logging":
            return True
        frame = frame.f_back
    return False


_FINALIZE_CALL = weakref.finalize.__call__.__code__


def served_by(fn, *args, **kwargs) -> tuple[object, str]:
    """Call fn; return its result and the family of the implementation that served the call
    (UNDECIDED when the call reached no code outside the routing)."""
    previous = sys.getprofile()
    probe = _FirstImplementation(previous, id(sys._getframe()))
    gc.callbacks.append(probe.gc_phase)
    sys.setprofile(probe)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(previous)
        gc.callbacks.remove(probe.gc_phase)
    return out, probe.found or UNDECIDED


class KernelRecorder:
    """Counts, per wrapped function, which implementation family served each call."""

    def __init__(self, model) -> None:
        self.module = sys.modules[type(model).__module__]
        for base in type(model).__mro__:  # the decoder lives in the class's own modeling module
            mod = sys.modules.get(base.__module__)
            if mod is not None and any(hasattr(mod, n) for n in LINEAR_ATTENTION_FUNCTIONS):
                self.module = mod
                break
        self.calls: Counter[str] = Counter()

    @property
    def names(self) -> list[str]:
        return [n for n in LINEAR_ATTENTION_FUNCTIONS if callable(getattr(self.module, n, None))]

    @contextmanager
    def recording(self):
        originals = {n: getattr(self.module, n) for n in self.names}
        try:
            for name, fn in originals.items():
                setattr(self.module, name, self._wrap(name, fn))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(self.module, name, fn)

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            out, served = served_by(fn, *args, **kwargs)
            self.calls[f"{name}:{served}"] += 1
            return out

        return recorded

    def summary(self) -> dict:
        """{'linear_attention': 'fla'|'torch'|<package>|'mixed'|'none'|UNDECIDED, 'conv1d': ...,
        'calls': {'function:family': n}}."""

        def fam(prefixes: tuple[str, ...]) -> str:
            seen = {k.split(":")[1] for k in self.calls if k.split(":")[0].endswith(prefixes)}
            if not seen or UNDECIDED in seen:
                return UNDECIDED if seen else "none"
            return seen.pop() if len(seen) == 1 else "mixed"

        return {
            "linear_attention": fam(("gated_delta_rule",)),
            "conv1d": fam(("causal_conv1d_fn", "causal_conv1d_update")),
            "calls": dict(sorted(self.calls.items())),
        }
