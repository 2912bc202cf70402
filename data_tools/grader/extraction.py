"""Answer extraction: which part of a model output is its final answer (or that it has none)."""

from __future__ import annotations

import bisect
import re

from .normalise import _BOX_RE, _match_brace, _strip_outer, clean_unicode

# Only the last SCAN_CHARS of an output are read. An answer may sit far from the end (a final answer,
# then hundreds of kilobytes of a repetition loop: Math-Verify's tests), so this is large; every scan
# below is linear, and a 2 MB scan takes tens of milliseconds.
SCAN_CHARS = 2_000_000
# Outputs up to this many characters may be graded without a final-answer marker (a bare final
# number, "... = 18 dollars."); longer ones must mark their answer (box / "answer is"). A number that
# ends the output does not count towards this length, so a 10,000-digit answer is still read.
SHORT_CHARS = 1000
# Longest answer read after a marker or as a whole bare output (a 10,000-digit number fits; the
# grader's arithmetic on it stays exact, see numeric.MAX_NUMBER_CHARS).
MAX_ANSWER_READ = 100_000

# `\boxed 5` (no braces) is legal LaTeX; verl's math_reward special-cases it. Same line only,
# so "Mark your solution with \boxed \nThe sum..." is not read as an answer.
_BOX_SPACE_RE = re.compile(r"\\boxed[ \t]+(-?[0-9][0-9.,/]*)")
# What may sit between two boxes for them to form one answer ("\boxed{3}, \boxed{5} and \boxed{7}",
# "\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}"): commas, spacing, one "and" / "or" (math-verify joins
# boxes the same way).
_BOX_GAP = r"(?:[\s$,;~]|\\[ ,;:!]|\\q?quad(?![A-Za-z]))"
_BOX_JOIN_RE = re.compile(
    rf"^{_BOX_GAP}*(?:(?:and|or|\\(?:text|textrm|mathrm|mbox)\s*\{{\s*(?:and|or)\s*\}}){_BOX_GAP}*)?$")
# "####" is GSM8K's answer marker, which models fine-tuned on GSM8K reproduce.
_MARKER_RE = re.compile(r"(?i)(?:final\s+answer|\banswer)\b(?:\s*\*\*)?\s*(?:is|:|=)?|####")
_LEAD_WS_RE = re.compile(r"\s{0,400}")
_CUED_RE = re.compile(r"(?i)final|\bis\b|[:=]|####")
_IS_RE = re.compile(r"(?i)\b(?:is|are|equals|be)\b:?")
_NUM_TOKEN = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\\ldots)?|-?\.\d+"
# A bare final number may carry a currency sign or an ordinal suffix ("1,000.99\u20ac", "3rd").
_FINAL_NUM_RE = re.compile(rf"(?:^|[\s=:(*])({_NUM_TOKEN})(?:st|nd|rd|th)?\s*[\u20ac\u00a3\u00a5]?\s*(?:\*\*)?\s*[.!]?\s*$")
# "Therefore $x \geq 5$ is the solution."
_SPAN_IS_ANSWER_RE = re.compile(r"\$(?P<a>[^$\n]+)\$\s+is\s+(?:the|our)\s+(?:answer|solution)\W*$", re.I)
# What may follow an answer in a completion that hit the length cap for it still to count as final.
_FINAL_TAIL_RE = re.compile(r"[\s.,;:!$)\]}*]*(?:\\\]|\\\)|</answer>)?[\s.$]*")
# Chat-template tokens a model echoes after its answer ("... is 2/3. <|im_start|>user").
_CHAT_TOKEN_RE = re.compile(r"<\|[^|<>\n]{1,40}\|>\w*")
# Minerva's answer template ends "I hope it is correct.": not part of the answer (and its "is" is no marker).
_HOPE_RE = re.compile(r"(?i)I hope it is correct\.?")
# "0.9666..." keeps its dots as one token, so sentence clipping does not cut the number.
_ELLIPSIS_RE = re.compile(r"(?<=\d)(?:\.\.\.|\u2026|\\ldots|\\dots|\\cdots)")
_LAST_EQ_NUM_RE = re.compile(rf"=\s*({_NUM_TOKEN})(?![\d.])")
_FINAL_SPAN_RE = re.compile(
    r"(?:\$\$(?P<a>[^$]+?)\$\$|\$(?P<b>[^$\n]+?)\$|\\\[(?P<c>.+?)\\\]|\\\((?P<d>.+?)\\\))"
    r"\s*[.!]?\s*$",
    re.DOTALL,
)
# A plain-text expression ending the last line after "is"/"=" ("the value is -1 + exp(16)").
_FINAL_EXPR_RE = re.compile(r"\s*([-+*/^().,\w\s\\{}]{1,80}?)\s*[.!]?\s*$")
_CUE_RE = re.compile(r"\bis\b|=")


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
    # Brace boxes are disjoint and in order: bisect for the one a `\boxed 5` might sit inside.
    starts = [b[0] for b in out]
    ends = [b[1] if b[1] >= 0 else len(text) for b in out]
    spaced = []
    for m in _BOX_SPACE_RE.finditer(text):
        k = bisect.bisect_right(starts, m.start()) - 1
        if k < 0 or m.start() >= ends[k]:
            spaced.append((m.start(), m.end(), m.group(1)))
    return sorted(out + spaced) if spaced else out


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


def _clean(pred: str) -> str:
    """The part of an output that is read, with look-alikes folded and chat-template debris removed.

    A reasoning model's answer follows its reasoning: only the text after the last ``</think>`` is
    read, and an output whose ``<think>`` never closes has no answer (TRL's reasoning_accuracy_reward).
    """
    close = pred.rfind("</think>")
    if close >= 0:
        pred = pred[close + len("</think>") :]
    elif "<think>" in pred:
        return ""
    text = clean_unicode(pred[-SCAN_CHARS:])
    # Each rewrite runs only when a substring it needs is present (a plain `in` is cheaper than a scan).
    if "<|" in text:
        text = _CHAT_TOKEN_RE.sub("\n", text)
    if "hope" in text.lower():
        text = _drop_hope(text)
    if "..." in text or "dots" in text or "\u2026" in text:
        text = _ELLIPSIS_RE.sub(r"\\ldots", text)
    return text


def _drop_hope(text: str) -> str:
    """Minerva's "I hope it is correct." removed with the spaces before it (linear: no regex rescans
    a run of spaces)."""
    out, pos = [], 0
    for m in _HOPE_RE.finditer(text):
        j = m.start()
        while j > pos and text[j - 1].isspace():
            j -= 1
        out.append(text[pos:j])
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def _is_answer_like(ans: str) -> bool:
    """A marker's text that states something (a digit, math, an option letter), not prose."""
    return bool(re.search(r"[\d$\\^=]", ans) or re.fullmatch(r"\**\(?[A-J]\)?\**", ans.strip()))


def _marker_answer(text: str) -> tuple[str | None, int, int]:
    """(answer, marker start, answer end) after the last final-answer marker; (None, -1, -1) if none.
    The start is -1 for a marker without a cue, which never overrides a box."""
    markers = list(_MARKER_RE.finditer(text))
    if not markers:
        return None, -1, -1
    m = markers[-1]
    # The marker's answer is on its first non-empty line (read up to MAX_ANSWER_READ characters).
    j = _LEAD_WS_RE.match(text, m.end()).end()
    nl = text.find("\n", j, j + MAX_ANSWER_READ)
    seg = text[m.end() : nl if nl >= 0 else j + MAX_ANSWER_READ]
    # "Final Answer: The largest $n$ is 34." -> after the last "is" in the clause
    first_line = seg.strip().split("\n", 1)[0] if seg.strip() else ""
    if not first_line.lstrip("*: ").startswith(("$", "\\(", "\\[")):
        iss = list(_IS_RE.finditer(first_line))
        if iss:
            first_line = first_line[iss[-1].end() :]
    ans = _clip_sentence(first_line)
    if not ans:
        return ("" if not seg.strip() else None), m.start(), -1
    end = text.find(ans, m.end())
    # Only a marker with a cue ("answer is", "Answer:", "final answer") may override a box before it:
    # "... which gives the correct answer of 63." restates nothing.
    cued = bool(_CUED_RE.search(m.group(0)))
    return ans, (m.start() if cued else -1), (end + len(ans) if end >= 0 else m.end())


def _extract(pred: str, truncated: bool) -> tuple[str | None, str]:
    """(answer, how) with how in {"boxed", "marker", "bare", "none"}; see the package docstring."""
    full_len = len(pred)
    text = _clean(pred)
    boxes = _boxes(text)
    box_ans, box_end = None, -1
    if boxes:
        if boxes[-1][1] < 0:
            return None, "none"  # the last box was cut off: the answer was never written
        group = [boxes[-1]]  # built backwards from the last box
        for b in reversed(boxes[:-1]):
            if b[1] >= 0 and _BOX_JOIN_RE.match(text[b[1] : group[-1][0]]):
                group.append(b)
            else:
                break
        # A box repeated in a loop is one answer, not a set of copies.
        items = list(dict.fromkeys(c.strip() for _, _, c in reversed(group)))
        box_ans, box_end = ", ".join(items), group[0][1]

    ans, mark_start, mark_end = _marker_answer(text)
    # The last explicit answer wins: a marker after the last box restates or corrects it.
    if ans and (box_ans is None or (mark_start > box_end and _is_answer_like(ans))):
        return (ans, "marker") if not truncated or _is_final(text, mark_end) else (None, "none")
    if box_ans is not None:
        return (box_ans, "boxed") if not truncated or _is_final(text, box_end) else (None, "none")
    if ans == "":
        return None, "none"  # marker then nothing: cut off

    # No marker: only a finished output may be read. One that is only an answer is read whole
    # ("41 * 74", "1 1/4", "(1, 2)"), as math-verify parses it; otherwise only a short one, by its
    # last number / math span.
    if truncated or _looks_unfinished(text):
        return None, "none"
    bare = bare_answer(text)
    if bare is not None:
        return bare, "bare"
    if full_len - _tail_number_len(text) > SHORT_CHARS:
        return None, "none"
    m = _FINAL_SPAN_RE.search(text) or _SPAN_IS_ANSWER_RE.search(text)
    if m:
        span = next(g for g in m.groups() if g is not None).strip()
        if span:
            return span, "bare"
    last_line = text.rstrip().rsplit("\n", 1)[-1]
    m = _FINAL_NUM_RE.search(last_line)
    before = last_line[max(0, m.start(1) - 12) : m.start(1)] if m else ""
    if m and not _LIST_BEFORE_RE.search(before) and not _OPERATOR_BEFORE_RE.search(before):
        return m.group(1).replace("$", ""), "bare"
    cues = list(_CUE_RE.finditer(last_line))
    m = _FINAL_EXPR_RE.match(last_line, cues[-1].end()) if cues else None
    if m and re.search(r"\d", m.group(1)):
        return m.group(1).strip(), "bare"
    eqs = list(_LAST_EQ_NUM_RE.finditer(text))
    if eqs:
        return eqs[-1].group(1).replace("$", ""), "bare"
    return None, "none"


# "We get 1, 000.": the last number ends a list ("1" and "000"), it is not the answer alone.
_LIST_BEFORE_RE = re.compile(r"\d,\s*$")
# "the product is 41 * 74.": the last number is an operand of an expression, not the answer alone.
_OPERATOR_BEFORE_RE = re.compile(r"[\d)}]\s*(?:[-+*/^]|\\times|\\cdot|\\div)\s*$")
# Multi-letter words a bare answer may contain anywhere: function names and constants ("pi/2", "2 sin x").
_MATH_WORDS = frozenset(
    "pi sqrt cbrt sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp mod gcd lcm "
    "max min inf infty infinity deg".split()
)
# Words that make a string prose rather than an answer (a product of variables is at most 3 letters:
# "2ab", "xyz"; these are the short words that are not).
_PROSE_WORDS = frozenset(
    "am an are as at be but by can did do does for from get got had has have he her him his how if in "
    "is it its let me my no not now of off on one our out see she so than that the then this to too "
    "two up us use was way we who why yes you".split()
)
# Characters a bare answer is made of (after clean_unicode); anything else (?, #, @, letters of other
# scripts) is prose or markup.
_BARE_CHARS_RE = re.compile(r"[0-9A-Za-z\s+\-*/^_=.,:;!()\[\]{}|<>'\"&%$\\~\u00b0\u20ac\u00a3\u00a5]*")
_WORD_RE = re.compile(r"[A-Za-z]{2,}")
_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
_ENV_RE = re.compile(r"\\(?:begin|end)\s*\{[A-Za-z*]+\}")
# Trailing unit words after a number: "12 apples", "3 m/s", "25 percent", "5 \text{ cm}".
_UNIT_RUN_RE = re.compile(r"[0-9}%]\s*((?:[A-Za-z]+[\s/.^0-9{}]*){1,4})$")
_EQ_RE = re.compile(r"(?<![<>!=])=(?!=)")


def bare_answer(text: str) -> str | None:
    """The whole output when it is only an answer -- math, no prose, no box -- else None.

    ``"41 * 74"``, ``"1 1/4"``, ``"3 \\times 10^{8}"``, ``"25%"``, ``"\"42\""``, ``"pi/2"``, ``"(1, 2)"``,
    ``"[0, 1)"``, a ``pmatrix``, ``"12 apples"`` are answers; ``"The answer is 5"`` and ``"I got 5"`` are
    prose (their answer comes from a marker or the last number). An arithmetic left-hand side is read
    through (``"16 - 3 - 4 = 9"`` -> ``"9"``); an equation with a variable stays whole (``"x = 5"``).
    Linear in ``len(text)``; outputs longer than ``MAX_ANSWER_READ`` are never bare.
    """
    t = text.strip()
    if not t or len(t) > MAX_ANSWER_READ:
        return None
    if "\n" in t and not (t.startswith("\\begin{") or t.startswith("$")):
        return None
    t = _strip_outer(t)
    t = t.strip("*_").strip()  # markdown bold / italics around the answer
    if not t or not _BARE_CHARS_RE.fullmatch(t) or not re.search(r"[0-9A-Za-z]", t):
        return None
    if "\n" in t and not (t.startswith("\\begin{") and t.rstrip().endswith("}")):
        return None
    # LaTeX command and environment names are math (\frac, \times, \text, \begin{pmatrix})
    plain = _COMMAND_RE.sub(" ", _ENV_RE.sub(" ", t))
    unit = _UNIT_RUN_RE.search(plain)
    unit_start = unit.start(1) if unit else len(plain)
    for w in _WORD_RE.finditer(plain):
        lw = w.group().lower()
        if lw in _PROSE_WORDS:
            return None
        if lw in _MATH_WORDS or len(lw) <= 3 or w.start() >= unit_start:
            continue
        return None
    eqs = list(_EQ_RE.finditer(t))
    if eqs and not re.search(r"[A-Za-z]", _COMMAND_RE.sub("", t[: eqs[0].start()])):
        rhs = t[eqs[-1].end() :].strip()
        if rhs:
            return rhs  # "16 - 3 - 4 = 9": the result, not the arithmetic
    return t


def _tail_number_len(text: str) -> int:
    """Length of the number (digits, separators) that ends ``text``, closing punctuation included."""
    i = len(text)
    while i > 0 and text[i - 1] in " \t\n.!*$":
        i -= 1
    j = i
    while j > 0 and (text[j - 1].isdigit() or text[j - 1] in ",."):
        j -= 1
    return len(text) - j if any(c.isdigit() for c in text[j:i]) else 0


def _is_final(text: str, end: int) -> bool:
    """Nothing but closing punctuation follows ``text[:end]``: the length cap fell right after the answer."""
    return bool(_FINAL_TAIL_RE.fullmatch(text[end:]))


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

