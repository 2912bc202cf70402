"""Plain numbers as exact rationals (never eval): parsing, literals, approximate equality."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from .normalise import _norm_str

# A plain number with a larger power-of-ten exponent is not parsed into a Fraction (10^{20000} has
# 66,000 bits: cheap; the bound keeps 10^{99999999} from being materialised).
MAX_EXP10 = 20_000
# Longest plain-number answer parsed (a 30,000-digit integer compares exactly in well under a
# millisecond); ordinary answers are a few characters, and the length test comes first.
MAX_NUMBER_CHARS = 30_000
# int() refuses strings of more than sys.get_int_max_str_digits() digits (4,300 by default):
# longer digit strings are converted in chunks of this size.
_INT_CHUNK = 4000
# Significant digits a decimal must carry to count as an approximation of an exact value
# (math-verify's float_rounding=6, but relative instead of absolute decimal places).
APPROX_SIG_DIGITS = 6

_NUM_PATTERNS = [
    # (regex over the normalised string, builder)
    (re.compile(r"([+-]?)([0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(\.[0-9]*)?|([+-]?)(\.[0-9]+)"), "dec"),
    (re.compile(r"([+-]?)\\frac\{([+-]?[0-9]+)\}\{([+-]?[0-9]+)\}"), "frac"),
    (re.compile(r"([+-]?)\\frac([0-9])([0-9])"), "frac"),
    (re.compile(r"([+-]?)\(?([+-]?[0-9]+)\)?/\(?([+-]?[0-9]+)\)?"), "frac"),
    (
        re.compile(
            r"([+-]?[0-9]+(?:\.[0-9]+)?)(?:[eE]([+-]?[0-9]+)|(?:\\times|\\cdot|\*|x)10\^\{?([+-]?[0-9]+)\}?)"
        ),
        "sci",
    ),
    (re.compile(r"10\^\{?([+-]?[0-9]+)\}?"), "pow10"),
]


def _int(digits: str) -> int:
    """int(digits), also past Python's 4,300-digit string conversion limit (exact, chunked)."""
    if len(digits) <= _INT_CHUNK:
        return int(digits)
    sign = -1 if digits[0] == "-" else 1
    digits = digits.lstrip("+-")
    n = 0
    for k in range(0, len(digits), _INT_CHUNK):
        chunk = digits[k : k + _INT_CHUNK]
        n = n * 10 ** len(chunk) + int(chunk)
    return sign * n


@dataclass(frozen=True)
class _Num:
    value: Fraction
    sig_digits: int | None  # significant digits of a decimal literal; None for exact forms
    places: int = 0  # decimal places as written (value is a multiple of 10^-places)


def _as_number(s: str) -> _Num | None:
    """Parse a normalised answer that is a plain number; None for anything else.

    Exact rational arithmetic only (``fractions.Fraction``), never ``eval``; exponents are
    bounded by ``MAX_EXP10`` so ``10^{99999999}`` is not materialised.
    """
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    s = s.replace("\\$", "").lstrip("$")
    m = _REPEAT_RE.fullmatch(s)
    if m and len(m.group(4)) <= 12:
        return _Num(_repeating(*m.groups()), None)
    m = _ELLIPSIS_NUM_RE.fullmatch(s)
    if m:
        sign, ip, fp = m.groups()
        for k in range(1, 7):  # the shortest block written at least twice at the end repeats
            if len(fp) >= 2 * k and fp[-k:] == fp[-2 * k : -k]:
                j = len(fp) - k
                while j - k >= 0 and fp[j - k : j] == fp[-k:]:
                    j -= k
                return _Num(_repeating(sign, ip, fp[:j], fp[j : j + k]), None)
        s = f"{sign}{ip}.{fp}"  # no repeating block: a plain decimal
    for rx, kind in _NUM_PATTERNS:
        m = rx.fullmatch(s)
        if not m:
            continue
        try:
            if kind == "dec":
                if m.group(5) is not None:
                    sign, ip, fp = m.group(4), "0", m.group(5)
                else:
                    sign, ip, fp = m.group(1), m.group(2).replace(",", ""), m.group(3) or ""
                if fp == ".":
                    fp = ""
                val = Fraction(_int(ip + fp[1:]), 10 ** max(len(fp) - 1, 0))
                if sign == "-":
                    val = -val
                sig = None
                if len(fp) > 1:
                    digits = (ip + fp[1:]).lstrip("0")
                    sig = len(digits)
                return _Num(val, sig, max(len(fp) - 1, 0))
            if kind == "frac":
                num, den = _int(m.group(2)), _int(m.group(3))
                if den == 0:
                    return None
                val = Fraction(num, den)
                return _Num(-val if m.group(1) == "-" else val, None)
            if kind == "sci":
                mant = m.group(1)
                e = int(m.group(2) if m.group(2) is not None else m.group(3))
                if abs(e) > MAX_EXP10:
                    return None
                mnum = _as_number(mant)
                if mnum is None:
                    return None
                return _Num(mnum.value * Fraction(10) ** e, mnum.sig_digits, mnum.places - e)
            if kind == "pow10":
                e = int(m.group(1))
                if abs(e) > MAX_EXP10:
                    return None
                return _Num(Fraction(10) ** e, None)
        except (ValueError, ZeroDivisionError, OverflowError):
            return None
    return None


_FRAC_LIT_RE = re.compile(r"-?(?:\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))")
_UNIT_WORDS_RE = re.compile(r"(.*?\d)\s*[A-Za-z][A-Za-z ]*\.?")
_OUTER_RE = re.compile(r"^\((.*)\)$|^\{(.*)\}$")


def numeric_literal(answer: str) -> _Num | None:
    """The number an extracted answer states as a literal, or None (the ``"numeric"`` answer filter).

    Reads through a final ``= N`` (the right-hand side), outer ``()`` / ``{}`` and trailing unit words;
    accepts integers and decimals (thousands separators, ``$``) and fractions in lowest terms with a
    denominator > 1; refuses operators, powers, e-notation and unreduced fractions (``48/2``: an
    unevaluated division).
    """
    t = answer.rsplit("=", 1)[-1].strip()
    m = _UNIT_WORDS_RE.fullmatch(t)
    if m and not re.search(r"\\[a-z]", t):
        t = m.group(1)
    t = _norm_str(t)
    for _ in range(3):
        m = _OUTER_RE.match(t)
        if not m:
            break
        t = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
    if re.search(r"[eE^*+]|\\(?:times|cdot)", t) or re.search(r"\d\s*-", t):
        return None
    num = _as_number(t)
    if num is None:
        return None
    f = _FRAC_LIT_RE.fullmatch(t)
    if f:
        a, b = (_int(f.group(1)), _int(f.group(2))) if f.group(1) is not None else (_int(f.group(3)), _int(f.group(4)))
        if b <= 1 or math.gcd(a, b) != 1:
            return None
    elif "/" in t or "frac" in t:
        return None
    return num


def percent_of(n: _Num) -> _Num:
    """``n`` percent as a number: 12.5 -> 0.125 (two more decimal places, same significant digits)."""
    return _Num(n.value / 100, n.sig_digits, n.places + 2)


def _approx_equal(approx: _Num, exact: Fraction) -> bool:
    """A decimal with >= APPROX_SIG_DIGITS significant digits equals ``exact`` rounded to the
    decimal's own precision (so 0.0833333333333333 == 1/12, 0.33 != 1/3, 1000000.5 != 10^6)."""
    if approx.sig_digits is None or approx.sig_digits < APPROX_SIG_DIGITS:
        return False
    # The decimal must be `exact` rounded (either way at a tie) to the places it was written with:
    # |approx - exact| <= half a unit in its last place.
    unit = Fraction(10) ** (-approx.places)
    return abs(approx.value - exact) <= unit / 2


def _rounds_to(precise: _Num, rounded: _Num) -> bool:
    """A computed decimal (>= APPROX_SIG_DIGITS significant digits, more places) that rounds to a
    rounded decimal gold of >= 2 significant digits: 0.290243531202435 for 0.29 (Math-Verify #3).
    A one-digit gold (0.5) is taken as exact."""
    if precise.sig_digits is None or rounded.sig_digits is None:
        return False
    if precise.sig_digits < APPROX_SIG_DIGITS or rounded.sig_digits < 2 or precise.places <= rounded.places:
        return False
    return abs(precise.value - rounded.value) <= Fraction(10) ** (-rounded.places) / 2


def _numbers_equal(a: _Num, b: _Num) -> bool:
    """``a`` (the answer) equals ``b`` (the gold): exactly, as a correctly rounded approximation of an
    exact gold, or as a more precise value of a rounded decimal gold."""
    if a.value == b.value:
        return True
    if a.sig_digits is not None and b.sig_digits is None:
        return _approx_equal(a, b.value)
    if b.sig_digits is not None and a.sig_digits is None:
        return _approx_equal(b, a.value)
    return _rounds_to(a, b)


_REPEAT_RE = re.compile(r"([+-]?)(\d*)\.(\d*)\\(?:overline|bar|dot)\{?(\d+)\}?")
_ELLIPSIS_NUM_RE = re.compile(r"([+-]?)(\d*)\.(\d+)\\ldots")


def _repeating(sign: str, ip: str, prefix: str, block: str) -> Fraction:
    """``ip.prefix(block)(block)...`` as an exact fraction (0.9(6) = 29/30)."""
    p, r = len(prefix), len(block)
    v = _int(ip or "0") + Fraction(int(prefix + block) - int(prefix or "0"), 10**p * (10**r - 1))
    return -v if sign == "-" else v


_MIXED_RE = re.compile(r"([+-]?)(\d{1,18})(?:\s+(\d{1,18})\s*/\s*(\d{1,18})|\s*\\[dt]?frac\s*\{(\d{1,18})\}\s*\{(\d{1,18})\})")


def rewrite_mixed(s: str) -> str:
    """A mixed number (``4 4/9``, ``3\\frac{1}{2}``: a whole part and a proper fraction) as an improper
    ``\\frac``, the sign applying to the whole value; anything else unchanged (Math-Verify #34, #81)."""
    m = _MIXED_RE.fullmatch(s.strip())
    if not m:
        return s
    w = int(m.group(2))
    n, d = (int(m.group(3)), int(m.group(4))) if m.group(3) else (int(m.group(5)), int(m.group(6)))
    if not 0 <= n < d:
        return s
    return f"{m.group(1)}\\frac{{{w * d + n}}}{{{d}}}"


def _split_top(s: str, seps: str) -> list[str]:
    """s split at the separator characters that sit outside every bracket."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c in seps:
            out.append(s[start:i])
            start = i + 1
    out.append(s[start:])
    return out


_MATRIX_RE = re.compile(r"\\begin\{([pbv]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}")


def as_number_tuple(s: str) -> tuple[str, list[_Num]] | None:
    """(shape, numbers) of a normalised answer that is a tuple, interval, list or matrix of plain
    numbers, or None. Shape: ``"()"`` for a parenthesised or bare list, the bracket pair for intervals,
    ``"matrix RxC"`` for a matrix (``pmatrix`` and ``bmatrix`` alike)."""
    m = _MATRIX_RE.fullmatch(s)
    if m:
        rows = [r for r in m.group(2).split("\\\\") if r]
        cells = [r.split("&") for r in rows]
        if not cells or len({len(r) for r in cells}) != 1:
            return None
        shape, items = f"matrix {len(cells)}x{len(cells[0])}", [c for r in cells for c in r]
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _split_top(s[1:-1], ",") != [s[1:-1]]:
        shape, items = ("()" if s[0] + s[-1] == "()" else s[0] + s[-1]), _split_top(s[1:-1], ",")
    else:
        items = _split_top(s, ",")
        if len(items) < 2:
            return None
        shape = "()"
    nums = [_as_number(x) for x in items]
    if any(x is None for x in nums):
        return None
    return shape, nums  # type: ignore[return-value]

