"""Two shims that let flash-linear-attention's Triton kernels run on CPU under Triton's interpreter
(TRITON_INTERPRET=1), for the opt-in `fla_interpret` tests and benches only: Python imports this
module at start-up when tools/engines/fla_interpret is on PYTHONPATH (tests/fla_interpret.py puts
it there). Nothing in the package imports it.

1. The autotuner times its configs through a GPU driver, of which the interpreter has none ("0
   active drivers"): every config is timed equal instead, so the first one is taken.
2. The interpreter leaves the variable of a plain `for i in range(n)` a Python int, and fla calls
   `i.to(tl.int64)` on it: the interpreter's AST rewrite, which already turns every assignment's
   value into a tensor, also assigns each `for` loop's variable to itself at the top of the body.
"""

import ast
import os


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
                again = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=ast.Name(id=name, ctx=ast.Load()))
                node.body.insert(0, self.visit_Assign(again))
            return node

    interpreter.FunctionRewriter.ast_transformer = WithLoopVariables()


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        _skip_benchmarks()
        _loop_variables_as_tensors()
    except ImportError:  # no triton here: nothing to shim
        pass
