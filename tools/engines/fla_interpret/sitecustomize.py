"""Three shims that let flash-linear-attention's Triton kernels run on CPU under Triton's interpreter
(TRITON_INTERPRET=1), for the opt-in `fla_interpret` tests and benches and the stand-in fla of
tests/fla_standin.py only: Python imports this module at start-up when tools/engines/fla_interpret
is on PYTHONPATH (tests/fla_interpret.py and tests/fla_standin.py put it there). Nothing in the
package imports it.

1. The autotuner times its configs through a GPU driver, of which the interpreter has none ("0
   active drivers"): every config is timed equal instead, so the first one is taken.
2. The interpreter leaves the variable of a plain `for i in range(n)` a Python int, and fla calls
   `i.to(tl.int64)` on it: the interpreter's AST rewrite, which already turns every assignment's
   value into a tensor, also assigns each `for` loop's variable to itself at the top of the body.
3. transformers (5.25 and later) sends tensors on a device outside its list for fla (cuda, xpu,
   ...) to its PyTorch path, whatever is installed: cpu joins that list as soon as the module
   holding it is imported, before any model code reads it, so fla serves CPU tensors as it serves
   a GPU's. Without triton (the stand-in fla) this shim alone applies.
"""

import ast
import importlib.machinery
import os
import sys


def _skip_benchmarks() -> None:
    from triton.runtime import autotuner

    def equal_times(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = equal_times


def _loop_variables_as_tensors() -> None:
    from triton.runtime import interpreter

    class WithLoopVariables(interpreter.ASTTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                again = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load())
                )
                node.body.insert(0, self.visit_Assign(again))
            return node

    interpreter.FunctionRewriter.ast_transformer = WithLoopVariables()


class _AfterImport:
    """A meta path finder that runs `then(module)` right after the module `name` is first executed."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then(module):
                exec_module(module)
                self.then(module)

            spec.loader.exec_module = exec_then
        return spec


def _fla_on_cpu(hub_kernels) -> None:
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)  # absent before 5.25: nothing to widen
    if devices is not None and "cpu" not in devices.get("fla", ("cpu",)):
        devices["fla"] = (*devices["fla"], "cpu")


if os.environ.get("TRITON_INTERPRET") == "1":
    sys.meta_path.insert(0, _AfterImport("transformers.integrations.hub_kernels", _fla_on_cpu))
    try:
        _skip_benchmarks()
        _loop_variables_as_tensors()
    except ImportError:  # no triton here: nothing to shim
        pass
