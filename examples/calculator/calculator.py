"""The example's tool: a calculator the model calls with an arithmetic expression
(`env.tools=[calculator.calculator]`).

It reads the expression as Python's own parser does and evaluates only numbers, + - * / // % ** and brackets, so a
model cannot run code through it; anything else is an error, which goes back to the model as text.
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / and brackets, for example "347 * 28"
    """
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 10:  # 9**9**9 would hang the episode
            raise ValueError("exponents above 10 are not supported")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")
