"""The grader's own LaTeX reader: an answer in LaTeX (or the plain-text math models write) -> sympy.

Used by the sympy step when math-verify (and its latex2sympy2_extended) is not installed. It builds
sympy objects node by node from a token stream -- never ``eval``, ``sympify`` or ``parse_expr`` on model
text -- and reads what answers are made of: numbers, fractions, roots, powers, factorials, functions
(trigonometric, logarithms, ``exp``, ``|x|``, floor/ceiling, ``\\binom``), constants (``\\pi``, ``e``,
``i``, ``\\infty``), tuples, intervals and their unions, sets, ``\\pm``, matrices, equations and
single-variable inequalities. Anything else raises ``LatexError`` ("could not read"), which the grader
treats like math-verify's failure to parse a side. ``equivalent`` compares two read answers.

Runs inside the grader's worker subprocess (deadline, address-space cap); the answer strings it gets
have passed ``sandbox._too_risky`` (at most 600 characters, 40 levels of brackets, no power towers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sympy


class LatexError(ValueError):
    """The answer is not something this reader understands."""


# Structures other than a plain expression; each holds sympy expressions.
@dataclass(frozen=True)
class Seq:
    """A bracketed sequence: a tuple ``(1, 2)``, an interval ``[0, 1)``, a point."""

    open: str
    close: str
    items: tuple


@dataclass(frozen=True)
class Items:
    """An unordered collection: ``1, 2, 3`` written without brackets, ``\\{1, 2\\}``, ``\\pm 3``."""

    items: tuple


@dataclass(frozen=True)
class Mat:
    rows: int
    cols: int
    items: tuple


@dataclass(frozen=True)
class Equation:
    """``lhs = rhs`` that is not ``variable = value``: kept as ``lhs - rhs``."""

    diff: object


@dataclass(frozen=True)
class Assign:
    """``x = 5`` / ``f(x) = 2x``: a name given a value. Compares as the value (math-verify reads it the
    same way), and as the equation ``x - 5 = 0`` against another equation."""

    value: object
    diff: object


@dataclass(frozen=True)
class Union:
    parts: tuple


@dataclass
class Read:
    value: object
    decimal: bool = False  # a decimal literal was written: numbers compare to a relative 1e-6
    symbols: set = field(default_factory=set)


_FUNCS = {
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan, "arccot": sympy.acot,
    "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh, "coth": sympy.coth,
    "ln": sympy.log, "log": sympy.log, "exp": sympy.exp, "lg": lambda x: sympy.log(x, 10),
}
_INVERSE = {"sin": sympy.asin, "cos": sympy.acos, "tan": sympy.atan, "cot": sympy.acot}
_GREEK = set(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau "
    "upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Upsilon Phi Psi Omega".split()
)
# Plain-text names read as commands when a run of letters starts with them ("sqrt(3)", "sinx").
_WORD_NAMES = sorted(["sqrt", "pi", "infty", "infinity", "inf", *_FUNCS], key=len, reverse=True)
_REL_CMDS = {"le": "<=", "leq": "<=", "leqslant": "<=", "ge": ">=", "geq": ">=", "geqslant": ">=",
             "lt": "<", "gt": ">", "ne": "!=", "neq": "!=", "in": "in"}
_MATRIX_ENVS = ("pmatrix", "bmatrix", "matrix", "Bmatrix", "smallmatrix")
# At most this many distinct variables are compared by substitution.
_MAX_SYMBOLS = 8
_MAX_FACTORIAL = 20_000

_DROP_RE = re.compile(
    r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])|\\displaystyle|(?<!\\)\\[,;:! ]|~|\\q?quad(?![A-Za-z])"
    r"|\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|\u00b0|\\limits"
)
_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname|boldsymbol)\s*\{([^{}]*)\}")
_UNIT_TAIL_RE = re.compile(
    r"(?<=[0-9}])(?:\\[ ,;:!]|~|\s)*\\(?:text|textrm|textnormal|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z ./]*\}(?:\^\{?\d\}?)?\s*$")
# "1331 \text{ and } 1728", "3 or 5": a list of answers.
_AND_RE = re.compile(r"\\text\s*\{\s*(?:and|or)\s*\}|(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])")
# "14{, }916": a thousands separator written in braces.
_BRACED_COMMA_RE = re.compile(r"(?<=\d)\s*\{\s*,\s*\}\s*(?=\d)")
# A mixed number: an integer followed by a proper fraction, "15\frac{39}{40}" (Math-Verify #34).
_MIXED_RE = re.compile(r"(?<![\d.}^_])(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d*)?|\.\d+)|(?P<cmd>\\[A-Za-z]+)|(?P<esc>\\[{}|%$])|(?P<rows>\\\\)"
    r"|(?P<rel><=|>=|!=|==)|(?P<word>[A-Za-z]+)|(?P<sym>[-+*/^_()\[\]{},=<>!|&'.:;%]))"
)


def _preprocess(s: str) -> str:
    s = s.strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\[", "\\]"), ("\\(", "\\)")):
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a) : len(s) - len(b)].strip()
    s = _UNIT_TAIL_RE.sub("", s)
    s = re.sub(r",(?:\s*,)+", ",", _AND_RE.sub(",", s)).replace(",\\!", "")
    s = _BRACED_COMMA_RE.sub("", s)
    s = _DROP_RE.sub(" ", s)
    for _ in range(3):
        s = _WRAP_RE.sub(r" \1 ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", "")
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\ast", "*").replace("\\div", "/").replace("**", "^")
    s = s.replace("\\%", "%").replace("\\$", "")
    s = _MIXED_RE.sub(lambda m: f"({m[1]}+\\frac{{{m[2]}}}{{{m[3]}}})" if int(m[2]) < int(m[3]) else m[0], s)
    return s.strip().rstrip(".").strip()


@dataclass
class _Tok:
    kind: str  # num, cmd, esc, rows, rel, word, sym, end
    text: str


def _tokens(s: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    n = len(s)
    while pos < n:
        m = _TOKEN_RE.match(s, pos)
        if not m or m.end() == pos:
            if s[pos:].strip() == "":
                break
            raise LatexError(f"cannot read {s[pos:pos + 10]!r}")
        pos = m.end()
        kind = m.lastgroup
        text = m.group(kind)
        if kind == "word":  # plain-text names ("sqrt", "pi", "sin") and single-letter variables
            i = 0
            while i < len(text):
                for name in _WORD_NAMES:
                    if text.startswith(name, i) and (len(name) > 1):
                        out.append(_Tok("cmd", "\\" + ("infty" if name in ("inf", "infinity") else name)))
                        i += len(name)
                        break
                else:
                    out.append(_Tok("word", text[i]))
                    i += 1
            continue
        if kind == "cmd" and text[1:] in _REL_CMDS:
            out.append(_Tok("rel", _REL_CMDS[text[1:]]))
            continue
        if kind == "sym" and text in "<>":
            out.append(_Tok("rel", text))
            continue
        if kind == "rel" and text == "==":
            out.append(_Tok("sym", "="))
            continue
        out.append(_Tok(kind, text))
    out.append(_Tok("end", ""))
    return out


class _Parser:
    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = toks
        self.i = 0
        self.decimal = False

    # -- token helpers
    def peek(self, k: int = 0) -> _Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def next(self) -> _Tok:
        t = self.toks[self.i]
        self.i = min(self.i + 1, len(self.toks) - 1)
        return t

    def accept(self, kind: str, text: str | None = None) -> bool:
        t = self.peek()
        if t.kind == kind and (text is None or t.text == text):
            self.next()
            return True
        return False

    def expect(self, kind: str, text: str | None = None) -> _Tok:
        t = self.peek()
        if t.kind != kind or (text is not None and t.text != text):
            raise LatexError(f"expected {text or kind}, got {t.text!r}")
        return self.next()

    # -- grammar
    def top(self):
        items = [self.union()]
        while self.accept("sym", ","):
            items.append(self.union())
        if self.peek().kind != "end":
            raise LatexError(f"unexpected {self.peek().text!r}")
        return items[0] if len(items) == 1 else Items(tuple(items))

    def union(self):
        parts = [self.relation()]
        while self.accept("cmd", "\\cup"):
            parts.append(self.relation())
        if len(parts) == 1:
            return parts[0]
        if not all(isinstance(p, Seq) and len(p.items) == 2 for p in parts):
            raise LatexError("union of non-intervals")
        return Union(tuple(parts))

    def _function_lhs(self) -> bool:
        """``f(x) =`` / ``g(a, b) =`` at the current token: skip it (the value is what is on the right)."""
        t = self.toks
        j = self.i
        if not (t[j].kind == "word" and j + 1 < len(t) and t[j + 1].kind == "sym" and t[j + 1].text == "("):
            return False
        k = j + 2
        while k < len(t) and (t[k].kind == "word" or (t[k].kind == "sym" and t[k].text == ",")):
            k += 1
        if k + 1 < len(t) and t[k].text == ")" and t[k].kind == "sym" and t[k + 1].kind == "sym" and t[k + 1].text == "=":
            self.i = k + 2
            return True
        return False

    def relation(self):
        if self._function_lhs():
            value = self.relation()
            return Assign(value, sympy.Symbol("_f") - value) if isinstance(value, sympy.Expr) else value
        chain = [self.expr()]
        ops: list[str] = []
        while self.peek().kind == "rel" or (self.peek().kind == "sym" and self.peek().text == "="):
            ops.append("=" if self.peek().text == "=" else self.peek().text)
            self.next()
            chain.append(self.expr())
        if not ops:
            return chain[0]
        if all(op == "=" for op in ops):
            # "x = 5", "f(x) = 2x", "41 * 74 = 3034": the value on the right (math-verify does the same)
            head = chain[0]
            if len(chain) > 2 or not any(_free(c) for c in chain):
                return chain[-1]  # "41 * 74 = 3034", "a = b = c": the value on the right
            if any(not isinstance(c, sympy.Expr) for c in chain):
                raise LatexError("equation of structures")
            if isinstance(head, sympy.Symbol):
                return Assign(chain[1], head - chain[1])
            return Equation(chain[0] - chain[1])
        if ops == ["in"] and _is_name(chain[0]):
            return chain[1]
        return _inequality(chain, ops)

    def expr(self):
        if self.peek().kind == "sym" and self.peek().text in "([" and self._is_sequence():
            return self.atom()
        left = self.term()
        while self.peek().kind == "sym" and self.peek().text in "+-":
            op = self.next().text
            right = self.term()
            left = _arith(left, right, "+" if op == "+" else "-")
        return left

    def _is_sequence(self) -> bool:
        """A bracket at the start of an expression opening a top-level comma list that closes the expression."""
        depth, j = 0, self.i
        while j < len(self.toks):
            t = self.toks[j]
            if t.kind == "sym" and t.text in "([{":
                depth += 1
            elif t.kind == "sym" and t.text in ")]}":
                depth -= 1
                if depth == 0:
                    nxt = self.toks[j + 1] if j + 1 < len(self.toks) else _Tok("end", "")
                    return nxt.kind in ("end", "rel") or (nxt.kind == "sym" and nxt.text in ",=") or nxt.text == "\\cup"
            elif depth == 1 and t.kind == "sym" and t.text == ",":
                pass
            elif t.kind == "end":
                return False
            j += 1
        return False

    def term(self):
        left = self.unary()
        while True:
            t = self.peek()
            if t.kind == "sym" and t.text in "*/":
                self.next()
                right = self.unary()
                left = _arith(left, right, t.text)
            elif self._starts_atom(t):
                right = self.power()
                left = _arith(left, right, "*")
            else:
                return left

    def _starts_atom(self, t: _Tok) -> bool:
        if t.kind in ("num", "word"):
            return True
        if t.kind == "sym":
            return t.text in "({"
        if t.kind == "esc":
            return t.text == "\\{"
        if t.kind == "cmd":
            return t.text not in ("\\cup", "\\end", "\\pm", "\\mp", "\\rfloor", "\\rceil")
        return False

    def unary(self):
        if self.accept("sym", "-"):
            return _arith(sympy.Integer(-1), self.unary(), "*")
        if self.accept("sym", "+"):
            return self.unary()
        return self.power()

    def power(self):
        base = self.postfix()
        if self.accept("sym", "^"):
            exp = self.exponent()
            if not isinstance(base, sympy.Expr) or not isinstance(exp, sympy.Expr):
                raise LatexError("power of a structure")
            return sympy.Pow(base, exp)
        return base

    def exponent(self):
        if self.peek().kind == "sym" and self.peek().text == "{":
            self.next()
            e = self.expr()
            self.expect("sym", "}")
            return e
        if self.accept("sym", "-"):
            return -self.power()
        if self.accept("sym", "+"):
            return self.power()
        return self.power()

    def postfix(self):
        x = self.atom()
        while True:
            if self.accept("sym", "!"):
                if not isinstance(x, sympy.Expr) or (x.is_Integer and abs(int(x)) > _MAX_FACTORIAL):
                    raise LatexError("factorial too large")
                x = sympy.factorial(x)
            elif self.accept("sym", "%"):
                x = _arith(x, sympy.Rational(1, 100), "*")
            else:
                return x

    def group(self, close: str):
        """The inside of a bracket pair already opened: one expression, or a comma list."""
        items = [self.relation()]
        while self.accept("sym", ","):
            items.append(self.relation())
        t = self.next()
        if t.kind != "sym" or t.text not in close:
            raise LatexError(f"expected one of {close!r}, got {t.text!r}")
        return items, t.text

    def atom(self):
        t = self.next()
        if t.kind == "num":
            if "." in t.text:
                self.decimal = True
                return sympy.Rational(t.text if not t.text.endswith(".") else t.text[:-1])
            return sympy.Integer(t.text)
        if t.kind == "word":
            return self.symbol(t.text)
        if t.kind == "sym" and t.text in "([":
            items, close = self.group(")]")
            if len(items) == 1 and t.text + close in ("()", "[]"):
                return items[0]
            return Seq(t.text, close, tuple(items))
        if t.kind == "sym" and t.text == "{":
            items, _ = self.group("}")
            return items[0] if len(items) == 1 else Items(tuple(items))
        if t.kind == "esc" and t.text == "\\{":
            if self.accept("esc", "\\}"):
                return Items(())
            items = [self.relation()]
            while self.accept("sym", ","):
                items.append(self.relation())
            self.expect("esc", "\\}")
            return Items(tuple(items))
        if t.kind == "sym" and t.text == "|" or t.kind == "esc" and t.text == "\\|":
            inner = self.expr()
            if not (self.accept("sym", "|") or self.accept("esc", "\\|")):
                raise LatexError("unclosed |")
            return sympy.Abs(_expr(inner))
        if t.kind == "cmd":
            return self.command(t.text[1:])
        raise LatexError(f"unexpected {t.text!r}")

    def symbol(self, name: str):
        if self.accept("sym", "_"):
            sub = self.subscript()
            return sympy.Symbol(f"{name}_{sub}")
        if name == "e":
            return sympy.E
        return sympy.Symbol(name)

    def subscript(self) -> str:
        if self.accept("sym", "{"):
            parts = []
            while not self.accept("sym", "}"):
                t = self.next()
                if t.kind == "end":
                    raise LatexError("unclosed subscript")
                parts.append(t.text)
            return "".join(parts)
        t = self.next()
        if t.kind == "num":  # x_12 is x_1 2 in TeX; read x_{12} as written is more common in answers
            return t.text
        if t.kind in ("word", "cmd"):
            return t.text.lstrip("\\")
        raise LatexError("bad subscript")

    def arg(self):
        """A command argument: a braced group or, as TeX reads it, a single token (\\frac12, \\sqrt2)."""
        t = self.peek()
        if t.kind == "sym" and t.text in "{(":
            self.next()
            e = self.relation()
            self.expect("sym", "}" if t.text == "{" else ")")
            return e
        if t.kind == "num" and len(t.text) > 1 and "." not in t.text:
            self.toks[self.i] = _Tok("num", t.text[1:])  # split one digit off: \frac123 is \frac{1}{2}3
            return sympy.Integer(t.text[0])
        if t.kind in ("num", "word"):
            self.next()
            return sympy.Integer(t.text) if t.kind == "num" else self.symbol(t.text)
        if t.kind == "cmd":
            self.next()
            return self.command(t.text[1:])
        raise LatexError("missing argument")

    def func_arg(self):
        """The argument of \\sin, \\log...: parenthesised, braced, or the product that follows (\\sin 2x)."""
        t = self.peek()
        if t.kind == "sym" and t.text in "({":
            self.next()
            e = self.expr()
            self.expect("sym", ")" if t.text == "(" else "}")
            return e
        x = self.power()
        while self.peek().kind in ("num", "word") or (self.peek().kind == "cmd" and self.peek().text[1:] in ("pi",) ):
            x = _arith(x, self.power(), "*")
        return x

    def command(self, name: str):
        if name == "frac":
            num, den = self.arg(), self.arg()
            return _arith(num, den, "/")
        if name == "binom":
            n, k = self.arg(), self.arg()
            return sympy.binomial(_expr(n), _expr(k))
        if name == "sqrt":
            index = None
            if self.accept("sym", "["):
                index = self.expr()
                self.expect("sym", "]")
            x = _expr(self.arg())
            return sympy.sqrt(x) if index is None else sympy.root(x, _expr(index))
        if name == "pi":
            return sympy.pi
        if name in ("infty", "infin"):
            return sympy.oo
        if name in ("emptyset", "varnothing"):
            return Items(())
        if name in _GREEK:
            return self.symbol(name)
        if name in ("lfloor", "lceil"):
            inner = self.expr()
            self.expect("cmd", "\\rfloor" if name == "lfloor" else "\\rceil")
            return (sympy.floor if name == "lfloor" else sympy.ceiling)(_expr(inner))
        if name == "begin":
            return self.matrix()
        if name in _FUNCS:
            base = None
            if name == "log" and self.accept("sym", "_"):
                base = _expr(self.arg())
            power = None
            if self.accept("sym", "^"):
                power = _expr(self.exponent())
            x = _expr(self.func_arg())
            if power is not None and power == -1 and name in _INVERSE:
                return _INVERSE[name](x)
            val = sympy.log(x, base) if base is not None else _FUNCS[name](x)
            return val if power is None else sympy.Pow(val, power)
        raise LatexError(f"unknown command \\{name}")

    def matrix(self):
        self.expect("sym", "{")
        env = self.expect("word").text
        while self.peek().kind == "word":
            env += self.next().text
        self.expect("sym", "}")
        if env not in _MATRIX_ENVS:
            raise LatexError(f"environment {env}")
        rows: list[list] = [[]]
        while True:
            if self.accept("cmd", "\\end"):
                self.expect("sym", "{")
                while not self.accept("sym", "}"):
                    if self.next().kind == "end":
                        raise LatexError("unclosed environment")
                break
            rows[-1].append(_expr(self.expr()))
            if self.accept("sym", "&"):
                continue
            if self.accept("rows"):
                if self.peek().kind == "cmd" and self.peek().text == "\\end":
                    continue
                rows.append([])
                continue
            if not (self.peek().kind == "cmd" and self.peek().text == "\\end"):
                raise LatexError("bad matrix")
        if not rows or len({len(r) for r in rows}) != 1:
            raise LatexError("ragged matrix")
        return Mat(len(rows), len(rows[0]), tuple(x for r in rows for x in r))


def _is_name(x) -> bool:
    return isinstance(x, sympy.Symbol)


def _free(x) -> bool:
    return isinstance(x, sympy.Expr) and bool(x.free_symbols)


def _expr(x):
    if not isinstance(x, sympy.Expr):
        raise LatexError("a structure where a number belongs")
    return x


def _arith(a, b, op: str):
    a, b = _expr(a), _expr(b)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise LatexError("division by zero")
    return a / b


def _inequality(chain: list, ops: list[str]):
    """A single-variable inequality as an interval: ``-2 \\le x \\le 7`` -> [-2, 7], ``x > 5`` -> (5, oo)."""
    if any(op not in ("<", "<=", ">", ">=") for op in ops) or any(not isinstance(c, sympy.Expr) for c in chain):
        raise LatexError("relation")
    if len(chain) == 3 and _free(chain[1]) and not _free(chain[0]) and not _free(chain[2]) and ops[0][0] == ops[1][0]:
        lo, hi = (chain[0], chain[2]) if ops[0][0] == "<" else (chain[2], chain[0])
        lo_closed = (ops[0] if ops[0][0] == "<" else ops[1]).endswith("=")
        hi_closed = (ops[1] if ops[0][0] == "<" else ops[0]).endswith("=")
        return Seq("[" if lo_closed else "(", "]" if hi_closed else ")", (lo, hi))
    if len(chain) == 2 and not _is_name(chain[0]) and not _is_name(chain[1]):
        # "-x > -1", "2x + 1 \le 7": solved for its one variable
        syms = (chain[0] - chain[1]).free_symbols
        if len(syms) != 1:
            raise LatexError("relation")
        rel = {"<": sympy.Lt, "<=": sympy.Le, ">": sympy.Gt, ">=": sympy.Ge}[ops[0]](chain[0], chain[1])
        try:
            sol = sympy.solve_univariate_inequality(rel, next(iter(syms)), relational=False)
        except (NotImplementedError, ValueError, TypeError) as e:
            raise LatexError("relation") from e
        return _from_set(sol)
    if len(chain) == 2:
        var_left = _is_name(chain[0])
        bound = chain[1] if var_left else chain[0]
        op = ops[0] if var_left else {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[ops[0]]
        closed = op.endswith("=")
        if op[0] == "<":
            return Seq("(", "]" if closed else ")", (-sympy.oo, bound))
        return Seq("[" if closed else "(", ")", (bound, sympy.oo))
    raise LatexError("relation")


def _from_set(x):
    """A sympy Interval / Union of intervals as Seq / Union."""
    if isinstance(x, sympy.Interval):
        return Seq("(" if x.left_open or x.start == -sympy.oo else "[", ")" if x.right_open or x.end == sympy.oo else "]",
                   (x.start, x.end))
    if isinstance(x, sympy.Union) and all(isinstance(a, sympy.Interval) for a in x.args):
        return Union(tuple(_from_set(a) for a in sorted(x.args, key=lambda a: a.start)))
    raise LatexError("not an interval")


def read(s: str) -> Read:
    """Read one answer. Raises ``LatexError`` when it is not something this reader understands."""
    s = _preprocess(s)
    if not s:
        raise LatexError("empty")
    pm = [m.start() for m in re.finditer(r"\\(?:pm|mp)(?![A-Za-z])", s)]
    if len(pm) == 1:  # a \pm b: the two values
        plus, minus = (s[: pm[0]] + "+" + s[pm[0] + 3 :]), (s[: pm[0]] + "-" + s[pm[0] + 3 :])
        a, b = read(plus), read(minus)
        return Read(Items((a.value, b.value)), a.decimal or b.decimal, a.symbols | b.symbols)
    if pm:
        raise LatexError("several \\pm")
    p = _Parser(_tokens(s))
    value = p.top()
    return Read(value, p.decimal, _symbols(value))


def _symbols(v) -> set:
    if isinstance(v, sympy.Basic):
        return set(v.free_symbols)
    parts = (v.items if isinstance(v, (Seq, Items, Mat)) else v.parts if isinstance(v, Union)
             else (v.diff,) if isinstance(v, (Equation, Assign)) else ())
    out: set = set()
    for p in parts:
        out |= _symbols(p)
    return out


# Points at which two expressions in variables are compared: irrational, of both signs.
_POINTS = (
    (0.5772156649015329, 1.3247179572447460, -0.7071067811865476, 2.6180339887498949),
    (-1.4142135623730951, 0.3183098861837907, 1.7320508075688772, -0.4342944819032518),
    (2.2360679774997897, -2.7182818284590452, 0.6931471805599453, 1.1547005383792515),
)


def _subst(v, mapping: dict):
    if isinstance(v, sympy.Basic):
        return v.xreplace(mapping)
    if isinstance(v, Seq):
        return Seq(v.open, v.close, tuple(_subst(x, mapping) for x in v.items))
    if isinstance(v, Items):
        return Items(tuple(_subst(x, mapping) for x in v.items))
    if isinstance(v, Mat):
        return Mat(v.rows, v.cols, tuple(_subst(x, mapping) for x in v.items))
    if isinstance(v, Union):
        return Union(tuple(_subst(x, mapping) for x in v.parts))
    if isinstance(v, Equation):
        return Equation(_subst(v.diff, mapping))
    if isinstance(v, Assign):
        return Assign(_subst(v.value, mapping), _subst(v.diff, mapping))
    return v


def _expr_equal(a, b, rel_tol: float) -> bool:
    if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr):
        return False
    if a == b:
        return True
    if a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
        return False  # infinities are equal only as written (a == b above)
    syms = sorted(a.free_symbols | b.free_symbols, key=lambda s: s.name)
    if len(syms) > _MAX_SYMBOLS:
        return bool(sympy.simplify(a - b) == 0)
    points = [dict(zip(syms, (sympy.Float(x, 30) for x in pt))) for pt in _POINTS] if syms else [{}]
    for pt in points:
        va, vb = sympy.N(a.xreplace(pt), 30), sympy.N(b.xreplace(pt), 30)
        if not (va.is_number and vb.is_number) or any(v.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo) for v in (va, vb)):
            return False
        diff = abs(sympy.N(va - vb, 30))
        scale = max(abs(va), abs(vb))
        if diff > rel_tol * scale and not (scale == 0 and diff == 0):
            return False
        if scale == 0 and diff != 0:
            return False
    return True


def _same(a, b, rel_tol: float) -> bool:
    if isinstance(a, Assign) and isinstance(b, Assign):
        return _same(a.value, b.value, rel_tol)
    if isinstance(a, Assign) or isinstance(b, Assign):
        if isinstance(a, Equation) or isinstance(b, Equation):
            return _same(Equation(a.diff) if isinstance(a, Assign) else a,
                         Equation(b.diff) if isinstance(b, Assign) else b, rel_tol)
        return _same(a.value if isinstance(a, Assign) else a, b.value if isinstance(b, Assign) else b, rel_tol)
    if isinstance(a, Items) != isinstance(b, Items) and (isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic)):
        one = _distinct(list((a if isinstance(a, Items) else b).items), rel_tol)  # "15\frac{39}{40} or \frac{639}{40}"
        return len(one) == 1 and _same(one[0], b if isinstance(a, Items) else a, rel_tol)
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return _expr_equal(a, b, rel_tol)
    if isinstance(a, Items) and isinstance(b, (Items, Seq)) or isinstance(b, Items) and isinstance(a, Seq):
        if isinstance(a, Seq) and a.open + a.close != "()" or isinstance(b, Seq) and b.open + b.close != "()":
            return False
        xs, ys = list(a.items), list(b.items)
        if isinstance(a, Items):  # a set: a value written twice is one element
            xs = _distinct(xs, rel_tol)
        if isinstance(b, Items):
            ys = _distinct(ys, rel_tol)
        if len(xs) != len(ys):
            return False  # exact set sizes: a subset of a "find all" answer is wrong
        if isinstance(a, Seq) and isinstance(b, Items) or isinstance(a, Items) and isinstance(b, Seq):
            if all(_same(x, y, rel_tol) for x, y in zip(xs, ys)):
                return True
        for x in xs:  # as a multiset, in any order
            for k, y in enumerate(ys):
                if _same(x, y, rel_tol):
                    del ys[k]
                    break
            else:
                return False
        return True
    if isinstance(a, Seq) and isinstance(b, Seq):
        return (a.open, a.close, len(a.items)) == (b.open, b.close, len(b.items)) and all(
            _same(x, y, rel_tol) for x, y in zip(a.items, b.items))
    if isinstance(a, Mat) and isinstance(b, Mat):
        return (a.rows, a.cols) == (b.rows, b.cols) and all(_same(x, y, rel_tol) for x, y in zip(a.items, b.items))
    if isinstance(a, Union) and isinstance(b, Union):
        return len(a.parts) == len(b.parts) and all(_same(x, y, rel_tol) for x, y in zip(a.parts, b.parts))
    if isinstance(a, Equation) and isinstance(b, Equation):
        # the same equation up to a non-zero constant factor: (lhs1 - rhs1) / (lhs2 - rhs2) is a number
        if b.diff == 0:
            return a.diff == 0
        ratio = sympy.simplify(a.diff / b.diff)
        return bool(ratio.is_number and ratio != 0 and ratio.is_finite)
    return False


def _distinct(xs: list, rel_tol: float) -> list:
    out: list = []
    for x in xs:
        if not any(_same(x, y, rel_tol) for y in out):
            out.append(x)
    return out


def equivalent(gold: Read, pred: Read) -> bool:
    """The two answers are equal: numbers exactly (to a relative 1e-25 at 30 digits, or 1.5e-6 when a
    decimal was written), expressions at three irrational points of both signs, structures element
    by element (sets in any order, with the same size). A gold that uses ``i`` makes ``i`` the
    imaginary unit on both sides."""
    g, p = gold.value, pred.value
    if any(s.name == "i" for s in gold.symbols):
        g = _subst(g, {s: sympy.I for s in gold.symbols if s.name == "i"})
        p = _subst(p, {s: sympy.I for s in pred.symbols if s.name == "i"})
    rel_tol = 1.5e-6 if (gold.decimal or pred.decimal) else 1e-25
    return _same(g, p, rel_tol)
