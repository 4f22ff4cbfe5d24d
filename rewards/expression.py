"""A safe evaluator for arithmetic expressions over integers: + - * / and parentheses.

Never `eval`: a tokenizer and a recursive-descent parser that accept nothing else (no unary
minus, no exponent, no names). Every input is bounded before any arithmetic is done: its
length, the digits of each literal, the nesting depth and the size of intermediate values,
so `9**9**9`, megabytes of text or 10,000 nested parentheses are rejected in microseconds.
Division is exact (fractions.Fraction).
"""
from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 200          # longer text is not a countdown answer
MAX_LITERAL_DIGITS = 6
MAX_DEPTH = 32           # parenthesis nesting (also bounds the parser's recursion)
MAX_VALUE_BITS = 256     # numerator or denominator larger than 2**256: reject

_TOKEN = re.compile(r"\s*(?:(?P<number>[0-9]+)|(?P<op>[-+*/()]))", re.ASCII)


class ExpressionError(ValueError):
    """The text is not an allowed expression (or divides by zero, or is too large)."""


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """(exact value, integer literals in order of appearance) of `text`.

    Raises ExpressionError for anything outside: integer literals, + - * /, parentheses and
    whitespace; for division by zero; and for inputs beyond the module's size bounds.
    """
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    parser = _Parser(_tokenize(text))
    value = parser.expression(depth=0)
    if parser.position != len(parser.tokens):
        raise ExpressionError(f"unexpected {parser.tokens[parser.position]!r}")
    return value, parser.literals


def _tokenize(text: str) -> list[str]:
    tokens, position, end = [], 0, len(text.rstrip())
    while position < end:
        match = _TOKEN.match(text, position)
        if match is None:
            raise ExpressionError(f"character {text[position:].lstrip()[:1]!r} not allowed")
        token = match["number"] or match["op"]
        if match["number"] and len(token) > MAX_LITERAL_DIGITS:
            raise ExpressionError(f"number with more than {MAX_LITERAL_DIGITS} digits")
        tokens.append(token)
        position = match.end()
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


class _Parser:
    """expression := term (("+" | "-") term)*;  term := factor (("*" | "/") factor)*;
    factor := NUMBER | "(" expression ")"."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.position = tokens, 0
        self.literals: list[int] = []

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ExpressionError("expression ends too early")
        self.position += 1
        return token

    def expression(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self._take()
            right = self.term(depth)
            value = _bounded(value + right if op == "+" else value - right)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self._peek() in ("*", "/"):
            op = self._take()
            right = self.factor(depth)
            if op == "/" and right == 0:
                raise ExpressionError("division by zero")
            value = _bounded(value * right if op == "*" else value / right)
        return value

    def factor(self, depth: int) -> Fraction:
        token = self._take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expression(depth + 1)
            if self._take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if token.isdigit():
            self.literals.append(int(token))
            return Fraction(int(token))
        raise ExpressionError(f"expected a number or '(', got {token!r}")


def _bounded(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_VALUE_BITS:
        raise ExpressionError("intermediate value too large")
    return value
