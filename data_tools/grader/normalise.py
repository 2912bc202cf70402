"""Text normalisation shared by extraction and comparison: box/brace matching, wrappers, units."""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")

# Invisible characters (zero-width space/joiners, word joiner, BOM, soft hyphen): they split a number
# or a marker without showing (inspect_ai #4283).
_INVISIBLE_RE = re.compile("[\u00ad\u200b-\u200f\u2060-\u2064\ufeff]")
_SUPERSCRIPTS = str.maketrans("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b", "0123456789+-")
_SUPER_RUN_RE = re.compile("[\u2070\u00b9\u00b2\u00b3\u2074-\u207b]+")
_SYMBOLS = {"\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u22c5": "\\cdot ", "\u00b7": "\\cdot ", "\u00f7": "\\div ",
            "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ", "\u2260": "\\ne ", "\u00b1": "\\pm ", "\u2044": "/"}
_SYMBOL_RE = re.compile("|".join(_SYMBOLS))


def clean_unicode(text: str) -> str:
    """Unicode look-alikes to ASCII / LaTeX, invisible characters removed.

    Superscript digits become ``^{...}`` *before* NFKC folding (which would turn ``10\u2078`` into ``108``);
    NFKC then folds full-width forms (``\uff11\uff12`` -> ``12``, ``\uff0d`` -> ``-``) and the no-break space;
    minus/dash, times, cdot, pi, infinity, relation signs map to their LaTeX. Linear in ``len(text)``.
    """
    if text.isascii():
        return text
    text = _INVISIBLE_RE.sub("", text)
    text = _SUPER_RUN_RE.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPTS) + "}", text)
    text = unicodedata.normalize("NFKC", text)
    return _SYMBOL_RE.sub(lambda m: _SYMBOLS[m.group(0)], text)


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
# A unit command ending the answer; the spacing before it is stripped by _strip_spacing_tail (a
# regex that starts with optional spacing would rescan a long run of spaces from every position).
_UNIT_TAIL_RE = re.compile(r"\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?\s*$")


def _strip_spacing_tail(s: str) -> str:
    """s without the spaces, ``~`` and LaTeX spacing commands (``\\ ``, ``\\,`` ...) that end it."""
    i = len(s)
    while i > 0:
        c = s[i - 1]
        if c == " " and i >= 2 and s[i - 2] == "\\":
            i -= 2
        elif c.isspace() or c == "~":
            i -= 1
        elif c in ",;:!" and i >= 2 and s[i - 2] == "\\":
            i -= 2
        else:
            break
    return s[:i]


_DEG_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")


@lru_cache(maxsize=1 << 16)
def _strip_outer(s: str) -> str:
    """Remove surrounding $...$, \\(...\\), \\[...\\], \\boxed{...} and a trailing period.

    Works on indices into ``s`` with the braces matched once, so 20,000 nested boxes stay linear.
    """
    lo, hi = 0, len(s)
    pairs: dict[int, int] | None = None
    changed = True
    while changed and lo < hi:
        changed = False
        while lo < hi and s[lo].isspace():
            lo += 1
        while hi > lo and s[hi - 1].isspace():
            hi -= 1
        for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if hi - lo > len(a) + len(b) - 1 and s.startswith(a, lo, hi) and s.endswith(b, lo, hi):
                lo, hi, changed = lo + len(a), hi - len(b), True
        m = _BOX_RE.match(s, lo, hi)
        if m:
            if pairs is None:
                pairs = _brace_pairs(s)
            if pairs.get(m.end() - 1) == hi - 1:
                lo, hi, changed = m.end(), hi - 1, True
        if hi > lo and s[hi - 1] == "." and not (hi - lo >= 2 and s[hi - 2].isdigit()):
            hi, changed = hi - 1, True
    return s[lo:hi].strip()


def _brace_pairs(s: str) -> dict[int, int]:
    """Index of each '{' -> index of its '}' (unmatched ones left out)."""
    stack, out = [], {}
    for i, c in enumerate(s):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            out[stack.pop()] = i
    return out


@lru_cache(maxsize=1 << 16)
def _norm_str(s: str) -> str:
    """Light, meaning-preserving normalisation for the exact-match path.

    A subset of Hendrycks' ``strip_string`` (MATH, 2021) that cannot merge different answers:
    spacing commands, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, ``\\text{}`` wrappers,
    degree signs, a trailing unit, ``\\%``. (strip_string's ``k=`` prefix removal is left to
    math-verify: it is what makes verl accept ``11a+c`` for ``7 = 11a+c``.)
    """
    s = _strip_outer(s).replace("\u2212", "-")
    s = _SIZING_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("{,}", ",")
    # A trailing unit is dropped only after a number ("12\text{ ft}"), so a text answer
    # ("\text{Evelyn}") is not erased to the empty string.
    m = _UNIT_TAIL_RE.search(s) if "\\" in s else None
    if m:
        t = _strip_spacing_tail(s[: m.start()])
        if re.search(r"[0-9}]$", t):
            s = t
    for _ in range(3):
        s = _TEXT_WRAP_RE.sub(r"\1", s)
    s = _DEG_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _ORDINAL_RE.sub("", s)
    s = _CURRENCY_RE.sub("", s)
    # A comma followed by a space separates items ("1, 000" is 1 and 000, not 1000): mark it so
    # that no later step reads it as a thousands separator ("+000" still reads as the item 0).
    if "," in s:
        s = _COMMA_GAP_RE.sub(",+", s)
    # A gap between digits joins a thousands group ("1 000", "1\\,000") and separates items
    # otherwise ("7\\ 9\\ 12": a list, not 7912).
    s = _DIGIT_GAP_RE.sub(lambda m: "" if m.group(1) else ",", s)
    s = _SPACING_RE.sub("", s)
    s = _WS_RE.sub("", s)
    return s.rstrip(".")


_SIZING_RE = re.compile(r"\\left\b|\\right\b|\\displaystyle")
_SPACING_RE = re.compile(r"\\[ ,;:!]|~")
_WS_RE = re.compile(r"\s+")


_ORDINAL_RE = re.compile(r"(?<=\d)(?:\^\{?(?:\\(?:text|mathrm)\{)?(?:st|nd|rd|th)\}?\}?|(?:st|nd|rd|th)\b)")
_CURRENCY_RE = re.compile(r"[\u20ac\u00a3\u00a5]|(?<=\d)\s*[a-zA-Z]{1,2}\^\{?[23]\}?$")
_COMMA_GAP_RE = re.compile(r"(?<=\d),(?:\\[ ,;:]|~|\s)+(?=\d{3}(?!\d))")
_DIGIT_GAP_RE = re.compile(r"(?<=\d)(?:\\[ ,;:!]|~|\s)+(?=\d)(?=(\d{3}(?![\d.]))?)")



# --------------------------------------------------------------------------------------------
# TeX glue: TeX that math-verify (and the exact path) misreads, rewritten to what it means
# --------------------------------------------------------------------------------------------

# A thousands separator inside a number: MATH writes "5,\!525" and "5{,}525" (also inside \frac).
_TEX_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,\\!|\{,\})(?=\d{3}(?!\d))")
# "\approx 8.24": an approximate value is stated as that value.
_APPROX_LEAD_RE = re.compile(r"(?:\\approx|\\thickapprox|\\simeq|\\sim|\\doteq|\u2248)(?![A-Za-z])\s*")
_PHANTOM_RE = re.compile(r"\\[hv]?phantom(?![A-Za-z])")
_FRAC_CMD_RE = re.compile(r"\\[dtc]?frac(?![A-Za-z])")
# Commands that take arguments: one of them as a brace-less \frac argument is left as written.
_ARG_COMMANDS = frozenset("\\" + c for c in "sqrt frac dfrac tfrac cfrac binom dbinom text mathrm mathbf textbf operatorname "
                          "overline bar hat vec left right".split())
_CONTROL_WORD_RE = re.compile(r"\\(?:[A-Za-z]+|.)", re.S)


def _tex_arg(s: str, i: int, pairs: dict[int, int]) -> tuple[int, int] | None:
    """(start, end) of the TeX argument at ``s[i:]`` after spaces: a ``{...}`` group, a control word
    (``\\pi``) or one character; None at the end of ``s`` or before an unmatched brace."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i >= len(s) or s[i] == "}":
        return None
    if s[i] == "{":
        j = pairs.get(i)
        return None if j is None else (i, j + 1)
    m = _CONTROL_WORD_RE.match(s, i)
    return (i, m.end()) if m else (i, i + 1)


def _drop_phantoms(s: str) -> str:
    """``\\phantom`` (and ``\\hphantom``, ``\\vphantom``) with its argument dropped: it typesets nothing
    (the matrix entry ``\\phantom -1`` is 1)."""
    pairs = _brace_pairs(s)
    out, pos = [], 0
    for m in _PHANTOM_RE.finditer(s):
        if m.start() < pos:
            continue  # inside a phantom's argument, dropped already
        a = _tex_arg(s, m.end(), pairs)
        out.append(s[pos : m.start()])
        pos = a[1] if a else m.end()
    out.append(s[pos:])
    return "".join(out)


def _brace_frac_args(s: str) -> str:
    """``\\frac`` arguments written without braces take one token each, as in TeX: ``\\frac \\pi4`` is
    ``\\frac{\\pi}{4}``, ``\\frac\\pi 2`` is ``\\frac{\\pi}{2}`` (math-verify reads ``\\frac{\\}{p}i4``)."""
    pairs = _brace_pairs(s)
    cuts: list[tuple[int, int, int]] = []  # (from, arg start, arg end) of each brace-less argument: one token
    for m in _FRAC_CMD_RE.finditer(s):
        a = _tex_arg(s, m.end(), pairs)
        b = _tex_arg(s, a[1], pairs) if a else None
        if b is None or (s[a[0]] == "{" and s[b[0]] == "{") or s[a[0]:a[1]] in _ARG_COMMANDS or s[b[0]:b[1]] in _ARG_COMMANDS:
            continue  # braced already, or an argument that takes arguments itself ("\\frac\\sqrt{3}2"): as written
        # the spaces before an argument go too: "\\frac \\pi 4" is "\\frac{\\pi}{4}"
        cuts.append((m.end(), *a))
        cuts.append((a[1], *b))
    out, pos = [], 0
    for lo, x, y in sorted(cuts):
        if lo < pos:
            continue  # overlaps a rewritten one (only in malformed TeX such as "\\frac\\frac12")
        out.append(s[pos:lo] + s[x:y] if s[x] == "{" else s[pos:lo] + "{" + s[x:y] + "}")
        pos = y
    out.append(s[pos:])
    return "".join(out)


@lru_cache(maxsize=1 << 16)
def fix_tex(s: str) -> str:
    """TeX that reference answers and models write, rewritten to what it means, for both the exact path
    and math-verify (each rewrite keeps the value): whitespace runs (a newline inside ``\\text{}``) as one
    space; a thousands separator ``,\\!`` / ``{,}`` inside a number dropped (``\\frac{12}{5,\\!525}``); a
    leading ``\\approx`` / ``\\sim`` dropped; brace-less ``\\frac`` arguments braced; ``\\phantom``
    dropped with its argument. Linear in ``len(s)``."""
    if not s:
        return s
    s = _WS_RE.sub(" ", s).strip()
    if "," in s:
        s = _TEX_THOUSANDS_RE.sub("", s)
    m = _APPROX_LEAD_RE.match(s)
    if m and m.end() < len(s):
        s = s[m.end() :]
    if "phantom" in s:
        s = _drop_phantoms(s)
    if "frac" in s:
        s = _brace_frac_args(s)
    return s
