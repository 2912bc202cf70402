"""Math answer grader: a cheap certain fast path, math-verify in a sandboxed worker, a fallback.

Pipeline for one (prediction, gold) pair, each step only running when the one before could not
decide with certainty:

1. **Extraction** (ours, regex + brace matching, on the last ``TAIL_CHARS`` of the output):
   the last ``\\boxed{}`` group (adjacent boxes ``\\boxed{3}, \\boxed{5}`` are one set answer,
   as in math-verify >= 0.8; a box followed by more prose and another box is a correction, so
   only the last group counts), else the text after the last "final answer" / "answer is" /
   "Answer:" marker, else -- only for a *short, finished, non-truncated* output -- the final
   math span / final bare number / last ``= N`` result. Long or truncated outputs without a
   marker get no answer: the rightmost number of an unfinished trace is not an answer
   (survey: prime_math and plain math-verify accept truncated traces this way).
2. **Fast path** (no sympy): exact match after light normalisation (Hendrycks ``strip_string``
   style: ``\\left``, ``\\dfrac``, ``\\text{}``, degrees, percent, units), multiple-choice
   letters, and plain numbers (int, decimal, ``\\frac{a}{b}``, ``a/b``, ``1,000``, e-notation,
   ``a \\times 10^{b}``) compared exactly as rationals. It returns a verdict only when both
   sides are plain numbers or the strings are equal; everything else goes to step 3.
3. **math-verify** (``parse`` + ``verify``, LaTeX extraction only, so no model text ever
   reaches sympy's ``parse_expr``/``eval``) in a persistent worker subprocess with a per-call
   deadline; a worker that overruns is killed and replaced, and it runs under an address-space
   limit. math-verify's own ``signal.alarm`` timeouts are switched off (they raise outside the
   main thread, math-verify #50/#55). Guards on its True verdicts: relative tolerance for
   tiny/huge magnitudes (math-verify rounds to 6 decimal places, so ``1/2^99 == 1/2^98``, #14)
   and exact set sizes for "find all" answers (#47).
4. **Fallback** when math-verify parses nothing on a side: normalised-string / numeric
   comparison, then an optional pluggable judge (``set_verifier``), e.g. an LLM verifier, as
   DeepScaleR does with its ORM.

Answer filters (``answer_filter``, named as lm-evaluation-harness names its answer filters):

- ``"math"`` (default): the pipeline above; an answer is right when it is mathematically equal
  to the gold, so ``41 \times 74`` is accepted for the gold ``3034``.
- ``"numeric"``: when the gold is a plain number, the answer must be a number *literal*
  (``numeric_literal``): an integer or decimal (thousands separators, ``$`` allowed), or a fraction
  ``a/b`` / ``\\frac{a}{b}`` in lowest terms with b > 1; the right-hand side of a final ``=``
  (``4 * 8 = 32``, ``x = 12``), outer parentheses / braces and trailing unit words (``12 apples``)
  are read through. Anything else, e.g. ``41 * 74``, ``48/2``, ``10^2``, ``1e2``, is
  ``Verdict(False, answer, "not_a_number")``. For arithmetic tasks (the synthetic ladders, GSM8K),
  where restating the question is not an answer: a reward-only run on the hard ladder learned to
  answer "the answer is 41 * 74" and scored 0.223 under ``"math"``, 0.009 under ``"numeric"``
  (bench/LEARNING.md). Golds that are not plain numbers are graded as ``"math"``.

CLI: ``python -m data_tools.grader FILE.jsonl`` (``-`` for stdin); see ``main``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

__all__ = [
    "Verdict",
    "grade",
    "grade_batch",
    "parse_gold",
    "extract_gsm8k_answer",
    "set_verifier",
    "ANSWER_FILTERS",
]

#: Answer filters ``grade`` / ``grade_batch`` accept (module docstring).
ANSWER_FILTERS = ("math", "numeric")

# Only the tail of an output is read: answers sit at the end, and regexes / brace scans over a
# megabyte of text are the slow part on adversarial outputs.
TAIL_CHARS = 8000
# Outputs up to this many characters may be graded without a final-answer marker (a bare final
# number, "... = 18 dollars."); longer ones must mark their answer (box / "answer is").
SHORT_CHARS = 1000
# Answers longer / deeper than this never reach sympy: real answers are short, and
# latex2sympy's recursive descent is where nesting bombs hurt.
MAX_ANSWER_CHARS = 600
MAX_BRACE_DEPTH = 40
# A plain number with a larger power-of-ten exponent is not parsed into a Fraction.
MAX_EXP10 = 400
# Significant digits a decimal must carry to count as an approximation of an exact value
# (math-verify's float_rounding=6, but relative instead of absolute decimal places).
APPROX_SIG_DIGITS = 6
# Relative tolerance used to veto math-verify's True between two numbers (see _mv_check).
REL_TOL = 1e-6
# Worker start-up (imports sympy + math-verify) is not counted against the per-answer deadline.
WORKER_START_TIMEOUT_S = 60.0
# Address-space cap for a worker: a power tower that sneaks past the pre-screen dies with
# MemoryError instead of taking the machine down.
WORKER_MEM_BYTES = 3 * 1024**3
_CACHE_SIZE = 65536


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None  # the answer string taken from the prediction (None if none found)
    path: str  # "exact", "numeric", "math_verify", "fallback", "no_answer", "timeout", "error", "not_a_number"


# --------------------------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# `\boxed 5` (no braces) is legal LaTeX; verl's math_reward special-cases it. Same line only,
# so "Mark your solution with \boxed \nThe sum..." is not read as an answer.
_BOX_SPACE_RE = re.compile(r"\\boxed[ \t]+(-?[0-9][0-9.,/]*)")
# What may sit between two boxes for them to form one answer ("\boxed{3}, \boxed{5} and \boxed{7}").
_BOX_JOIN_RE = re.compile(r"^[\s$,;]*(?:(?:and|or|\\text\{\s*and\s*\})[\s$,]*)?$")
# "####" is GSM8K's answer marker, which models fine-tuned on GSM8K reproduce.
_MARKER_RE = re.compile(r"(?i)(?:final\s+answer|\banswer)\b(?:\s*\*\*)?\s*(?:is|:|=)?|####")
_IS_RE = re.compile(r"(?i)\b(?:is|are|equals|be)\b:?")
_NUM_TOKEN = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_FINAL_NUM_RE = re.compile(rf"(?:^|[\s=:(*])({_NUM_TOKEN})\s*(?:\*\*)?\s*[.!]?\s*$")
_LAST_EQ_NUM_RE = re.compile(rf"=\s*({_NUM_TOKEN})(?![\d.])")
_FINAL_SPAN_RE = re.compile(
    r"(?:\$\$(?P<a>[^$]+?)\$\$|\$(?P<b>[^$\n]+?)\$|\\\[(?P<c>.+?)\\\]|\\\((?P<d>.+?)\\\))"
    r"\s*[.!]?\s*$",
    re.DOTALL,
)
# A plain-text expression ending the last line after "is"/"=" ("the value is -1 + exp(16)").
_FINAL_EXPR_RE = re.compile(r"(?:\bis|=)\s*([-+*/^().,\w\s\\{}]{1,80}?)\s*[.!]?\s*$")


def _match_brace(s: str, open_idx: int) -> int:
    """Index of the '}' closing the '{' at open_idx, or -1 if unbalanced (truncated output)."""
    depth = 0
    for i in range(open_idx, len(s)):
        c = s[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _boxes(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of every closed box, in order; an unclosed box is (start, -1, '')."""
    out: list[tuple[int, int, str]] = []
    for m in _BOX_RE.finditer(text):
        if out and out[-1][1] > m.start():  # nested box inside a previous one
            continue
        close = _match_brace(text, m.end() - 1)
        if close < 0:
            out.append((m.start(), -1, ""))
            break  # everything after an unclosed brace is inside it
        out.append((m.start(), close + 1, text[m.end() : close]))
    for m in _BOX_SPACE_RE.finditer(text):
        if not any(s <= m.start() < (e if e >= 0 else len(text)) for s, e, _ in out):
            out.append((m.start(), m.end(), m.group(1)))
    out.sort()
    return out


def _clip_sentence(seg: str) -> str:
    """First sentence/clause of seg: up to a sentence '.', a newline, ', which' and the like."""
    seg = seg.strip().lstrip("*:").strip()
    for opener, closer in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if seg.startswith(opener):
            end = seg.find(closer, len(opener))
            if end > 0:
                return seg[len(opener) : end].strip()
            return ""  # unclosed math: truncated
    m = re.search(r"(?<!\d)\.(?!\d)|\.(?=\s|$)|[;\n]|,\s+(?=[A-Za-z]{2})|\s(?:so|since|because|and then)\s", seg)
    if m:
        seg = seg[: m.start()]
    return seg.strip().strip("*").strip()


def _looks_unfinished(text: str) -> bool:
    """A trace that stops mid-expression: trailing operator / '=' / open bracket, odd '$'."""
    t = text.rstrip()
    if not t:
        return True
    if t[-1] in "=+-*/^(,[{\\:" or t.endswith(("\\cdot", "\\times")):
        return True
    if t.count("{") != t.count("}"):
        return True
    if (t.count("$") - t.count("\\$")) % 2 == 1:
        return True
    return False


def _extract(pred: str, truncated: bool) -> tuple[str | None, str]:
    """(answer, how) with how in {"boxed", "marker", "bare", "none"}; see the module docstring."""
    full_len = len(pred)
    text = pred[-TAIL_CHARS:].replace("\u2212", "-")
    boxes = _boxes(text)
    if boxes:
        if boxes[-1][1] < 0:
            return None, "none"  # the last box was cut off: the answer was never written
        group = [boxes[-1]]
        for b in reversed(boxes[:-1]):
            if b[1] >= 0 and _BOX_JOIN_RE.match(text[b[1] : group[0][0]]):
                group.insert(0, b)
            else:
                break
        return ", ".join(c.strip() for _, _, c in group), "boxed"

    markers = list(_MARKER_RE.finditer(text))
    if markers:
        seg = text[markers[-1].end() : markers[-1].end() + 400]
        # "Final Answer: The largest $n$ is 34." -> after the last "is" in the clause
        first_line = seg.strip().split("\n", 1)[0] if seg.strip() else ""
        if not first_line.lstrip("*: ").startswith(("$", "\\(", "\\[")):
            iss = list(_IS_RE.finditer(first_line))
            if iss:
                first_line = first_line[iss[-1].end() :]
        ans = _clip_sentence(first_line)
        if ans:
            return ans, "marker"
        if not seg.strip():
            return None, "none"  # marker then nothing: cut off
        # marker followed by something we cannot read: fall through to the bare rules

    # No marker: only a short, finished output may be read by its last number / math span.
    if truncated or full_len > SHORT_CHARS or _looks_unfinished(text):
        return None, "none"
    m = _FINAL_SPAN_RE.search(text)
    if m:
        span = next(g for g in m.groups() if g is not None).strip()
        if span:
            return span, "bare"
    last_line = text.rstrip().rsplit("\n", 1)[-1]
    m = _FINAL_NUM_RE.search(last_line)
    if m:
        return m.group(1).replace("$", ""), "bare"
    m = _FINAL_EXPR_RE.search(last_line)
    if m and re.search(r"\d", m.group(1)):
        return m.group(1).strip(), "bare"
    eqs = list(_LAST_EQ_NUM_RE.finditer(text))
    if eqs:
        return eqs[-1].group(1).replace("$", ""), "bare"
    return None, "none"


def extract_gsm8k_answer(text: str) -> str | None:
    """The answer after GSM8K's ``#### `` marker, thousands separators and ``$`` removed.

    ``"... #### 1,234"`` -> ``"1234"``. Looks at the last ``####`` only (the GSM8K convention,
    Cobbe et al. 2021). Returns None when there is no marker or nothing after it. Never raises.
    """
    if not isinstance(text, str):
        return None
    idx = text.rfind("####")
    if idx < 0:
        return None
    ans = text[idx + 4 :].strip().split("\n", 1)[0].strip()
    ans = ans.replace("$", "").rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", ans):
        ans = ans.replace(",", "")
    return ans or None


# --------------------------------------------------------------------------------------------
# Normalisation and the fast path
# --------------------------------------------------------------------------------------------

_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNIT_TAIL_RE = re.compile(
    r"(?:\\[ ,;:!]|~|\s)*\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?\s*$"
)
_DEG_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")


def _strip_outer(s: str) -> str:
    """Remove surrounding $...$, \\(...\\), \\[...\\], \\boxed{...} and a trailing period."""
    s = s.strip()
    changed = True
    while changed and s:
        changed = False
        for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) > len(a) + len(b) - 1 and s.startswith(a) and s.endswith(b):
                s = s[len(a) : len(s) - len(b)].strip()
                changed = True
        m = _BOX_RE.match(s)
        if m and _match_brace(s, m.end() - 1) == len(s) - 1:
            s = s[m.end() : -1].strip()
            changed = True
        if s.endswith(".") and not re.search(r"\d\.$", s[-2:]):
            s = s[:-1].rstrip()
            changed = True
    return s


def _norm_str(s: str) -> str:
    """Light, meaning-preserving normalisation for the exact-match path.

    A subset of Hendrycks' ``strip_string`` (MATH, 2021) that cannot merge different answers:
    spacing commands, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, ``\\text{}`` wrappers,
    degree signs, a trailing unit, ``\\%``. (strip_string's ``k=`` prefix removal is left to
    math-verify: it is what makes verl accept ``11a+c`` for ``7 = 11a+c``.)
    """
    s = _strip_outer(s).replace("\u2212", "-")
    s = re.sub(r"\\left\b|\\right\b|\\displaystyle", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("{,}", ",")
    # A trailing unit is dropped only after a number ("12\text{ ft}"), so a text answer
    # ("\text{Evelyn}") is not erased to the empty string.
    t = _UNIT_TAIL_RE.sub("", s)
    if t != s and re.search(r"[0-9}]\s*$", t):
        s = t
    for _ in range(3):
        s = _TEXT_WRAP_RE.sub(r"\1", s)
    s = _DEG_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\\[ ,;:!]|~", "", s)
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


_INT = r"[0-9]+"
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


_MC_RE = re.compile(r"\(?([A-E])\)?(?:$|[\s.:,]|\\)")


def _mc_letter(norm_gold_raw: str) -> str | None:
    m = re.fullmatch(r"\(?([A-E])\)?", norm_gold_raw)
    return m.group(1) if m else None


def _fast_path(answer: str, gold: str) -> Verdict | None:
    """A certain verdict without sympy, or None to defer to math-verify."""
    na, ng = _norm_str(answer), _norm_str(gold)
    if na and na == ng:
        return Verdict(True, answer, "exact")
    letter = _mc_letter(ng)
    if letter is not None:
        # Multiple choice: the answer is the option letter, possibly followed by the option's
        # value ("\mathrm{(D)}\ 1,008,016"). Keep the raw spacing to see where the letter ends.
        raw = _strip_outer(answer)
        for _ in range(3):
            raw = _TEXT_WRAP_RE.sub(r"\1", raw)
        raw = re.sub(r"^[\s\\{}]*|\\[ ,;:!]", " ", raw).strip()
        m = _MC_RE.match(raw + " ")
        if m:
            return Verdict(m.group(1) == letter, answer, "exact")
    a, g = _as_number(na), _as_number(ng)
    if a is not None and g is not None:
        return Verdict(_numbers_equal(a, g), answer, "numeric")
    return None


# --------------------------------------------------------------------------------------------
# Pre-screen and plain-text -> LaTeX for the sympy path
# --------------------------------------------------------------------------------------------

_SCI_RE = re.compile(r"(?<![\w.\\])([0-9]+(?:\.[0-9]+)?)[eE]([+-]?[0-9]+)(?![\w])")


def _to_latex(s: str) -> str:
    """Rewrite plain-text math a model may write into LaTeX latex2sympy understands.

    e-notation ``4.5e33`` (latex2sympy reads ``1e-5`` as ``1*E - 5``), ``exp(x)``,
    ``sqrt(x)``, ``pi``, ``**`` (math-verify #69 lists these as rejected).
    """
    s = s.replace("\u2212", "-").replace("**", "^")
    s = _SCI_RE.sub(lambda m: f"{m.group(1)}\\times 10^{{{m.group(2)}}}", s)
    s = re.sub(r"(?<![\\A-Za-z])exp\(([^()]*)\)", r"e^{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])sqrt\(([^()]*)\)", r"\\sqrt{\1}", s)
    s = re.sub(r"(?<![\\A-Za-z])pi(?![A-Za-z])", r"\\pi", s)
    return s


def _too_risky(s: str) -> str | None:
    """Reason an answer must not go to sympy, or None. Cheap, linear in len(s)."""
    if len(s) > MAX_ANSWER_CHARS:
        return "answer too long"
    depth = maxd = 0
    for c in s:
        if c == "{" or c == "(":
            depth += 1
            maxd = max(maxd, depth)
        elif c == "}" or c == ")":
            depth -= 1
    if maxd > MAX_BRACE_DEPTH:
        return "nesting too deep"
    # Power towers and big exponents: 9^9^9^9, 2^{10^{100}}, 10^{100000}!
    # A numeric base raised to a power of a number (9^9^9, 2^{3^{4}}, 2^(3)^4) can be astronomically
    # large; x^2+y^2 and e^{-x^2} are fine. 2^{3^2} is refused too: rare, and cheaper than a timeout.
    if re.search(r"[0-9)}]\s*\^\s*[{(]?\s*[-+]?\s*[{(]?[0-9.]+[)}]?\s*\^", s):
        return "power tower"
    for m in re.finditer(r"\^\s*\{?\s*[-+]?([0-9]+)", s):
        if len(m.group(1)) > 4:
            return "huge exponent"
    if re.search(r"[0-9]{6,}\s*!", s):
        return "huge factorial"
    if len(re.findall(r"[0-9]", s)) > 400:
        return "too many digits"
    return None


# --------------------------------------------------------------------------------------------
# Worker subprocess running math-verify
# --------------------------------------------------------------------------------------------


def _worker_loop() -> None:  # pragma: no cover - runs in the child process
    """Child side: read JSON requests on stdin, answer one JSON line each on stdout."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEM_BYTES, WORKER_MEM_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    import logging

    logging.disable(logging.WARNING)  # math-verify warns once that its timeout is off: we know
    sys.setrecursionlimit(4000)
    from math_verify import LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(boxed_match_priority=0)]
    gold_cache: OrderedDict[str, list] = OrderedDict()
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            res = _mv_check(req["gold"], req["pred"], parse, verify, cfg, gold_cache)
        except MemoryError:
            res = {"error": "MemoryError"}
        except Exception as e:  # noqa: BLE001 - a bad answer must never kill the worker loop
            res = {"error": f"{type(e).__name__}: {e}"[:300]}
        out.write(json.dumps(res) + "\n")
        out.flush()


def _scalar_value(x):
    """High-precision complex value of a symbol-free sympy scalar, or None."""
    import sympy

    if not isinstance(x, sympy.Expr) or x.free_symbols or not x.is_number:
        return None
    try:
        v = sympy.N(x, 30)
        complex(v)  # raises for values sympy cannot evaluate to a number
    except Exception:  # noqa: BLE001
        return None
    return v


def _set_size(x):
    import sympy
    from latex2sympy2_extended.sets import FiniteSet

    if isinstance(x, (FiniteSet, sympy.FiniteSet)):
        return len(x.args)
    if isinstance(x, sympy.Expr) and not isinstance(x, (sympy.Set,)):
        return 1
    return None


def _mv_check(gold: str, pred: str, parse, verify, cfg, gold_cache) -> dict:  # pragma: no cover
    """math-verify parse + verify with our guards; runs inside the worker."""
    g = gold_cache.get(gold)
    if g is None:
        g = parse(gold, extraction_config=cfg, parsing_timeout=None)
        gold_cache[gold] = g
        if len(gold_cache) > 4096:
            gold_cache.popitem(last=False)
    p = parse(pred, extraction_config=cfg, parsing_timeout=None)
    # parse() appends the raw matched string as a last candidate (fallback_mode="first_match"),
    # which verify() may still match as a string; "parsed" means a sympy object came out.
    res = {
        "gold_parsed": any(not isinstance(x, str) for x in g),
        "pred_parsed": any(not isinstance(x, str) for x in p),
    }
    if not g or not p:
        res["ok"] = None
        return res
    ok = bool(verify(g, p, timeout_seconds=None, allow_set_relation_comp=True))
    if ok:
        gs, ps = g[0], p[0]
        # Relative tolerance: math-verify compares numbers rounded to 6 decimal places, so any
        # two values below 5e-7 are "equal" (1/2004! == 1/2006!, math-verify #14).
        gv, pv = _scalar_value(gs), _scalar_value(ps)
        if gv is not None and pv is not None:
            import sympy

            diff = abs(sympy.N(gv - pv, 30))
            scale = max(abs(gv), abs(pv))
            if scale != 0 and diff > REL_TOL * scale:
                ok = False
                res["veto"] = "relative tolerance"
        # Exact set semantics: a proper subset of a "find all" answer is wrong (#47).
        gn, pn = _set_size(gs), _set_size(ps)
        if ok and gn is not None and pn is not None and gn != pn and (gn > 1 or pn > 1):
            ok = False
            res["veto"] = "set size"
    res["ok"] = ok
    return res


class _Worker:
    def __init__(self) -> None:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        # A fresh interpreter (not fork): safe when the parent has threads, and no re-import of
        # the caller's __main__ as multiprocessing's spawn would do.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from data_tools.grader import _worker_loop; _worker_loop()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            close_fds=True,
        )
        msg = self._read(WORKER_START_TIMEOUT_S)
        if not msg or not msg.get("ready"):
            self.kill()
            raise RuntimeError("grader worker failed to start (is math-verify installed?)")

    def _read(self, timeout: float) -> dict | None:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not r:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("grader worker died")
        return json.loads(line)

    def call(self, req: dict, timeout: float) -> dict | None:
        """The worker's answer, or None on timeout (the worker is then dead)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        res = self._read(timeout)
        if res is None:
            self.kill()
        return res

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f:
                    f.close()
            except Exception:  # noqa: BLE001
                pass


class _Pool:
    """Idle workers shared by all threads; each call takes one exclusively."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def call(self, req: dict, timeout: float) -> dict | None:
        with self._lock:
            w = self._idle.pop() if self._idle else None
        if w is None or not w.alive():
            w = _Worker()
        try:
            res = w.call(req, timeout)
        except (EOFError, OSError, ValueError):
            w.kill()
            return {"error": "worker died"}
        if res is None:
            return None
        with self._lock:
            if len(self._idle) < max(2, (os.cpu_count() or 2) * 2):
                self._idle.append(w)
                w = None
        if w is not None:
            w.kill()
        return res

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_POOL = _Pool()
atexit.register(_POOL.close)
_CACHE: OrderedDict[tuple[str, str], dict] = OrderedDict()
_CACHE_LOCK = threading.Lock()


def _math_verify(gold_latex: str, pred_latex: str, timeout_s: float) -> dict | None:
    """Cached worker call: {'ok': bool|None, ...}, or None on timeout. Timeouts are not cached."""
    key = (gold_latex, pred_latex)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    res = _POOL.call({"gold": gold_latex, "pred": pred_latex}, timeout_s)
    if res is not None and "error" not in res:
        with _CACHE_LOCK:
            _CACHE[key] = res
            if len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return res


# --------------------------------------------------------------------------------------------
# Fallback verifier
# --------------------------------------------------------------------------------------------

_VERIFIER: Callable[[str, str], bool | None] | None = None


def set_verifier(fn: Callable[[str, str], bool | None] | None) -> None:
    """Install (or remove, with None) a second-opinion judge, e.g. an LLM verifier.

    ``fn(extracted_answer, gold) -> True / False / None`` (None = no opinion). It is asked only
    when the rules found no equivalence without proving a difference: math-verify could not
    parse a side, or math-verify said "not equal" for a non-numeric answer (the DeepScaleR
    pattern of sending "no equivalence found" to its ORM). Exceptions it raises are treated as
    no opinion. It is called from the grading thread, so it must be thread-safe.
    """
    global _VERIFIER
    _VERIFIER = fn


def _ask_verifier(answer: str, gold: str) -> bool | None:
    fn = _VERIFIER
    if fn is None:
        return None
    try:
        r = fn(answer, gold)
    except Exception:  # noqa: BLE001 - a broken judge must not break grading
        return None
    return None if r is None else bool(r)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _gold_text(gold: str) -> str:
    g = gold.strip()
    if "####" in g:
        g = extract_gsm8k_answer(g) or ""
    return _strip_outer(g)


def grade(pred: str, gold: str, *, truncated: bool = False, timeout_s: float = 5.0,
          answer_filter: str = "math") -> Verdict:
    """Grade one model output against a reference answer.

    Args:
        pred: the full model output (any length; only the last ``TAIL_CHARS`` characters are read).
        gold: the reference answer (LaTeX or plain; GSM8K ``#### N`` accepted).
        truncated: True when the completion hit the generation cap (finish_reason == "length"):
            still graded as produced, but never by falling back to a trailing number without a
            final-answer marker.
        timeout_s: wall-clock bound in seconds for the sympy (math-verify) step; on overrun the
            worker is killed and the verdict is ``Verdict(False, answer, "timeout")``. The first
            call in a process also waits for a worker to start (imports, ~1-3 s, capped at
            ``WORKER_START_TIMEOUT_S``).
        answer_filter: ``"math"`` (equal as mathematics) or ``"numeric"`` (a plain-number gold
            needs a plain-number answer); see the module docstring.

    Returns:
        A ``Verdict``; ``path`` says which step decided. Never raises on any string input
        (internal failures give ``path="error"``); raises ``TypeError`` if pred/gold are not str,
        ``ValueError`` for an unknown ``answer_filter``.
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError("grade(pred, gold): both must be str")
    if answer_filter not in ANSWER_FILTERS:
        raise ValueError(f"answer_filter must be one of {ANSWER_FILTERS}, got {answer_filter!r}")
    try:
        answer, _how = _extract(pred, truncated)
    except Exception:  # noqa: BLE001
        return Verdict(False, None, "error")
    if answer is None or not answer.strip():
        return Verdict(False, None, "no_answer")
    g = _gold_text(gold)
    if not g:
        return Verdict(False, answer, "error")
    if answer_filter == "numeric":
        try:
            gold_num, ans_num = _as_number(_norm_str(g)), numeric_literal(answer)
        except Exception:  # noqa: BLE001
            gold_num = ans_num = None
        if gold_num is not None:
            if ans_num is None:
                return Verdict(False, answer, "not_a_number")
            return Verdict(_numbers_equal(ans_num, gold_num), answer, "numeric")
    try:
        fast = _fast_path(answer, g)
    except Exception:  # noqa: BLE001
        fast = None
    if fast is not None:
        return fast

    pred_l, gold_l = _to_latex(answer), _to_latex(g)
    if _too_risky(pred_l) or _too_risky(gold_l):
        return _fallback(answer, g)
    res = _math_verify(f"${gold_l}$", f"${pred_l}$", timeout_s)
    if res is None:
        return Verdict(False, answer, "timeout")
    if "error" in res or res.get("ok") is None:
        return _fallback(answer, g)
    if res["ok"]:
        return Verdict(True, answer, "math_verify")
    if not (res.get("gold_parsed") and res.get("pred_parsed")):
        return _fallback(answer, g)  # math-verify could not read a side: not evidence of "wrong"
    judge = _ask_verifier(answer, g)
    if judge is not None:
        return Verdict(judge, answer, "fallback")
    return Verdict(False, answer, "math_verify")


def _fallback(answer: str, gold: str) -> Verdict:
    """Normalised-string / numeric comparison, then the pluggable judge."""
    na, ng = _norm_str(answer), _norm_str(gold)
    if na.lower() == ng.lower() and na:
        return Verdict(True, answer, "fallback")
    a, g = _as_number(na), _as_number(ng)
    if a is not None and g is not None:
        return Verdict(_numbers_equal(a, g), answer, "fallback")
    judge = _ask_verifier(answer, gold)
    return Verdict(bool(judge), answer, "fallback")


def grade_batch(
    preds: Sequence[str],
    golds: Sequence[str],
    *,
    truncated: Sequence[bool] | None = None,
    timeout_s: float = 5.0,
    workers: int | None = None,
    answer_filter: str = "math",
) -> list[Verdict]:
    """Grade many answers; order preserved; each bounded by ``timeout_s`` seconds of sympy.

    ``workers`` threads (default: CPU count, at most 8) each drive their own math-verify
    subprocess, so the sympy step runs in parallel. Safe to call from any thread. Raises
    ``ValueError`` if the sequences differ in length or ``answer_filter`` is unknown
    (``ANSWER_FILTERS``; see ``grade``).
    """
    if answer_filter not in ANSWER_FILTERS:
        raise ValueError(f"answer_filter must be one of {ANSWER_FILTERS}, got {answer_filter!r}")
    n = len(preds)
    if len(golds) != n or (truncated is not None and len(truncated) != n):
        raise ValueError("grade_batch: preds, golds (and truncated) must have the same length")
    tr = list(truncated) if truncated is not None else [False] * n
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    if workers <= 1 or n <= 1:
        return [grade(p, g, truncated=t, timeout_s=timeout_s, answer_filter=answer_filter)
                for p, g, t in zip(preds, golds, tr)]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(lambda a: grade(a[0], a[1], truncated=a[2], timeout_s=timeout_s, answer_filter=answer_filter),
                           zip(preds, golds, tr)))


def parse_gold(answer: str) -> str | None:
    """Normalise a reference answer for data loading; None if it is not an answer at all.

    Strips ``$``/``\\boxed{}`` wrappers and GSM8K's ``#### `` (see ``extract_gsm8k_answer``);
    plain numbers come back canonical (``"1,234"`` -> ``"1234"``, ``"004"`` -> ``"4"``).
    Anything else is kept as written if math-verify (in the bounded worker, 5 s) parses it, or if
    it is a short plain string answer (``\\text{Evelyn}``, ``B``). Returns None for non-str,
    empty, over-long or unparseable input. Never raises.
    """
    if not isinstance(answer, str):
        return None
    g = _gold_text(answer)
    if not g or len(g) > MAX_ANSWER_CHARS:
        return None
    num = _as_number(_norm_str(g))
    if num is not None:
        v = num.value
        if v.denominator == 1:
            return str(v.numerator)
        if num.sig_digits is None:
            return g  # keep \frac{1}{3} as written
        return _norm_str(g)
    plain = _norm_str(g)
    if re.fullmatch(r"[A-Za-z][A-Za-z .'-]{0,60}", plain):
        return g
    gl = _to_latex(g)
    if _too_risky(gl):
        return None
    res = _math_verify(f"${gl}$", f"${gl}$", 5.0)
    if res is None or "error" in res or not res.get("gold_parsed"):
        return None
    return g


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m data_tools.grader FILE.jsonl``: add ``correct``, ``extracted``, ``grader_path``.

    Each input line is JSON with ``gold`` and ``pred`` (optional ``truncated``); output lines
    go to stdout in input order. A bad line (not JSON, not an object, missing/non-string field)
    is reported on stderr with its line number, echoed with ``correct: false`` and an ``error``
    field, and makes the exit code 1. ``-`` reads stdin.
    """
    ap = argparse.ArgumentParser(prog="python -m data_tools.grader", description=main.__doc__)
    ap.add_argument("file", help="JSON-lines file with 'gold' and 'pred' fields, or - for stdin")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per answer for sympy")
    ap.add_argument("--workers", type=int, default=None, help="grading threads (default: cores)")
    ap.add_argument("--answer_filter", default="math", choices=ANSWER_FILTERS,
                    help="math: equal as mathematics; numeric: a number gold needs a number literal (module docstring)")
    args = ap.parse_args(argv)

    try:
        if args.file == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(args.file, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        print(f"grader: error: cannot read {args.file}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2

    rows: list[dict] = []
    todo: list[int] = []
    bad = 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        err = None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            obj, err = {"line": line}, f"not JSON: {e.msg}"
        if err is None and not isinstance(obj, dict):
            obj, err = {"line": obj}, "not a JSON object"
        if err is None and isinstance(obj.get("gold"), int) and not isinstance(obj["gold"], bool):
            obj["gold"] = str(obj["gold"])  # an integer gold ("gold": 42) is unambiguous
        if err is None:
            missing = [k for k in ("gold", "pred") if not isinstance(obj.get(k), str)]
            if missing:
                err = "missing or non-string field(s): " + ", ".join(missing)
        if err is not None:
            bad += 1
            print(f"{args.file}:{i}: {err}", file=sys.stderr)
            obj.update(correct=False, extracted=None, grader_path="error", error=err)
        else:
            todo.append(len(rows))
        rows.append(obj)

    verdicts = grade_batch(
        [rows[j]["pred"] for j in todo],
        [rows[j]["gold"] for j in todo],
        truncated=[bool(rows[j].get("truncated", False)) for j in todo],
        timeout_s=args.timeout,
        workers=args.workers,
        answer_filter=args.answer_filter,
    )
    for j, v in zip(todo, verdicts):
        rows[j].update(correct=v.correct, extracted=v.extracted, grader_path=v.path)
    out = sys.stdout
    for r in rows:
        out.write(json.dumps(r, ensure_ascii=False) + "\n")
    out.flush()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
