"""Math answer grader: a cheap certain fast path, math-verify in a sandboxed worker, a fallback.

Pipeline for one (prediction, gold) pair, each step only running when the one before could not
decide with certainty:

1. **Extraction** (``extraction``; regex + brace matching over the last ``SCAN_CHARS`` = 2 MB of the
   output, after ``normalise.clean_unicode`` folds look-alikes: full-width forms, invisible characters,
   superscript digits, Unicode minus/times/pi): the last explicit answer wins. That is the last
   ``\\boxed{}`` group (adjacent boxes ``\\boxed{3}, \\boxed{5}`` are one set answer, as in math-verify
   >= 0.8, also when joined by spacing and one "and" / "or": ``\\boxed{(2, 2)} \\quad \\text{and} \\quad
   \\boxed{(6, 2)}``; one box repeated in a loop is one answer), unless a "final answer" / "answer is" /
   "Answer:" marker *after* it states something (a digit, math, an option letter), which then
   restates or corrects it. Without box or marker, a finished, non-truncated output that is *only an
   answer* -- math, no prose (``41 * 74``, ``1 1/4``, ``3 \\times 10^8``, ``25%``, ``"42"``, ``pi/2``,
   ``(1, 2)``, a matrix; ``extraction.bare_answer``) -- is read whole, as math-verify parses it
   (``16 - 3 - 4 = 9`` reads as ``9``). Otherwise -- only for a *short, finished, non-truncated*
   output (a number ending it does not count towards the length) -- the final math span / final bare
   number (currency sign, ordinal allowed; not the last operand of ``41 * 74`` nor the last item of
   ``1, 000``) / the expression after the last "is" or "=" / last ``= N``. Long outputs without a marker get no answer:
   the rightmost number of a trace is not an answer (survey: prime_math and plain math-verify
   accept truncated traces this way). Chat-template tokens and Minerva's "I hope it is correct."
   are dropped, and so is everything up to the last ``</think>`` (an output whose ``<think>`` never
   closes has no answer). When the gold is an option letter, the last letter stated explicitly
   (``\\boxed{C}``, "Answer: **D**", "the answer is (B)", "I would pick B") is the answer.
   **Truncation** (``truncated=True``, a completion that hit the length cap): an answer counts only
   if it is final -- nothing but closing punctuation follows it. A box or marker with more text
   after it (a retraction may follow) gives no answer (design: "truncated completions earn nothing").
2. **Fast path** (no sympy): first ``normalise.fix_tex``'s glue on both sides, for TeX that math-verify
   misreads (brace-less ``\\frac \\pi4``, ``\\phantom``, ``5,\\!525`` inside a fraction, a leading
   ``\\approx``, a newline inside ``\\text{}``; a reference answer also loses the sentence's ``.`` or ``,``
   that MATH boxes with it); then exact match after light normalisation (``normalise``: Hendrycks
   ``strip_string`` style ``\\left``, ``\\dfrac``, ``\\text{}``, degrees, percent, units, ordinals;
   a gap between digits joins only a 3-digit thousands group, else it separates items; a comma
   followed by a space always separates items: ``1, 000`` is two numbers, not 1000), then
   ``_prepare``'s exact rewrites: quotes and unit words dropped (a spelled-out percent, ``28 percent``,
   ``28\\text{ percent}``, ``\\text{28 percent}``, is ``28\\%``), clock times compared as times
   (``5:00`` = ``05\\!:\\!00``), mixed numbers (``4 4/9``,
   ``3\\frac12``) as improper fractions, redundant outer brackets peeled (``simplify.peel``).
   Plain numbers (``numeric``: int, decimal, ``\\frac{a}{b}``, ``a/b``, ``1,000``, e-notation,
   ``a \\times 10^{b}``, repeating decimals ``0.\\overline{3}`` / ``0.9666...``) compare exactly as
   rationals (up to ``numeric.MAX_NUMBER_CHARS`` = 30,000 characters and ``10^{20000}``: huge answers
   compare exactly); a decimal answer counts as an exact gold when correctly rounded to >= 6 significant
   digits, and as a rounded decimal gold (>= 2 significant digits) when it has >= 6 significant
   digits and rounds to it. Numeric tuples, intervals and matrices compare element by element with
   that scalar rule; several numbers never equal one. Under ``"math"`` an answer's percent sign is
   also its value (``10\\%`` is right for 0.1 and for 10); a gold's percent sign makes percent the
   answer's unit (28 and ``28\\%`` are right for ``28\\%``, 0.28 is not). Integer power towers compare
   by their evaluated exponents (``simplify.power_tower``).
   It returns a verdict only when it is certain; everything else goes to step 3.
3. **math-verify** (``parse`` + ``verify``, LaTeX extraction only, so no model text ever
   reaches sympy's ``parse_expr``/``eval``) in a persistent worker subprocess with a per-call
   deadline; a worker that overruns is killed and replaced, and it runs under an address-space
   limit. math-verify's own ``signal.alarm`` timeouts are switched off (they raise outside the
   main thread, math-verify #50/#55). Guards on its True verdicts: relative tolerance for
   tiny/huge magnitudes (math-verify rounds to 6 decimal places, so ``1/2^99 == 1/2^98``, math-verify #14)
   and exact set sizes for "find all" answers (math-verify accepts a proper subset of the gold set). A gold with
   ``i`` is complex: ``i`` is the imaginary unit on both sides, and decimal parts are compared to 6 places
   (math-verify #69). An answer that fails the pre-screen (power towers, huge exponents or factorials, deep nesting) is first
   cancelled term by term (``simplify.cancel``: ``(x+1)^{100000} - (x+1)^{100000} + 5`` is ``5``).
   A root index without braces takes one token, as in TeX (``\\sqrt[3]2`` is ``\\sqrt[3]{2}``).
   A side that math-verify reads as nothing because its unit stripping took a letter for a unit
   (``a + b + c`` -> ``a +``, ``\\sin^2 t`` -> ``\\sin^2``) is read again with that step off.
   **math-verify is optional**: without it (or its latex2sympy2_extended) the same workers read both
   sides with the grader's own LaTeX reader (``latex``: built node by node, no eval) and compare them
   with sympy; verdicts then carry the path ``"sympy"``, and the process logs one warning saying so.
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

Grader profiles (``profile``):

- ``"default"``: the pipeline above, with its answer filter.
- ``"formal"``: the formal metric's rule grader (JustRL's ``grade_answer_verl``) and nothing more lenient
  (``formal``): only the last ``\\boxed{}`` of the whole completion is read ("Answer: 42" and "the answer
  is 42" are not answers), and an integer gold needs the integer itself (``\\frac{84}{2}``, ``41+1``,
  ``10^3`` are wrong for 42 / 1000). ``answer_filter`` does not apply. Verdicts carry the path
  ``"formal"`` (or ``"no_answer"``).

CLI: ``python -m data_tools.grader [--profile formal] FILE.jsonl`` (``-`` for stdin); see ``main``.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from .extraction import _clean, _extract, _is_final, extract_gsm8k_answer
from .formal import grade_formal
from .normalise import _TEXT_WRAP_RE, _norm_str, _strip_outer, _strip_spacing_tail, fix_tex
from .numeric import _as_number, _numbers_equal, as_number_tuple, numeric_literal, percent_of, rewrite_mixed
from .sandbox import MAX_ANSWER_CHARS, _math_verify, _to_latex, _too_risky
from .simplify import cancel, peel, power_tower


__all__ = [
    "Verdict",
    "grade",
    "grade_batch",
    "parse_gold",
    "extract_gsm8k_answer",
    "set_verifier",
    "ANSWER_FILTERS",
    "PROFILES",
]

#: Answer filters ``grade`` / ``grade_batch`` accept (module docstring).
ANSWER_FILTERS = ("math", "numeric")
#: Grader profiles ``grade`` / ``grade_batch`` accept (module docstring): ``formal`` grades as the formal metric.
PROFILES = ("default", "formal")


@dataclass(frozen=True)
class Verdict:
    correct: bool
    extracted: str | None  # the answer string taken from the prediction (None if none found)
    # "exact", "numeric", "math_verify" ("sympy" without math-verify), "fallback", "no_answer", "timeout",
    # "error", "not_a_number"; "formal" under the formal profile
    path: str


_BASE_RE = re.compile(r"([0-9][0-9A-Z]*)_\{?([0-9]+)\}?")
_PERCENT_RE = re.compile(r"%\s*\}?\s*$")
_MC_RE = re.compile(r"\(?([A-E])\)?(?:$|[\s.:,]|\\)")


# A clock time: "05:00", "5:00 p.m." (normalised: spaces gone). math-verify reads 05:00 as 05/00.
_CLOCK_RE = re.compile(r"(?i)(\d{1,2}):([0-5]\d)(?:([ap])\.?m)?\.?")


def _clock(norm: str) -> tuple[int, int, str | None] | None:
    m = _CLOCK_RE.fullmatch(norm)
    return (int(m.group(1)), int(m.group(2)), (m.group(3) or "").lower() or None) if m else None


def _mc_letter(norm_gold_raw: str) -> str | None:
    m = re.fullmatch(r"\(?([A-E])\)?", norm_gold_raw)
    return m.group(1) if m else None


def _fast_path(answer: str, gold: str, answer_filter: str = "math") -> Verdict | None:
    """A certain verdict without sympy, or None to defer to math-verify."""
    na, ng = _norm_str(answer), _norm_str(gold)
    if na and na == ng:
        return Verdict(True, answer, "exact")
    ba, bg = _BASE_RE.fullmatch(na), _BASE_RE.fullmatch(ng)
    if bg and ba:  # numerals in a base: 204_5 is not 204_6 (math-verify drops the subscript)
        return Verdict(ba.group(1) == bg.group(1) and ba.group(2) == bg.group(2), answer, "exact")
    if bg and re.fullmatch(r"[0-9][0-9A-Z]*", na):  # the base left off, as the question names it (lm-eval #3785)
        return Verdict(na == bg.group(1), answer, "exact")
    cg = _clock(ng)
    if cg is not None:
        ca = _clock(na)
        if ca is not None:  # 5:00 is 05:00; p.m. against a.m. only where both say which
            return Verdict(ca[:2] == cg[:2] and (ca[2] == cg[2] or None in (ca[2], cg[2])), answer, "exact")
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
        if _numbers_equal(a, g):
            return Verdict(True, answer, "numeric")
        # Under "math" an answer's percent sign is also its value: 10\% is 0.1 (a gold's percent sign
        # makes percent the answer's unit instead, so 0.28 stays wrong for 28\%).
        pct = answer_filter == "math" and "%" in answer and _PERCENT_RE.search(answer) and not _PERCENT_RE.search(gold)
        return Verdict(bool(pct) and _numbers_equal(percent_of(a), g), answer, "numeric")
    ta, tg = as_number_tuple(na), as_number_tuple(ng)
    if (ta is not None and g is not None and len(ta[1]) > 1) or (tg is not None and a is not None and len(tg[1]) > 1):
        return Verdict(False, answer, "numeric")  # several numbers against one ("1, 000" is not 1000)
    if ta is not None and tg is not None and ta[0] == tg[0] and len(ta[1]) == len(tg[1]):
        # Numeric tuples / intervals / matrices: element by element, with the scalar tolerance.
        same = all(_numbers_equal(x, y) for x, y in zip(ta[1], tg[1]))
        if same or "matrix" in ta[0] or (na[0] in "([" and ng[0] in "(["):
            return Verdict(same, answer, "numeric")
    return None


# The last explicit option letter: "\boxed{C}", "Answer: **D**", "the answer is (B)", "I would pick B".
_MC_ANSWER_RE = re.compile(
    r"\\boxed\s*\{\s*(?:\\text(?:bf)?\s*\{)?\s*\(?([A-J])\)?\s*\}?\s*\}"
    r"|(?i:answer)\s*(?i:is|:|=)?\s*(?i:option|choice)?[\s*_:]*\(?([A-J])\)?(?![A-Za-z0-9])"
    r"|(?i:i would|i'd|i will|i)\s+(?i:pick|choose|select|go with)\s+(?i:option\s+)?\(?([A-J])\)?(?![A-Za-z0-9])"
)


def _mc_answer(pred: str, truncated: bool) -> str | None:
    """The last option letter the output states explicitly (gold is a letter), or None."""
    text = _clean(pred)
    last = None
    for m in _MC_ANSWER_RE.finditer(text):
        last = m
    if last is None or (truncated and not _is_final(text, last.end())):
        return None
    return next(g for g in last.groups() if g)


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


def _gold_raw(gold: str) -> str:
    """The reference answer as written, without its wrappers (``$``, ``\\boxed{}``, GSM8K's ``####``)."""
    g = gold.strip()
    if "####" in g:
        g = extract_gsm8k_answer(g) or ""
    return _strip_outer(g)


def _gold_text(gold: str) -> str:
    """The reference answer as graded: ``_gold_raw``, the sentence's punctuation that MATH boxes with the answer
    dropped (``43_5.``, ``\\text{(E)},``), then ``fix_tex``."""
    g = _gold_raw(gold)
    if g[-1:] in (".", ",") and g[-2:-1] not in (".", "\\"):
        g = _strip_outer(g[:-1])
    return fix_tex(g)


def grade(pred: str, gold: str, *, truncated: bool = False, timeout_s: float = 5.0,
          answer_filter: str = "math", profile: str = "default") -> Verdict:
    """Grade one model output against a reference answer.

    Args:
        pred: the full model output (any length; only the last ``SCAN_CHARS`` characters are read).
        gold: the reference answer (LaTeX or plain; GSM8K ``#### N`` accepted).
        truncated: True when the completion hit the generation cap (finish_reason == "length").
            Then an answer counts only if it is final: a box, marker or option letter followed by
            nothing but closing punctuation. An earlier box with more text after it (it may have been
            retracted) and a trailing number without a marker give ``Verdict(False, None,
            "no_answer")``. The trainer passes this per completion (``grade_batch(truncated=...)``).
        timeout_s: wall-clock bound in seconds for the sympy (math-verify) step; on overrun the
            worker is killed and the verdict is ``Verdict(False, answer, "timeout")``. The first
            call in a process also waits for a worker to start (imports, ~1-3 s, capped at
            ``WORKER_START_TIMEOUT_S``).
        answer_filter: ``"math"`` (equal as mathematics) or ``"numeric"`` (a plain-number gold
            needs a plain-number answer); see the module docstring.
        profile: ``"default"`` (the pipeline above) or ``"formal"`` (the formal metric's rule, ``formal``;
            ``answer_filter`` and ``timeout_s`` do not apply: it runs no sympy).

    Returns:
        A ``Verdict``; ``path`` says which step decided. Never raises on any string input
        (internal failures give ``path="error"``); raises ``TypeError`` if pred/gold are not str,
        ``ValueError`` for an unknown ``answer_filter`` or ``profile``.
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        raise TypeError("grade(pred, gold): both must be str")
    _check(answer_filter, profile)
    if profile == "formal":
        try:
            return Verdict(*grade_formal(pred, gold, truncated))
        except Exception:  # noqa: BLE001 - as every other path: a verdict, never an exception
            return Verdict(False, None, "error")
    try:
        g = _gold_text(gold)
        letter = _mc_letter(_norm_str(g)) if g else None
        answer = _mc_answer(pred, truncated) if letter else None
        if answer is not None:
            return Verdict(answer == letter, answer, "exact")
        answer, _how = _extract(pred, truncated)
    except Exception:  # noqa: BLE001
        return Verdict(False, None, "error")
    if answer is None or not answer.strip():
        return Verdict(False, None, "no_answer")
    if not g:
        return Verdict(False, answer, "error")
    try:
        v = _decide(_prepare(answer), _prepare(g), timeout_s, answer_filter)
    except Exception:  # noqa: BLE001
        return Verdict(False, answer, "error")
    return Verdict(v.correct, answer, v.path)


@lru_cache(maxsize=1 << 16)
def _prepare(s: str) -> str:
    """Exact rewrites before comparing: wrappers and quotes stripped, plain unit words dropped, mixed
    numbers as improper fractions, redundant outer brackets peeled."""
    s = fix_tex(_strip_outer(s))
    if len(s) >= 2 and s[0] == s[-1] == "'":
        s = s[1:-1]
    s = _strip_outer(s.strip("\"\u201c\u201d"))
    m = _TEXT_NUMBER_RE.fullmatch(s)
    if m:
        s = m.group(1).strip()  # "\text{28 percent}": a number with its words, read as the words after a number
    m = _PERCENT_TEXT_RE.search(s) if "\\" in s else None
    if m and re.search(r"[\d}]$", _strip_spacing_tail(s[: m.start()])):
        s = _strip_spacing_tail(s[: m.start()]) + "\\%"  # "28\text{ percent}" is 28\%, as "28 percent" is
    m = _UNIT_WORDS_TAIL_RE.fullmatch(s)
    if m and not _MATH_WORD_RE.match(m.group(2)):
        # "25 percent" keeps its percent sign (it decides how 25 compares with 0.25); other units go
        s = m.group(1) + ("\\%" if _PERCENT_WORD_RE.fullmatch(m.group(2)) else "")
    if "**" in s:
        s = _POW_RE.sub("^", s)  # 10**8 is 10^8
    return rewrite_mixed(peel(s))


# A whole answer in \text{} that starts with a number: "\text{28 percent}", "\text{12 apples}".
_TEXT_NUMBER_RE = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{\s*([-+]?[0-9][0-9.,]*(?:\s*[A-Za-z][A-Za-z .]*)?)\}")
# A spelled-out percent in a text command ending the answer: "28\text{ percent}", "28\,\mbox{per cent}".
_PERCENT_TEXT_RE = re.compile(r"(?i)\\(?:text|textrm|mathrm|mbox)\s*\{\s*(?:percent(?:age)?|per cent|pct)\.?\s*\}\.?\s*$")
# "5*10^6 watts", "12 apples": plain unit words after a number.
_UNIT_WORDS_TAIL_RE = re.compile(r"(.*[\d}])\s+([A-Za-z]{2,}(?:[ /][A-Za-z]+)*)\.?")
_PERCENT_WORD_RE = re.compile(r"(?i)percent(?:age)?|per cent|pct")
_POW_RE = re.compile(r"(?<=[\w)}])\s*\*\*\s*(?=[\w({-])")
# ... but "4 sin x" and "3 mod 7" are math, not units.
_MATH_WORD_RE = re.compile(r"(?i)(?:a?(?:sin|cos|tan|cot|sec|csc)h?|log|ln|exp|sqrt|mod|pi|deg|and|or)\b")


def _decide(answer: str, g: str, timeout_s: float, answer_filter: str) -> Verdict:
    """The verdict for a prepared answer against a prepared gold (``grade`` without extraction)."""
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
        fast = _fast_path(answer, g, answer_filter)
    except Exception:  # noqa: BLE001
        fast = None
    if fast is not None:
        return fast

    ta, tg = power_tower(_norm_str(answer)), power_tower(_norm_str(g))
    if ta is not None and tg is not None:
        return Verdict(ta == tg, answer, "numeric")
    if _too_risky(_to_latex(answer)):
        # Trivial once cancelled, explosive if expanded: cancel identical terms, then decide again.
        short = cancel(_norm_str(answer))
        if short != _norm_str(answer) and not _too_risky(_to_latex(short)):
            return _decide(short, g, timeout_s, answer_filter)
    pred_l, gold_l = _to_latex(answer), _to_latex(g)
    if _too_risky(pred_l) or _too_risky(gold_l):
        return _fallback(answer, g)
    res = _math_verify(f"${gold_l}$", f"${pred_l}$", timeout_s)
    if res is None:
        return Verdict(False, answer, "timeout")
    if "error" in res or res.get("ok") is None:
        return _fallback(answer, g)
    by = res.get("by", "math_verify")
    if res["ok"]:
        return Verdict(True, answer, by)
    if not (res.get("gold_parsed") and res.get("pred_parsed")):
        return _fallback(answer, g)  # math-verify could not read a side: not evidence of "wrong"
    judge = _ask_verifier(answer, g)
    if judge is not None:
        return Verdict(judge, answer, "fallback")
    return Verdict(False, answer, by)


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


def _check(answer_filter: str, profile: str) -> None:
    if answer_filter not in ANSWER_FILTERS:
        raise ValueError(f"answer_filter must be one of {ANSWER_FILTERS}, got {answer_filter!r}")
    if profile not in PROFILES:
        raise ValueError(f"grader profile must be one of {PROFILES}, got {profile!r}")


def grade_batch(
    preds: Sequence[str],
    golds: Sequence[str],
    *,
    truncated: Sequence[bool] | None = None,
    timeout_s: float = 5.0,
    workers: int | None = None,
    answer_filter: str = "math",
    profile: str = "default",
) -> list[Verdict]:
    """Grade many answers; order preserved; each bounded by ``timeout_s`` seconds of sympy.

    ``workers`` threads (default: CPU count, at most 8) each drive their own math-verify
    subprocess, so the sympy step runs in parallel. Safe to call from any thread. Raises
    ``ValueError`` if the sequences differ in length or ``answer_filter`` / ``profile`` is unknown
    (``ANSWER_FILTERS``, ``PROFILES``; see ``grade``).
    """
    _check(answer_filter, profile)
    n = len(preds)
    if len(golds) != n or (truncated is not None and len(truncated) != n):
        raise ValueError("grade_batch: preds, golds (and truncated) must have the same length")
    tr = list(truncated) if truncated is not None else [False] * n
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    kw = dict(timeout_s=timeout_s, answer_filter=answer_filter, profile=profile)
    if workers <= 1 or n <= 1 or profile == "formal":  # formal is string work alone: threads would only add overhead
        return [grade(p, g, truncated=t, **kw) for p, g, t in zip(preds, golds, tr)]
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(lambda a: grade(a[0], a[1], truncated=a[2], **kw), zip(preds, golds, tr)))


#: Reference answers that mark a missing answer; ``parse_gold`` rejects them (lower-cased, a final "." dropped).
PLACEHOLDER_ANSWERS = frozenset({"n/a", "na", "tbd", "todo", "null", "nan", "?", "-", "unknown", "no answer"})


def parse_gold(answer: str) -> str | None:
    """Normalise a reference answer for data loading; None if it is not an answer at all.

    Strips ``$``/``\\boxed{}`` wrappers and GSM8K's ``#### `` (see ``extract_gsm8k_answer``);
    plain numbers come back canonical (``"1,234"`` -> ``"1234"``, ``"004"`` -> ``"4"``).
    Anything else is kept as written if math-verify (in the bounded worker, 5 s) parses it as the
    grader reads it (``_gold_text``: ``fix_tex``'s glue, MATH's boxed punctuation dropped), or if it is
    a short plain string answer (``\\text{Evelyn}``, ``B``), an option letter (``\\text{(E)}``), a
    clock time (``05\\!:\\!00``) or a numeral in a base (``43_5``). Returns None for non-str, empty,
    over-long or unparseable input. Never raises.
    """
    if not isinstance(answer, str):
        return None
    g, raw = _gold_text(answer), _gold_raw(answer)
    if not g:
        return None
    num = _as_number(_norm_str(g))  # a plain number of any length up to numeric.MAX_NUMBER_CHARS
    if num is None and len(g) > MAX_ANSWER_CHARS:
        return None
    if num is not None:
        v = num.value
        if v.denominator == 1:
            if len(g) > 4000:  # str() of an int past 4,300 digits raises: keep the digits as written
                return _norm_str(g).replace(",", "") if re.fullmatch(r"-?[\d,]+", _norm_str(g)) else g
            return str(v.numerator)
        if num.sig_digits is None:
            return raw  # keep \frac{1}{3} as written
        return _norm_str(g)
    plain = _norm_str(g)
    if plain.strip().lower().rstrip(".") in PLACEHOLDER_ANSWERS:
        return None  # a dataset's "no answer here" marker, not a gold answer (math-verify reads N/A as N / A)
    if re.fullmatch(r"[A-Za-z][A-Za-z .'-]{0,60}", plain) or _mc_letter(plain) or _clock(plain) or _BASE_RE.fullmatch(plain):
        return raw  # a name, an option letter "(E)", a clock time "05:00", a numeral in a base "43_5": as written
    gl = _to_latex(g)
    if _too_risky(gl):
        return None
    res = _math_verify(f"${gl}$", f"${gl}$", 5.0)
    if res is None or "error" in res or not res.get("gold_parsed"):
        return None
    return raw


