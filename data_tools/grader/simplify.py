"""Cheap exact rewrites that decide hostile answers without sympy: redundant brackets peeled, identical
terms cancelled, integer power towers compared by their exponents. Each is linear (or close to it) in
the answer's length and never evaluates a number it cannot bound."""

from __future__ import annotations

import re

_OPEN, _CLOSE = "([{", ")]}"
# A power tower's exponent is evaluated only while it stays below this (2^2^2^2 = 2^16 is fine).
MAX_TOWER_EXP = 10**6


def _pairs(s: str) -> dict[int, int] | None:
    """Index of each opening bracket -> its closing bracket; None when unbalanced."""
    stack, out = [], {}
    for i, c in enumerate(s):
        if c in _OPEN:
            stack.append(i)
        elif c in _CLOSE:
            if not stack or _OPEN.index(s[stack[-1]]) != _CLOSE.index(c):
                return None
            out[stack.pop()] = i
    return out if not stack else None


def peel(s: str) -> str:
    """``((((1))))`` -> ``1``: strip outer brackets that enclose the whole answer and hold no
    top-level comma (so intervals and tuples keep theirs); ``\\left``/``\\right`` are dropped first."""
    s = re.sub(r"\\left\b|\\right\b", "", s).strip()
    pairs = _pairs(s)
    if pairs is None:
        return s
    # Depths (brackets open before it) of every comma: the inner part of level k has a top-level
    # comma iff some comma sits at depth k + 1. One pass, so 10,000 levels stay linear.
    comma_depths, depth = set(), 0
    for c in s:
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif c == ",":
            comma_depths.add(depth)
    lo, hi, level = 0, len(s) - 1, 0
    while lo < hi and s[lo] in _OPEN and pairs.get(lo) == hi:
        if level + 1 in comma_depths and s[lo] != "{":
            break
        lo, hi, level = lo + 1, hi - 1, level + 1
        while lo < hi and s[lo] == " ":
            lo += 1
        while hi > lo and s[hi] == " ":
            hi -= 1
    return s[lo : hi + 1]


def _terms(s: str) -> list[tuple[str, str]]:
    """(sign, term) at the top level of a sum; a sign after ``^``, ``_``, ``e`` or an operator is not a split."""
    out, depth, start, sign = [], 0, 0, "+"
    for i, c in enumerate(s):
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif depth == 0 and c in "+-" and i > start and s[i - 1] not in "^_eE*/(\\{" and s[start:i].strip():
            out.append((sign, s[start:i].strip()))
            sign, start = c, i + 1
        elif depth == 0 and c in "+-" and not s[start:i].strip():
            sign = "-" if (sign == "-") != (c == "-") else "+"
            start = i + 1
    out.append((sign, s[start:].strip()))
    return out


def _is_zero_product(term: str) -> bool:
    factors = re.split(r"\\cdot|\\times|\*", term)
    return len(factors) > 1 and any(f.strip() == "0" for f in factors) and "\\infty" not in term


_FRAC_SAME_RE = re.compile(r"\\[dt]?frac")


def _frac_of_same(term: str) -> bool:
    """``\\frac{A}{A}`` with A not 0: equal to 1."""
    m = _FRAC_SAME_RE.match(term)
    if not m or term[m.end() : m.end() + 1] != "{":
        return False
    pairs = _pairs(term[m.end() :])
    if pairs is None or 0 not in pairs:
        return False
    e = pairs[0]
    num, rest = term[m.end() + 1 : m.end() + e], term[m.end() + e + 1 :]
    return rest == "{" + num + "}" and num.strip() not in ("", "0")


def cancel(s: str) -> str:
    """Identical terms of opposite sign removed, products with a literal factor 0 dropped, ``\\frac{A}{A}``
    read as 1: ``(x+1)^{100000} - (x+1)^{100000} + 5`` -> ``5``. Returns s unchanged when nothing cancels."""
    terms = _terms(s)
    if len(terms) < 2 and not (terms and _frac_of_same(terms[0][1])):
        return s
    net: dict[str, int] = {}  # term -> signed count, in first-seen order
    changed = False
    for sign, t in terms:
        key = re.sub(r"\s+", "", t)
        if _is_zero_product(key):
            changed = True
            continue
        if _frac_of_same(key):
            key, changed = "1", True
        before = net.get(key, 0)
        net[key] = before + (1 if sign == "+" else -1)
        changed = changed or abs(net[key]) < abs(before)
    if not changed:
        return s
    out = "".join(("+" if n > 0 else "-") + t for t, n in net.items() for _ in range(abs(n)))
    if not out:
        return "0"
    return out[1:] if out.startswith("+") else out


_TOWER_RE = re.compile(r"\d+(?:\s*\^\s*\{?\s*\d+)+\s*\}*")


def power_tower(s: str) -> tuple[int, int] | None:
    """``a^{b^{c}}`` of integers as (r, E) with r^E its value and r not a perfect power, or None when
    s is no such tower or its exponent would pass MAX_TOWER_EXP (2^{2^{2^{2^2}}} -> (2, 65536))."""
    s = s.strip()
    if not _TOWER_RE.fullmatch(s) or s.count("{") != s.count("}"):
        return None
    if re.search(r"\d{19}", s):
        return None
    nums = [int(x) for x in re.findall(r"\d+", s)]
    if len(nums) < 2 or nums[0] < 2:
        return None
    exp = nums[-1]
    for b in reversed(nums[1:-1]):
        if b > 1 and exp * b.bit_length() > MAX_TOWER_EXP.bit_length() * 2:
            return None
        exp = b**exp
        if exp > MAX_TOWER_EXP:
            return None
    base = nums[0]
    for k in range(base.bit_length(), 1, -1):  # the smallest root of the base
        r = round(base ** (1 / k))
        for c in (r - 1, r, r + 1):
            if c > 1 and c**k == base:
                return c, exp * k
    return base, exp
