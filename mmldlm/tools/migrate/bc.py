"""A model of GNU bc for the arithmetic an older launcher pipes into it (`echo "scale=10; $A * $B" | bc`),
used by `mmldlm migrate` where bc is not installed (the migrate report says so) and, with --lenient, to
compute what a launcher meant where bc refused a number.

What it reads, as GNU bc 1.07 does: statements separated by `;` or newlines; numbers of digits and one
point; uppercase letters as digits (a lone letter is its value, A=10; in a longer number each counts as
9, the largest base-10 digit, so `5E-5` is 59 - 5 = 54); lowercase variables (0 until set, `scale`,
`ibase`/`obase` read at 10 only); `= += -= *= /= %= ^=`; unary minus, `^` (integer exponent, right to
left), `* / %`, `+ -`, comparisons (1 or 0), `! && ||`; sqrt, length, scale and, with -l, l and e.
Results are truncated, never rounded, to bc's scale rules (a + b: the larger scale; a * b:
min(sa + sb, max(scale, sa, sb)); a / b: scale; a ^ n: min(sa * n, max(scale, sa))), and printed as bc
prints them (no leading zero, lines of 70 characters ended by a backslash). A line with a syntax error
prints `(standard_in) N: syntax error` on stderr and nothing of that line, and bc still exits 0: that
is what leaves a launcher's `$(... | bc)` empty. Anything else (define, if, while, for, print, arrays)
is refused with exit status 3 and a line on stderr naming it, so that the caller names it too.

    python bc.py [-l] [-q] [--lenient] [FILE...] < input
"""

from __future__ import annotations

import decimal
import re
import sys
from decimal import Decimal

TOKEN = re.compile(
    r"\s*(?:(?P<number>[0-9A-Z]+(?:\.[0-9A-Z]*)?|\.[0-9A-Z]+)"
    r"|(?P<name>[a-z][a-z0-9_]*)"
    r"|(?P<op>\+=|-=|\*=|/=|%=|\^=|==|!=|<=|>=|&&|\|\||[-+*/%^()<>=!,;]))"
)
LENIENT_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([-+]?\d+)")
UNSUPPORTED = {"define", "if", "while", "for", "print", "return", "auto", "read", "break", "continue", "halt"}
LINE_LENGTH = 70


class BcSyntaxError(Exception):
    pass


class BcRuntimeError(Exception):
    pass


class Unsupported(Exception):
    pass


def scale_of(x: Decimal) -> int:
    return max(0, -x.as_tuple().exponent)


def truncate(x: Decimal, scale: int) -> Decimal:
    return x.quantize(Decimal(1).scaleb(-scale), rounding=decimal.ROUND_DOWN)


def number_value(text: str) -> Decimal:
    """A bc number literal in base 10; uppercase letters are digits (see the module's docstring)."""
    if len(text) == 1 and text.isupper():
        return Decimal(ord(text) - ord("A") + 10)
    whole, _, frac = text.partition(".")
    digits = lambda s: "".join("9" if c.isupper() else c for c in s)  # noqa: E731
    value = Decimal(digits(whole) or "0") + (Decimal("0." + digits(frac)) if frac else Decimal(0))
    return value.quantize(Decimal(1).scaleb(-len(frac))) if frac else value


class Bc:
    def __init__(self, math_library: bool):
        decimal.getcontext().prec = 1000
        self.vars: dict[str, Decimal] = {"scale": Decimal(20 if math_library else 0)}
        self.math_library = math_library

    @property
    def scale(self) -> int:
        return int(self.vars["scale"])

    # ---------------------------------------------------------------- parsing

    def tokens(self, line: str) -> list[tuple[str, str]]:
        out, pos = [], 0
        while pos < len(line.rstrip()):
            m = TOKEN.match(line, pos)
            if m is None or m.end() == pos:
                raise BcSyntaxError
            kind = m.lastgroup
            out.append((kind, m.group(kind)))
            pos = m.end()
        return out

    def run_line(self, line: str) -> list[str]:
        """The lines printed for one input line; raises on a syntax error (nothing of the line runs)."""
        line = re.sub(r"/\*.*?\*/", " ", line.split("#", 1)[0])
        toks = self.tokens(line)
        words = {t for k, t in toks if k == "name"}
        if words & UNSUPPORTED or "[" in line or "{" in line or '"' in line:
            raise Unsupported(", ".join(sorted(words & UNSUPPORTED)) or "arrays, blocks or strings")
        statements, current = [], []
        for tok in toks:
            if tok == ("op", ";"):
                statements.append(current)
                current = []
            else:
                current.append(tok)
        statements.append(current)
        parsed = [self.parse_statement(s) for s in statements if s]  # all parsed before any runs
        printed = []
        for node in parsed:
            try:
                value, show = self.evaluate_statement(node)
            except BcRuntimeError as err:
                print(f"Runtime error (func=(main), adr=0): {err}", file=sys.stderr)
                continue
            if show:
                printed.append(format_number(value))
        return printed

    def parse_statement(self, toks: list[tuple[str, str]]):
        if toks == [("name", "quit")]:
            return ("quit",)
        if len(toks) >= 2 and toks[0][0] == "name" and toks[1][0] == "op" and toks[1][1].endswith("="):
            if toks[1][1] not in ("==", "<=", ">=", "!="):
                expr, rest = self.parse_expr(toks[2:], 0)
                if rest:
                    raise BcSyntaxError
                return ("assign", toks[0][1], toks[1][1], expr)
        expr, rest = self.parse_expr(toks, 0)
        if rest:
            raise BcSyntaxError
        return ("print", expr)

    # bc's precedence, loosest first: || && ! (relations) + - (* / %) ^ (unary -)
    BINARY = {"||": 1, "&&": 2, "==": 4, "!=": 4, "<": 4, ">": 4, "<=": 4, ">=": 4, "+": 5, "-": 5}
    BINARY.update({"*": 6, "/": 6, "%": 6, "^": 8})

    def parse_expr(self, toks, min_level):
        left, toks = self.parse_unary(toks)
        while toks and toks[0][0] == "op" and self.BINARY.get(toks[0][1], -1) >= min_level:
            op = toks[0][1]
            level = self.BINARY[op]
            right, toks = self.parse_expr(toks[1:], level if op == "^" else level + 1)  # ^ is right-assoc
            left = ("binary", op, left, right)
        return left, toks

    def parse_unary(self, toks):
        if not toks:
            raise BcSyntaxError
        kind, text = toks[0]
        if (kind, text) == ("op", "-"):  # binds tighter than ^: -2^2 is 4
            operand, rest = self.parse_unary(toks[1:])
            return ("neg", operand), rest
        if (kind, text) == ("op", "!"):
            operand, rest = self.parse_expr(toks[1:], 3)
            return ("not", operand), rest
        if (kind, text) == ("op", "("):
            inner, rest = self.parse_expr(toks[1:], 0)
            if not rest or rest[0] != ("op", ")"):
                raise BcSyntaxError
            return inner, rest[1:]
        if kind == "number":
            return ("number", number_value(text)), toks[1:]
        if kind == "name":
            if len(toks) > 1 and toks[1] == ("op", "("):
                args, rest = self.parse_expr(toks[2:], 0)
                if not rest or rest[0] != ("op", ")"):
                    raise BcSyntaxError
                return ("call", text, args), rest[1:]
            return ("var", text), toks[1:]
        raise BcSyntaxError

    # ---------------------------------------------------------------- evaluation

    def evaluate_statement(self, node):
        if node[0] == "quit":
            raise SystemExit(0)
        if node[0] == "assign":
            _, name, op, expr = node
            value = self.evaluate(expr)
            if op != "=":
                value = self.binary(op[0], self.vars.get(name, Decimal(0)), value)
            if name in ("ibase", "obase") and value != 10:
                raise Unsupported(f"{name}={value}")
            self.vars[name] = truncate(value, 0) if name == "scale" else value
            return value, False
        return self.evaluate(node[1]), True

    def evaluate(self, node) -> Decimal:
        kind = node[0]
        if kind == "number":
            return node[1]
        if kind == "var":
            return self.vars.get(node[1], Decimal(0))
        if kind == "neg":
            return -self.evaluate(node[1])
        if kind == "not":
            return Decimal(int(self.evaluate(node[1]) == 0))
        if kind == "call":
            return self.call(node[1], self.evaluate(node[2]))
        return self.binary(node[1], self.evaluate(node[2]), self.evaluate(node[3]))

    def binary(self, op: str, a: Decimal, b: Decimal) -> Decimal:
        sa, sb, scale = scale_of(a), scale_of(b), self.scale
        if op in ("+", "-"):
            return truncate(a + b if op == "+" else a - b, max(sa, sb))
        if op == "*":
            return truncate(a * b, min(sa + sb, max(scale, sa, sb)))
        if op in ("/", "%"):
            if b == 0:
                raise BcRuntimeError("Divide by zero")
            quotient = truncate(a / b, scale)
            if op == "/":
                return quotient
            return truncate(a - quotient * b, max(scale + sb, sa))
        if op == "^":
            if scale_of(b) and b != b.to_integral_value():
                print("Runtime warning (func=(main), adr=0): non-zero scale in exponent", file=sys.stderr)
            n = int(b)
            if n >= 0:
                return truncate(a**n, min(sa * n, max(scale, sa)))
            if a == 0:
                raise BcRuntimeError("Divide by zero")
            return truncate(1 / a ** (-n), scale)
        comparisons = {"==": a == b, "!=": a != b, "<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b}
        if op in comparisons:
            return Decimal(int(comparisons[op]))
        return Decimal(int(bool(a) and bool(b))) if op == "&&" else Decimal(int(bool(a) or bool(b)))

    def call(self, name: str, x: Decimal) -> Decimal:
        scale = self.scale
        if name == "sqrt":
            if x < 0:
                raise BcRuntimeError("Square root of a negative number")
            return truncate(x.sqrt(), max(scale, scale_of(x)))
        if name == "length":
            digits = x.as_tuple().digits
            return Decimal(max(len(digits), scale_of(x)) if x else 1)
        if name == "scale":
            return Decimal(scale_of(x))
        if self.math_library and name in ("l", "e"):
            if name == "l" and x <= 0:
                raise BcRuntimeError("log of a number <= 0")
            return truncate(x.ln() if name == "l" else x.exp(), scale)
        raise Unsupported(f"function {name}()")


def format_number(x: Decimal) -> str:
    if x == 0:
        return "0"
    text = format(x, "f")
    if text.startswith("0."):
        text = text[1:]
    elif text.startswith("-0."):
        text = "-" + text[2:]
    lines = []
    while len(text) > LINE_LENGTH - 1:  # 68 characters and a backslash
        lines.append(text[: LINE_LENGTH - 2] + "\\")
        text = text[LINE_LENGTH - 2 :]
    return "\n".join([*lines, text])


def main(argv: list[str]) -> int:
    options = [a for a in argv if a.startswith("-")]
    files = [a for a in argv if not a.startswith("-")]
    bc = Bc(math_library=any(o in ("-l", "--mathlib") for o in options))
    text = "".join(open(f).read() for f in files) + sys.stdin.read()
    if "--lenient" in options:  # what the launcher meant: 5e-5 read as 0.00005
        text = LENIENT_NUMBER.sub(lambda m: format(Decimal(m.group(0)), "f"), text)
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        try:
            printed = bc.run_line(line)
        except BcSyntaxError:
            print(f"(standard_in) {number}: syntax error", file=sys.stderr)
            continue
        except Unsupported as err:
            print(f"mmldlm's model of bc does not read {err} (line {number}: {line.strip()})", file=sys.stderr)
            return 3
        except SystemExit:
            return 0
        for out in printed:
            print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
