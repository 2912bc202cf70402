"""Text normalisation shared by extraction and comparison: box/brace matching, wrappers, units."""

from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


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

