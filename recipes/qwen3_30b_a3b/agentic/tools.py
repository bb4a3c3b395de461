"""A calculator tool for the agentic Qwen3-30B-A3B recipes (`tools: [recipes.qwen3_30b_a3b.agentic.tools.calculate]`).

TRL's tool loop builds the tool's JSON schema from the type hints and the `Args:` section of the docstring
(transformers' `get_json_schema`), renders it into the system prompt with the chat template, and runs the call the
model writes. A call that raises becomes the tool result `{'error': '...'}` and counts in `tools/failure_frequency`
(and, with `failed_tool_credit`, gives that turn its own credit), so every refusal below is a short `ValueError`
the model can read and correct.

Safe by construction: the expression is parsed with `ast` and only numbers, `+ - * / // % **` and parentheses are
evaluated; no names, calls or attributes, and sizes are bounded so no call can hang a training process.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 500
MAX_RESULT_CHARS = 100  # a longer result would eat the completion budget (TRL drops a tool result that does not fit)
MAX_POWER_BITS = 4096  # an integer power of more bits is refused before it is computed (9**9**9 would hang)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _power(base, exponent):
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * abs(base).bit_length() > MAX_POWER_BITS:
            raise ValueError("result too large")
    return base**exponent


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str or complex
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported: {ast.unparse(node)[:40]!r}; use numbers, + - * / // % ** and parentheses")


def _format(value) -> str:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ValueError("the result is not a real number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        text = format(value, ".15g")  # 0.1 + 0.2 -> 0.3, not 0.30000000000000004
    else:
        if abs(value).bit_length() > 4 * MAX_RESULT_CHARS:  # refused before str(), which is slow on huge ints
            raise ValueError(f"the result has more than {MAX_RESULT_CHARS} digits")
        text = str(value)
    if len(text) > MAX_RESULT_CHARS:
        raise ValueError(f"the result has {len(text)} characters, more than {MAX_RESULT_CHARS}")
    return text


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 2**10".

    Returns:
        The value of the expression, as text.
    """
    if not isinstance(expression, str):
        raise ValueError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        # Models often write 2^10 for a power; in Python ^ is xor, which is not offered anyway.
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except (SyntaxError, RecursionError):
        raise ValueError("not a valid arithmetic expression") from None
    try:
        return _format(_evaluate(tree.body))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except (OverflowError, RecursionError):
        raise ValueError("result too large or too deeply nested") from None
