"""The ``formal`` grader profile: the formal metric's rule grader, mirrored from its stated behaviour.

The formal run is scored by JustRL's rule grader (``grade_answer_verl`` in thunlp/JustRL ``evals/utils.py``).
This module re-states what that grader does, rule by rule, in our own code (no eval of model text, no
pylatexenc), so that stage one's "verified" and the trainer's reward accept nothing the metric rejects:

- **Extraction.** The answer is the content of the *last* ``\\boxed`` in the whole completion (the reasoning
  included: the metric does not look for ``</think>``), matched by counting braces from that ``\\boxed``;
  the match must read ``\\boxed{...}`` exactly. No ``\\boxed`` -> no answer; a last ``\\boxed`` that never
  closes, ``\\boxed {5}`` (a space) or ``\\boxed 5`` -> no answer, even when an earlier box was right.
  ``\\fbox``, "Answer: 42" (DAPO's answer line), "the answer is 42" are not answers.
- **Comparison.** The answer is right when one of three tests passes (each one only ever accepts what the
  metric accepts):

  1. ``hendrycks``: both sides equal after the MATH normalisation (``\\!``, ``\\left``/``\\right``, degree
     marks, ``\\$``, ``\\%``, a unit after ``\\text{ ``, a short ``x =`` prefix and all spaces removed;
     ``dfrac``/``tfrac`` read as ``frac``; ``\\sqrt2``, ``\\frac12``, ``a/b`` and ``0.5`` rewritten). So
     ``42^\\circ``, ``\\$42``, ``x = 42``, ``\\text{42}``, ``42 \\text{ cm}`` and ``4 2`` are right for 42.
  2. ``plain``: both sides equal after the second normalisation (``$``/``%`` dropped, a few unit words
     dropped, one pair of outer braces dropped, a float-readable integer written as an integer, thousands
     commas removed, lower case). So ``42.0``, ``042``, ``1e3`` (for 1000), ``1,000`` and ``{42}`` are right.
     Where that normalisation would read LaTeX (a backslash is left), the metric runs pylatexenc and sympy;
     this profile does not and refuses (see "Stricter" below).
  3. ``element``: a one-element bracket ``(42)`` / ``[42]``, or elements of a tuple, compared one by one as
     the metric does: an integer gold needs an integer-valued element; here only plain decimal literals
     (``42``, ``-7``, ``42.0``) are compared, exactly.

  An integer gold therefore needs the integer itself: ``\\frac{84}{2}``, ``41+1``, ``6 \\times 7``, ``10^3``,
  ``1\\,000``, ``42 apples`` are wrong for 42 / 1000, as in the metric.

**Stricter than the metric** (it rewards these, this profile does not), by design:

- a completion that hit the length cap (``truncated=True``) counts only when its last box is final -- nothing
  but closing punctuation after it -- as every profile here does (the metric sees no cap);
- answers that the metric reads through pylatexenc or sympy: ``\\textbf{42}``, ``\\mathbf{42}``,
  ``\\left(42\\right)``, ``42\\,`` for 42; and for golds that are not integers, equal expressions that are
  not equal strings after tests 1 and 2 (``2\\sqrt{3}`` for ``\\sqrt{12}``, ``x+1`` for ``1+x``);
- the metric's own second opinion: JustRL's ``grade.py`` asks CompassVerifier-3B about every completion the
  rule grader rejects; this profile is the rule grader alone.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .extraction import _is_final

BOX = "\\boxed"
BOX_OPEN = BOX + "{"
_BRACE_RE = re.compile(r"[{}]")


def last_box(text: str) -> tuple[str | None, int]:
    """(content, end) of the metric's answer: the last ``\\boxed`` of ``text`` when it reads ``\\boxed{...}``
    with its braces closed; ``(None, -1)`` otherwise.

    Braces are counted from the ``\\boxed`` on, and the first ``}`` that brings the count back to zero ends it.
    """
    idx = text.rfind(BOX)
    if idx < 0:
        return None, -1
    depth = 0
    for m in _BRACE_RE.finditer(text, idx):
        if m.group(0) == "{":
            depth += 1
            continue
        depth -= 1
        if depth == 0:
            end = m.end()
            if not text.startswith(BOX_OPEN, idx):
                return None, -1  # "\boxed {5}": the metric only unwraps "\boxed{"
            return text[idx + len(BOX_OPEN):end - 1], end
    return None, -1


# ---- test 1: the MATH (Hendrycks) normalisation ------------------------------------------------------

class _Unchanged(Exception):
    """The normalisation gives up: the answer is compared as written (stripped)."""


_TEXT_WHOLE_RE = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def _units(s: str) -> str:
    # "\text{ " only ever introduces a unit; more than one of them and the normalisation gives up.
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _Unchanged
    return parts[0]


def _sqrt_braces(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *rest = s.split("\\sqrt")
    out = [head]
    for piece in rest:
        if not piece:
            raise _Unchanged  # "\sqrt" ends the answer
        out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _frac_braces(s: str) -> str:
    head, *rest = s.split("\\frac")
    out = [head]
    for piece in rest:
        if not piece:
            raise _Unchanged  # "\frac" ends the answer
        if piece[0] == "{":
            out.append("\\frac" + piece)
        elif len(piece) < 2:
            return s  # "\frac3": left as it is, the rest of the normalisation goes on
        elif piece[1] != "{":
            out.append("\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:])
        else:
            out.append("\\frac{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _slash_fraction(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def hendrycks(answer: str) -> str:
    """The MATH normalisation of ``answer`` as the metric's first test applies it."""
    answer = answer.strip()
    m = _TEXT_WHOLE_RE.search(answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return _hendrycks_steps(answer)
    except _Unchanged:
        return answer


def _hendrycks_steps(s: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _units(s).replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5", "k=5"
        s = sides[1]
    s = _sqrt_braces(s).replace(" ", "")
    s = _frac_braces(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_fraction(s)


# ---- test 2: the second normalisation, where it needs no LaTeX reader -----------------------------------

_UNIT_WORDS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
               "year", "foot", "feet", "inch", "yard")
_UNIT_RES = tuple(re.compile(u + r"(es)?(s)? *(\^[0-9]+)?") for u in _UNIT_WORDS)
_DEGREE_RE = re.compile(r"\^ *\\circ")
_COMMA_SPACE_RE = re.compile(r",\\! *")
_MINUS_RE = re.compile(r"- *")
_MIXED_RE = re.compile(r"([0-9]) +([0-9])")
_THOUSANDS_RE = re.compile(r"(\d)(,)(\d\d\d)($|\D)")


def _near_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _drop_thousands(s: str) -> str:
    while True:
        t = _THOUSANDS_RE.sub(r"\1\3\4", s)
        if t == s:
            return t
        s = t


def _is_int_text(s: str) -> bool:
    x = _float(_drop_thousands(s))
    return x is not None and _near_int(x)


def plain(answer: str) -> str | None:
    """The metric's second normalisation of ``answer``, or None where it would hand LaTeX to its reader."""
    s = answer
    m = _TEXT_WHOLE_RE.search(s)
    if m is not None:
        s = m.group("text")
    s = s.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    s = s.replace(" or ", " , ").replace(" and ", " , ")
    s = s.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_RES:
        s = unit.sub("", s)
    s = _DEGREE_RE.sub("", s)
    if s and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    s = _COMMA_SPACE_RE.sub("", s)
    x = _float(s)
    if x is not None and _near_int(x):
        s = str(int(round(x)))
    if "\\" in s:
        return None
    s = _MIXED_RE.sub(r"\1+\2", _MINUS_RE.sub("-", s))
    s = s.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_int_text(s):
        s = str(int(float(s.replace(",", ""))))
    return s


# ---- test 3: element by element -------------------------------------------------------------------------

_BRACKETS = "()[]"
_FRAC_TEXT_RE = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
# Literals whose value sympy reads exactly as Python's Decimal does (no exponent, no leading zero, ASCII).
_SAFE_LITERAL_RE = re.compile(r"[+-]?(?:0|[1-9][0-9]*)(?:\.[0-9]*)?")


def _elements(s: str) -> list[str]:
    s = _drop_thousands(s)
    if not s:
        return []
    if len(s) > 2 and s[0] in _BRACKETS and s[-1] in _BRACKETS and not any(c in s[1:-1] for c in _BRACKETS):
        return [e.strip() for e in s[1:-1].split(",")]
    return [s]


def _element_equal(g: str, a: str) -> bool:
    if _FRAC_TEXT_RE.search(g) and _FRAC_TEXT_RE.search(a):
        return g == a  # unreduced fractions are not simplified
    g_int, a_int = _is_int_text(g), _is_int_text(a)
    if g_int != a_int:
        return False  # an integer gold needs an integer answer, and the reverse
    if not (g_int and _SAFE_LITERAL_RE.fullmatch(g) and _SAFE_LITERAL_RE.fullmatch(a)):
        return False  # the metric would ask sympy; this profile does not (stricter)
    try:
        return Decimal(g) == Decimal(a)
    except InvalidOperation:
        return False


def _elementwise(g: str, a: str) -> bool:
    ge, ae = _elements(g), _elements(a)
    if len(ge) > 1 and (g[0] != a[0] or g[-1] != a[-1]):
        return False  # (1, 2) is not [1, 2]
    if len(ge) != len(ae):
        return False
    return all(_element_equal(x, y) for x, y in zip(ge, ae))


def equal(answer: str, gold: str) -> tuple[bool, str]:
    """Whether the metric accepts the box content ``answer`` for ``gold``, and which test decided
    (``hendrycks``, ``plain``, ``element``; ``refused`` when none accepts)."""
    if hendrycks(answer) == hendrycks(gold):
        return True, "hendrycks"
    g, a = plain(gold), plain(answer)
    if g is None or a is None:
        return False, "refused"
    if g == a:
        return True, "plain"
    if a and _elementwise(g, a):
        return True, "element"
    return False, "refused"


def grade_formal(pred: str, gold: str, truncated: bool = False) -> tuple[bool, str | None, str]:
    """(correct, extracted, path) of completion ``pred`` for ``gold`` under the ``formal`` profile.

    ``path`` is ``no_answer`` (no box, an unclosed or malformed last box, or a truncated completion whose
    last box is not final), else ``formal`` for either verdict.
    """
    if not gold:
        return False, None, "error"
    if BOX in gold:  # the metric unwraps a boxed gold the same way
        gold, _ = last_box(gold)
        if gold is None:
            return False, None, "error"
    answer, end = last_box(pred)
    if answer is None or (truncated and not _is_final(pred, end)):
        return False, None, "no_answer"
    ok, _how = equal(answer, gold)
    return ok, answer, "formal"
