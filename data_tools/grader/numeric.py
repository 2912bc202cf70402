"""Plain numbers as exact rationals (never eval): parsing, literals, approximate equality."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from .normalise import _norm_str

# A plain number with a larger power-of-ten exponent is not parsed into a Fraction.
MAX_EXP10 = 400
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
    if not s or len(s) > 60:
        return None
    s = s.replace("\\$", "").lstrip("$")
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
                val = Fraction(int(ip + fp[1:]), 10 ** max(len(fp) - 1, 0))
                if sign == "-":
                    val = -val
                sig = None
                if len(fp) > 1:
                    digits = (ip + fp[1:]).lstrip("0")
                    sig = len(digits)
                return _Num(val, sig, max(len(fp) - 1, 0))
            if kind == "frac":
                num, den = int(m.group(2)), int(m.group(3))
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
        a, b = (int(f.group(1)), int(f.group(2))) if f.group(1) is not None else (int(f.group(3)), int(f.group(4)))
        if b <= 1 or math.gcd(a, b) != 1:
            return None
    elif "/" in t or "frac" in t:
        return None
    return num


def _approx_equal(approx: _Num, exact: Fraction) -> bool:
    """A decimal with >= APPROX_SIG_DIGITS significant digits equals ``exact`` rounded to the
    decimal's own precision (so 0.0833333333333333 == 1/12, 0.33 != 1/3, 1000000.5 != 10^6)."""
    if approx.sig_digits is None or approx.sig_digits < APPROX_SIG_DIGITS:
        return False
    # The decimal must be `exact` rounded (either way at a tie) to the places it was written with:
    # |approx - exact| <= half a unit in its last place.
    unit = Fraction(10) ** (-approx.places)
    return abs(approx.value - exact) <= unit / 2


def _numbers_equal(a: _Num, b: _Num) -> bool:
    if a.value == b.value:
        return True
    if a.sig_digits is not None and b.sig_digits is None:
        return _approx_equal(a, b.value)
    if b.sig_digits is not None and a.sig_digits is None:
        return _approx_equal(b, a.value)
    return False

