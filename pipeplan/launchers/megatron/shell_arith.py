"""Bash's arithmetic and ``$'...'`` text for the launch-script reader (:mod:`pipeplan.launchers.megatron.shell`).

Bash computes in 64-bit signed integers that wrap around, truncates division toward zero (C's
rule, not Python's floor), gives a remainder the dividend's sign, and reads ``010`` as octal
and ``16#ff`` in a base; these helpers do the same, so that ``$(( -9/2 ))`` is -4 as in bash.
"""

from __future__ import annotations

import ast
import operator
import re

__all__ = ["ansi_c", "ansi_c_end", "based", "eval_int", "literal"]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: lambda a, b: _c_div(a, b),
        ast.Mod: lambda a, b: _c_mod(a, b), ast.Pow: lambda a, b: _c_pow(a, b), ast.BitAnd: operator.and_,
        ast.BitOr: operator.or_, ast.BitXor: operator.xor,
        ast.LShift: lambda a, b: a << (b & 63), ast.RShift: lambda a, b: a >> (b & 63)}


def eval_int(node) -> int:
    """Bash arithmetic on a parsed expression: every result wrapped to 64 bits."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return _wrap(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _wrap(_OPS[type(node.op)](eval_int(node.left), eval_int(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)):
        value = eval_int(node.operand)
        return _wrap(-value if isinstance(node.op, ast.USub) else ~value if isinstance(node.op, ast.Invert) else value)
    raise ValueError("unsupported arithmetic")


def ansi_c_end(text: str, i: int) -> int:
    """Index of the ``'`` ending a ``$'...'`` whose body starts at ``i`` (``\\'`` does not end it)."""
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "'":
            return i
        i += 1
    return -1


_ANSI_C = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f",
           "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}


def ansi_c(body: str) -> str:
    """The text of ``$'body'``: bash's backslash escapes (``\\n``, ``\\t``, ``\\xHH``, ``\\nnn`` octal, ...)."""
    def one(m: re.Match) -> str:
        esc = m.group(1)
        if esc[0] in _ANSI_C and len(esc) == 1:
            return _ANSI_C[esc]
        if esc[0] in "xuU":
            return chr(int(esc[1:], 16)) if len(esc) > 1 else m.group()
        if esc[0] in "01234567":
            return chr(int(esc, 8) & 0xFF)
        return m.group()
    return re.sub(r"\\(x[0-9A-Fa-f]{1,2}|u[0-9A-Fa-f]{1,4}|U[0-9A-Fa-f]{1,8}|[0-7]{1,3}|.)", one, body, flags=re.S)


def literal(token: str) -> int:
    """A bash integer constant: ``0x1f`` hex, ``010`` octal (``08`` is an error, as in bash)."""
    if token[:2] in ("0x", "0X"):
        return int(token, 16)
    if len(token) > 1 and token[0] == "0":
        return int(token, 8)  # ValueError on 8 or 9: bash says "value too great for base"
    return int(token)


def based(base: str, digits: str) -> int:
    """``BASE#DIGITS`` (bases 2 to 64; bash's digit order: 0-9, a-z, A-Z, @, _)."""
    number = int(base)
    if not 2 <= number <= 64:
        raise ValueError("invalid arithmetic base")
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ@_"
    if number <= 36:
        digits = digits.lower()
    value = 0
    for char in digits:
        position = alphabet.find(char)
        if not 0 <= position < number:
            raise ValueError("value too great for base")
        value = value * number + position
    return _wrap(value)


def _wrap(value: int) -> int:
    """Bash's 64-bit signed arithmetic: results wrap around."""
    value &= 2**64 - 1
    return value - 2**64 if value >= 2**63 else value


def _c_div(a: int, b: int) -> int:
    # Bash (C) truncates toward zero: $(( -9/2 )) is -4, not Python's -5.
    if b == 0:
        raise ZeroDivisionError
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    # The remainder has the dividend's sign: $(( -1 % 5 )) is -1, not Python's 4.
    return a - b * _c_div(a, b)


def _c_pow(a: int, b: int) -> int:
    if b < 0:
        raise ValueError("exponent less than 0")
    return pow(a, b, 2**64)
