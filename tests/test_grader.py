"""Tests for data_tools.grader: verdicts per answer family, guards, adversarial inputs, threads, CLI,
and fidelity on the public answer-equivalence cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify")

from data_tools import grader  # noqa: E402
from data_tools.grader import Verdict, extract_gsm8k_answer, grade, grade_batch, parse_gold  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    env = os.environ.get("OPD_SHARED_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared"


# (pred, gold, expected) per family; each family has true and false cases.
FAMILIES = {
    "boxed": [
        ("So the answer is \\boxed{42}.", "42", True),
        ("So the answer is \\boxed{41}.", "42", False),
        ("First \\boxed{5}. That was wrong; the answer is \\boxed{7}.", "7", True),
        ("First \\boxed{7}. That was wrong; the answer is \\boxed{5}.", "7", False),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),
        ("\\boxed{x^2 + 2x}", "(x+1)^2", False),
    ],
    "fractions": [
        ("\\boxed{\\frac{2}{-3}}", "-\\frac{2}{3}", True),
        ("\\boxed{\\dfrac{4}{6}}", "\\frac23", True),
        ("\\boxed{2/3}", "\\frac{2}{3}", True),
        ("\\boxed{0.0833333333333333}", "\\frac{1}{12}", True),
        ("\\boxed{0.33}", "\\frac{1}{3}", False),
        ("\\boxed{0.666667}", "\\frac{2}{3}", True),  # correctly rounded, 6 significant digits
        ("\\boxed{0.666666}", "\\frac{2}{3}", False),  # truncated, not rounded
        ("\\boxed{0.500000}", "\\frac{2}{3}", False),
        ("\\boxed{\\frac{3}{2}}", "\\frac{2}{3}", False),
    ],
    "intervals": [
        ("\\boxed{[-2,7]}", "-2 \\le x \\le 7", True),
        ("\\boxed{-2 \\le x \\le 7}", "[-2,7]", True),
        ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", True),
        ("\\boxed{[1,2)}", "(1,2]", False),
        ("\\boxed{[0,9)}", "(0,9)", False),
    ],
    "sets": [
        ("\\boxed{3}, \\boxed{5}, \\boxed{7}", "3, 5, 7", True),
        ("\\boxed{7, 5, 3}", "3, 5, 7", True),
        ("\\boxed{-2021, 2021}", "\\pm 2021", True),
        ("\\boxed{1728}", "1331, 1728", False),  # a subset of a "find all" answer is wrong
        ("\\boxed{3, 5}", "3, 5, 7", False),
        ("\\boxed{2021}", "\\pm 2021", False),
    ],
    "e-notation": [
        ("\\boxed{4.5 \\times 10^{33}}", "4.5e33", True),
        ("\\boxed{4.5e33}", "4.5 \\times 10^{33}", True),
        ("\\boxed{1 \\times 10^{-5}}", "1e-5", True),
        ("\\boxed{4.5 \\times 10^{32}}", "4.5e33", False),
        ("\\boxed{4.5e32}", "4.5e33", False),
    ],
    "tiny magnitudes": [
        ("\\boxed{\\frac{1}{2^{99}}}", "\\frac{1}{2^{98}}", False),
        ("\\boxed{2^{-99}}", "\\frac{1}{2^{99}}", True),
        ("\\boxed{\\frac{1}{2006!}}", "\\frac{1}{2004!}", False),
        ("\\boxed{\\frac{1}{2004!}}", "\\frac{1}{2004!}", True),
        ("\\boxed{0.00000001}", "0.00000002", False),
    ],
    "gsm8k": [
        ("She makes 9 * 2 = 18 dollars.\n#### 18", "#### 18", True),
        ("He pays 1,000 + 234 = 1,234 dollars.\n#### 1,234", "#### 1234", True),
        ("He pays 1,235 dollars.\n#### 1,235", "#### 1,234", False),
        ("The answer is 19.", "19", True),
        ("19", "19", True),
        ("She sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = 18 dollars.\nI checked it twice.", "18", True),
    ],
    "no leniency": [
        ("\\boxed{3.14}", "\\pi", False),  # no pi ~ 3.14
        ("\\boxed{6.28}", "2\\pi", False),
        ("\\boxed{0.28}", "28\\%", False),  # no x100 percent leniency
        ("\\boxed{28}", "28\\%", True),
        ("\\boxed{10000001}", "10000000", False),  # integers compare exactly
    ],
    "text and choice": [
        ("so $\\boxed{\\text{Evelyn}}$ is our answer.", "\\text{Evelyn}", True),
        ("so $\\boxed{\\text{Bob}}$ is our answer.", "\\text{Evelyn}", False),
        ("option \\boxed{\\mathrm{(D)}\\ 1,008,016}", "D", True),
        ("option \\boxed{\\mathrm{(C)}\\ 1,008,016}", "D", False),
        ("\\boxed{12\\text{ ft}}", "12", True),
        ("\\boxed{90^\\circ}", "90", True),
    ],
}
FAMILY_CASES = [(fam, *c) for fam, cases in FAMILIES.items() for c in cases]


@pytest.mark.parametrize("family,pred,gold,expected", FAMILY_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FAMILY_CASES)])
def test_family_verdicts(family, pred, gold, expected):
    v = grade(pred, gold)
    assert isinstance(v, Verdict)
    assert v.correct is expected, v
    assert v.extracted is not None


def test_paths_recorded():
    assert grade("\\boxed{42}", "42").path == "exact"
    assert grade("\\boxed{0.5}", "\\frac{1}{2}").path == "numeric"
    assert grade("\\boxed{41}", "42") == Verdict(False, "41", "numeric")
    assert grade("\\boxed{\\sec^2(y)}", "\\tan^2(y)+1") == Verdict(True, "\\sec^2(y)", "math_verify")
    assert grade("I have no idea", "42").path == "no_answer"


def test_truncated_needs_marker():
    out = "We have f(2) = 4 - 2 = 2, and then g(f(2)) = g(2) ="
    assert grade(out, "2") == Verdict(False, None, "no_answer")  # unfinished trace
    assert grade("Hence the perimeter is \\boxed{1", "1") == Verdict(False, None, "no_answer")
    # A short finished output may end in a bare number, but not when it hit the length cap ...
    assert grade("Adding them, we get 19.", "19").correct is True
    assert grade("Adding them, we get 19.", "19", truncated=True) == Verdict(False, None, "no_answer")
    # ... while a marked answer is graded as produced either way.
    assert grade("so the answer is 19", "19", truncated=True).correct is True
    # A long output needs a marker even when finished.
    long_trace = "We compute 3 + 4 = 7 and carry on. " * 100 + "Thus 19"
    assert grade(long_trace, "19").path == "no_answer"
    assert grade(long_trace + ". The answer is 19.", "19").correct is True
    # Truncated: only a final answer counts; an earlier box with text after it may have been retracted.
    boxed_then_more = "So the sum is \\boxed{19}. Wait, I dropped a term: 19 + 4 ="
    assert grade(boxed_then_more.rsplit(" Wait", 1)[0], "19", truncated=True) == Verdict(True, "19", "exact")
    assert grade(boxed_then_more, "19", truncated=True) == Verdict(False, None, "no_answer")
    assert grade("So the sum is \\boxed{19}. Let me double-check: it holds.", "19", truncated=True).path == "no_answer"
    assert grade("So the sum is \\boxed{19}. Let me double-check: it holds.", "19").correct is True


ADVERSARIAL = {
    "power tower": "\\boxed{9^9^9^9}",
    "power tower unboxed": "The answer is 9^{9^{9^{9}}}",
    "huge exponent": "\\boxed{2^{100000000}}",
    # Redundant brackets are peeled (tests/test_grader_reports.py decides "{{{1}}}" = 1 right), so
    # the nested value here differs from the gold.
    "10k nested braces": "\\boxed{" + "{" * 10000 + "2" + "}" * 10000 + "}",
    "1k nested braces in tail": "\\boxed{" + "{" * 1000 + "2" + "}" * 1000 + "}",
    "unclosed boxes": "\\boxed{" * 5000,
    "dollar storm": "$" * 100000,
    "truncated": "Let x = 3. Then \\boxed{\\frac{1}{",
    "megabyte no answer": "x = 1 + " * 150000,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_bounded(name):
    t = time.monotonic()
    v = grade(ADVERSARIAL[name], "1", timeout_s=2.0)
    assert time.monotonic() - t < 10.0
    assert v.correct is False
    assert v.path in {"fallback", "no_answer", "timeout", "numeric", "exact"}


def test_megabyte_output_with_answer():
    out = "blah " * 200_000 + "\nSo the final answer is \\boxed{7}."
    assert len(out) > 1_000_000
    t = time.monotonic()
    assert grade(out, "7") == Verdict(True, "7", "exact")
    assert time.monotonic() - t < 1.0


def test_timeout_kills_and_recovers():
    # Passes the cheap pre-screen but makes sympy sum 9999 huge powers: only the deadline stops it.
    t = time.monotonic()
    v = grade("\\boxed{\\sum_{k=1}^{9999} k^{9999}}", "1", timeout_s=1.0)
    elapsed = time.monotonic() - t
    assert v == Verdict(False, "\\sum_{k=1}^{9999} k^{9999}", "timeout")
    assert elapsed < 1.0 + grader.sandbox.WORKER_START_TIMEOUT_S
    assert elapsed >= 1.0
    # the killed worker was replaced: the sympy path works afterwards
    assert grade("\\boxed{\\frac{x}{7}+\\frac{2}{7}}", "\\frac{x+2}{7}") == Verdict(
        True, "\\frac{x}{7}+\\frac{2}{7}", "math_verify"
    )


def test_grade_from_thread():
    results: list[Verdict] = []
    errors: list[BaseException] = []

    def work():
        try:
            results.append(grade("\\boxed{\\sqrt 2+\\sqrt 5}", "\\sqrt{2}+\\sqrt{5}"))
            results.append(grade("\\boxed{\\frac{1+\\sqrt{5}}{2}}", "2"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=work)
    th.start()
    th.join(60)
    assert not errors
    assert [r.correct for r in results] == [True, False]


def test_grade_batch_order_and_threads():
    preds = ["\\boxed{%d}" % i for i in range(20)] + ["\\boxed{x+1}", "\\boxed{x-1}"]
    golds = [str(i if i % 3 else i + 1) for i in range(20)] + ["1+x", "1+x"]
    out = grade_batch(preds, golds, workers=2)
    assert [v.correct for v in out] == [i % 3 != 0 for i in range(20)] + [True, False]
    assert grade_batch(["19"], ["19"], truncated=[True]) == [Verdict(False, None, "no_answer")]
    with pytest.raises(ValueError):
        grade_batch(["1"], ["1", "2"])


def test_verifier_hook():
    calls = []

    def judge(ans, gold):
        calls.append((ans, gold))
        return ans.strip().lower() == "blue" and gold == "\\text{the color blue}"

    grader.set_verifier(judge)
    try:
        v = grade("The answer is blue.", "\\text{the color blue}")
        assert v == Verdict(True, "blue", "fallback")
        assert calls
        # certain numeric verdicts never reach the judge
        calls.clear()
        assert grade("\\boxed{3}", "4").path == "numeric"
        assert not calls
    finally:
        grader.set_verifier(None)
    assert grade("The answer is blue.", "\\text{the color blue}").correct is False


def test_parse_gold_and_gsm8k():
    assert extract_gsm8k_answer("She pays 2 * 617 = 1,234.\n#### 1,234") == "1234"
    assert extract_gsm8k_answer("#### -5") == "-5"
    assert extract_gsm8k_answer("no marker") is None
    assert parse_gold("#### 1,234") == "1234"
    assert parse_gold("004") == "4"
    assert parse_gold("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert parse_gold("$(1,2]$") == "(1,2]"
    assert parse_gold("\\text{Evelyn}") == "\\text{Evelyn}"
    assert parse_gold("x^2+1") == "x^2+1"
    for bad in ["", "   ", "\\frac{", "}{", "@@@", "x" * 5000, "N/A", "TBD", "?", "n/a."]:
        assert parse_gold(bad) is None, bad


def test_no_eval_of_model_text(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    for out in (f"The answer is {payload}", f"\\boxed{{{payload}}}", f"Thus {payload}"):
        assert grade(out, "1").correct is False
    assert not marker.exists()


def test_cli(tmp_path):
    f = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"gold": "42", "pred": "so \\boxed{42}", "id": 1}),
        "not json {",
        json.dumps({"gold": "7"}),
        json.dumps({"gold": "\\frac{1}{2}", "pred": "The answer is 0.4."}),
    ]
    f.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-m", "data_tools.grader", str(f)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert r.returncode == 1
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(out) == 4
    assert out[0]["correct"] is True and out[0]["extracted"] == "42" and out[0]["id"] == 1
    assert out[0]["grader_path"] == "exact"
    assert out[1]["correct"] is False and "error" in out[1]
    assert out[2]["correct"] is False and "pred" in out[2]["error"]
    assert out[3]["correct"] is False and out[3]["extracted"] == "0.4" and "error" not in out[3]
    assert ":2:" in r.stderr and ":3:" in r.stderr

    r = subprocess.run(
        [sys.executable, "-m", "data_tools.grader", "-"],
        input=lines[0] + "\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["correct"] is True


def test_public_fidelity():
    path = shared_dir() / "grader_cases" / "public.jsonl"
    if not path.exists():
        pytest.skip(f"public grader cases not found at {path} (set OPD_SHARED_DIR to the shared folder)")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    verdicts = grade_batch([r["pred"] for r in rows], [r["gold"] for r in rows], workers=2)
    wrong = [(r["kind"], r["gold"], v) for r, v in zip(rows, verdicts) if v.correct != r["expected"]]
    rate = 1 - len(wrong) / len(rows)
    assert rate >= 0.95, wrong


def test_numeric_answer_filter_rejects_unevaluated_expressions():
    """'numeric': a plain-number gold needs a plain-number answer; 'math' accepts equal expressions."""
    from data_tools.grader import grade, grade_batch

    cases = [  # (prediction, gold, verdict under "math", verdict under "numeric")
        ("Final Answer: 521 * 5.", "2605", True, False),  # restating the question (seen in a GRPO run)
        ("So, the answer is 2 * 10 - 3", "17", True, False),
        ("The answer is \\boxed{41 \\times 74}.", "3034", True, False),
        ("The answer is \\boxed{3034}.", "3034", True, True),
        ("\\boxed{3,034}", "3034", True, True),
        ("\\boxed{\\frac{4}{9}}", "\\frac{4}{9}", True, True),
        ("\\boxed{8/18}", "\\frac{4}{9}", True, False),  # an unreduced fraction is an unevaluated division
        ("\\boxed{48/2}", "24", True, False),
        ("\\boxed{\\frac{6}{3}}", "2", True, False),
        ("\\boxed{10^2}", "100", True, False),
        ("\\boxed{5-3}", "2", True, False),
        ("\\boxed{17.0}", "17", True, True),
        ("\\boxed{-\\frac{1}{2}}", "-\\frac{1}{2}", True, True),
        ("\\boxed{0.5}", "\\frac{1}{2}", True, True),
        ("The answer is 4 * 8 = 32.", "32", True, True),  # the result after a final '=' is read
        ("The answer is x = 12.", "12", True, True),
        ("\\boxed{(5)}", "5", True, True),
        ("The answer is 12 apples.", "12", True, True),  # trailing unit words
        ("\\boxed{18}", "17", False, False),
        ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True, True),  # gold not a plain number: graded as "math"
    ]
    for pred, gold, want_math, want_num in cases:
        assert grade(pred, gold).correct is want_math, (pred, gold)
        v = grade(pred, gold, answer_filter="numeric")
        assert v.correct is want_num, (pred, gold, v)
    v = grade("Final Answer: 521 * 5.", "2605", answer_filter="numeric")
    assert v.path == "not_a_number" and v.extracted == "521 * 5"
    batch = grade_batch([c[0] for c in cases], [c[1] for c in cases], answer_filter="numeric", workers=2)
    assert [b.correct for b in batch] == [c[3] for c in cases]
    with pytest.raises(ValueError, match="answer_filter"):
        grade("1", "1", answer_filter="strict")
    with pytest.raises(ValueError, match="answer_filter"):
        grade_batch(["1"], ["1"], answer_filter="strict")


def test_simplify_rewrites_exact_and_linear():
    from data_tools.grader.simplify import cancel, peel, power_tower

    assert peel("((1))") == "1" and peel("(1,2)") == "(1,2)" and peel("(1)+(2)") == "(1)+(2)"
    assert peel("\\left(\\left(3\\right)\\right)") == "3" and peel("[[0,1]]") == "[0,1]"
    assert cancel("a^{99} - a^{99} + 5") == "5" and cancel("a - b") == "a - b"
    assert cancel("10^{10^{10}} \\cdot 0 + 7") == "7" and cancel("\\frac{(9!)!}{(9!)!}") == "1"
    assert power_tower("2^{2^{2^{2^{2}}}}") == power_tower("4^{32768}") == (2, 65536)
    assert power_tower("9^{9^{9^{9}}}") is None  # the exponent 9^(9^9) is never computed
    t = time.monotonic()
    assert peel("(" * 20000 + "1" + ")" * 20000) == "1"
    assert time.monotonic() - t < 1.0


# Shapes that were quadratic (or raised) in an earlier version of the rewrites; each must stay linear.
HOSTILE_SHAPES = {
    "20k nested boxes around the answer": ("\\boxed{" * 20000 + "7" + "}" * 20000, True),
    "50k-term sum": ("\\boxed{" + "+".join(["x"] * 50000) + "}", False),
    "100k superscript digits": ("\\boxed{2" + "\u00b2" * 100000 + "}", False),
    "5k mixed bracket kinds around the answer": ("\\boxed{" + "([{" * 5000 + "7" + "}])" * 5000 + "}", True),
    "20k brace-less boxes": ("\\boxed 7 " * 20000, True),
    "3k cancelling term pairs": ("\\boxed{" + "".join(f"+a^{{{i}}}-a^{{{i}}}" for i in range(3000)) + "+7}", True),
    # bare answers are read whole: long runs inside one must stay linear too
    "90k spaces between two digits, bare": ("7" + " " * 90000 + "7", False),
    "40k stars between two digits, bare": ("7" + "*" * 40000 + "7", False),
    "40k underscores between two digits, bare": ("7" + "_" * 40000 + "7", False),
    "a unit after 90k spaces": ("\\boxed{7" + " " * 90000 + "\\text{ cm}}", True),
    "Minerva's closing line after 200k spaces": (" " * 200000 + "\\boxed{7} I hope it is correct.", True),
    # fix_tex's glue: brace-less \frac arguments, \phantom, thousands separators, runs of whitespace
    "20k nested brace-less fracs": ("\\boxed{" + "\\frac{" * 20000 + "7" + "}" * 20000 + "}", False),
    "50k brace-less fracs in a row": ("\\boxed{" + "\\frac12" * 50000 + "}", False),
    "20k unclosed phantoms": ("\\boxed{" + "\\phantom{" * 20000 + "}", False),
    "50k thousands separators": ("\\boxed{" + "1,\\!" * 50000 + "000}", False),
    "a box after 200k newlines": ("\n" * 200000 + "\\boxed{7}", True),
}


@pytest.mark.parametrize("name", list(HOSTILE_SHAPES))
def test_hostile_shapes_linear_in_a_thread(name):
    pred, expected = HOSTILE_SHAPES[name]
    out: list[Verdict] = []
    th = threading.Thread(target=lambda: out.append(grade(pred, "7", timeout_s=2.0)))
    t = time.monotonic()
    th.start()
    th.join(30)
    assert out and out[0].correct is expected, out
    assert out[0].path != "error"
    assert time.monotonic() - t < 5.0


def test_bare_answer_is_read_whole():
    """An output that is only an answer is that answer (an answer-only output must not be misread); prose still needs its final answer."""
    v = grade("41 * 74", "3034")
    assert v.correct is True and v.extracted == "41 * 74", v
    assert grade("41 * 74", "74").correct is False  # not its last number
    assert grade("41 * 74", "3034", answer_filter="numeric") == Verdict(False, "41 * 74", "not_a_number")
    bare = [  # (output, gold, extracted as)
        ("1 1/4", "\\frac{5}{4}", "1 1/4"), ("1.5e3", "1500", "1.5e3"), ("3 \u00d7 10^8", "3 \\times 10^{8}", None),
        ("2.5*10^-3", "0.0025", "2.5*10^-3"), ("25%", "25", "25%"), ('"42"', "42", '"42"'), ("pi/2", "\\frac{\\pi}{2}", "pi/2"),
        ("(1, 2)", "(1,2)", "(1, 2)"), ("[0, 1)", "[0,1)", "[0, 1)"), ("16 - 3 - 4 = 9", "9", "9"),
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", None),
    ]
    for out, gold, extracted in bare:
        v = grade(out, gold)
        assert v.correct is True, (out, v)
        assert extracted is None or v.extracted == extracted, (out, v)
    assert grade("(2, 1)", "(1,2)").correct is False and grade("1 1/4", "1").correct is False
    # prose: the answer is the expression after "is", never the last operand; no cue, no answer
    assert grade("So the product is 41 * 74.", "3034") == Verdict(True, "41 * 74", grade("41 * 74", "3034").path)
    assert grade("So the product is 41 * 74.", "74").correct is False
    assert grade("First I would compute 41 * 74 here", "3034") == Verdict(False, None, "no_answer")
    assert grade("Adding them, we get 19.", "19").correct is True
    # a bare answer that hit the length cap may be cut off: no answer
    assert grade("41 * 74", "3034", truncated=True) == Verdict(False, None, "no_answer")


def test_root_index_comma_space_percent():
    assert grade("\\sqrt[3]2", "\\sqrt[3]{2}").correct is True
    assert grade("\\boxed{\\sqrt[3]2}", "2^{1/3}").correct is True
    assert grade("\\boxed{\\sqrt[3]3}", "\\sqrt[3]{2}").correct is False
    # a comma followed by a space separates two numbers; without the space it groups thousands
    for out in ("1, 000", "\\boxed{1, 000}", "The answer is 1, 000.", "\\boxed{1,\\ 000}"):
        assert grade(out, "1000").correct is False, out
    assert grade("We get 1, 000", "0").correct is False
    for out in ("1,000", "\\boxed{1,\\!000}", "\\boxed{1{,}000}"):
        assert grade(out, "1000").correct is True, out
    # percent against a fraction gold: under "math" an answer's % is also its value, under "numeric" a unit
    for out, gold, math_ok, numeric_ok in [
        ("\\boxed{10\\%}", "0.1", True, False), ("\\boxed{12.5\\%}", "\\frac{1}{8}", True, False),
        ("The answer is 25 percent.", "0.25", True, False), ("\\boxed{10\\%}", "10", True, True),
        ("\\boxed{10\\%}", "0.01", False, False), ("\\boxed{0.1}", "10\\%", False, False),
        ("\\boxed{28}", "28\\%", True, True),
    ]:
        assert grade(out, gold).correct is math_ok, (out, gold)
        assert grade(out, gold, answer_filter="numeric").correct is numeric_ok, (out, gold)


def test_huge_numbers_exact():
    """10^k against its digits for k to 5,000, identical answers of up to 20,000 digits: exact, in milliseconds."""
    t = time.monotonic()
    for k in (400, 2000, 5000):
        digits = "1" + "0" * k
        assert grade(digits, f"10^{{{k}}}") == Verdict(True, digits, "numeric")
        assert grade(f"\\boxed{{10^{{{k}}}}}", digits).correct is True
        assert grade(f"The answer is {digits}.", f"10^{{{k}}}").correct is True
        assert grade(digits[:-1], f"10^{{{k}}}").correct is False
        assert grade(digits, f"10^{{{k + 1}}}").correct is False
    for n in (500, 2000, 10000, 20000):
        num = ("9876543210" * (n // 10 + 1))[:n]
        other = num[:-1] + ("1" if num[-1] != "1" else "2")
        for out in (num, f"The answer is {num}.", f"So the count is {num}.", f"\\boxed{{{num}}}"):
            assert grade(out, num).correct is True, (n, out[:20])
            assert grade(out, other).correct is False, (n, out[:20])
        assert grade(num, num[:-1]).correct is False
    assert parse_gold("1" * 5000) == "1" * 5000
    assert time.monotonic() - t < 10.0  # about 0.3 s here; generous for a loaded machine


def test_cli_number_fields(tmp_path):
    """JSON numbers for gold/pred are read as their exact text; anything else is refused naming line and field."""
    big = "7" * 5000
    lines = [
        '{"gold": 0.5, "pred": "\\\\boxed{\\\\frac12}", "w": 0.25}',
        '{"gold": 3034, "pred": "41 * 74"}',
        '{"gold": 1e-7, "pred": "The answer is 1 \\\\times 10^{-7}."}',
        '{"gold": 0.10, "pred": 0.1}',
        '{"gold": ' + big + ', "pred": "' + big + '"}',
        '{"gold": true, "pred": "1"}',
        '{"gold": [1], "pred": "1"}',
        '{"pred": "1"}',
        '{"gold": "1", "pred": "1", "truncated": "no"}',
    ]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "data_tools.grader", str(f)], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
    assert r.returncode == 1
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert [o["correct"] for o in out] == [True, True, True, True, True, False, False, False, False]
    assert out[0]["gold"] == "0.5" and out[0]["w"] == 0.25
    assert out[2]["gold"] == "1e-7" and out[3]["gold"] == "0.10" and out[3]["pred"] == "0.1"
    assert out[4]["gold"] == big
    err = r.stderr.splitlines()
    assert err == [
        f"{f}:6: 'gold' must be a string or a number, got a boolean",
        f"{f}:7: 'gold' must be a string or a number, got an array",
        f"{f}:8: 'gold' missing",
        f"{f}:9: 'truncated' must be true or false, got a string",
    ], r.stderr
    assert out[5]["error"] == "'gold' must be a string or a number, got a boolean"


# Reference answers of MATH's training set (math_train12k) that the loader used to refuse, as written there,
# each with a right and a wrong answer.
MATH_GOLDS = [
    ("\\frac{12}{5,\\!525}", "\\boxed{\\frac{12}{5525}}", "\\boxed{\\frac{12}{5524}}"),
    ("\\dfrac{1}{29,\\!322,\\!216}", "\\boxed{\\frac{1}{29322216}}", "\\boxed{\\frac{1}{29322217}}"),
    ("\\dfrac{2469}{20,\\!000}", "\\boxed{0.12345}", "\\boxed{0.1234}"),
    ("\\frac \\pi4 + 2 - \\sqrt2", "\\boxed{2 + \\frac{\\pi}{4} - \\sqrt{2}}", "\\boxed{2 + \\frac{\\pi}{2} - \\sqrt{2}}"),
    ("2007 + \\frac\\pi 2", "\\boxed{2007 + \\frac{\\pi}{2}}", "\\boxed{2007 + \\pi}"),
    ("90\\text{ square\nunits}", "\\boxed{90}", "\\boxed{91}"),
    ("\\approx 8.24 \\text{ mph}", "\\boxed{8.24}", "\\boxed{8.25}"),
    ("a + b + c", "\\boxed{c + b + a}", "\\boxed{a + b}"),
    ("\\sin^2 t", "\\boxed{1 - \\cos^2 t}", "\\boxed{\\cos^2 t}"),
    ("43_5.", "\\boxed{43_5}", "\\boxed{44_5}"),
    ("\\text{(E)},", "The answer is \\boxed{\\text{(E)}}.", "The answer is \\boxed{\\text{(D)}}."),
    ("05\\!:\\!00", "\\boxed{5:00 \\text{ p.m.}}", "\\boxed{6:00}"),
    ("\\begin{pmatrix} 1 & -1 \\\\ 1 & \\phantom -1 \\end{pmatrix}",
     "\\boxed{\\begin{pmatrix} 1 & -1 \\\\ 1 & 1 \\end{pmatrix}}", "\\boxed{\\begin{pmatrix} 1 & -1 \\\\ 1 & -1 \\end{pmatrix}}"),
]


@pytest.mark.parametrize("gold,right,wrong", MATH_GOLDS, ids=[g[0] for g in MATH_GOLDS])
def test_math_reference_answers_load_and_grade(gold, right, wrong):
    """Each gold loads, as written (the formal profile sees the dataset's text), and grades a right and a wrong answer."""
    assert parse_gold(gold) in (gold, "90", "8.24"), parse_gold(gold)
    assert grade(right, gold).correct is True, grade(right, gold)
    assert grade(wrong, gold).correct is False, grade(wrong, gold)


def test_fix_tex_glue():
    from data_tools.grader.normalise import fix_tex

    assert fix_tex("\\frac \\pi4 + 2 - \\sqrt2") == "\\frac{\\pi}{4} + 2 - \\sqrt2"
    assert fix_tex("\\frac\\pi 2") == "\\frac{\\pi}{2}" and fix_tex("\\tfrac 1{72}") == "\\tfrac{1}{72}"
    assert fix_tex("\\frac{\\frac 12}{3}") == "\\frac{\\frac{1}{2}}{3}"
    assert fix_tex("\\frac\\sqrt{3}2") == "\\frac\\sqrt{3}2"  # an argument that takes arguments: as written
    assert fix_tex("\\frac{12}{5,\\!525}") == "\\frac{12}{5525}" and fix_tex("1{,}000{,}000") == "1000000"
    assert fix_tex("1,\\!00") == "1,\\!00" and fix_tex("1,000") == "1,000"  # only a group of three digits joins
    assert fix_tex("\\approx 8.24") == "8.24" and fix_tex("\\approx") == "\\approx"
    assert fix_tex("1 & \\phantom{-}1") == "1 & 1" and fix_tex("\\hphantom -2") == "2"
    assert fix_tex("90\\text{ square\nunits}") == "90\\text{ square units}"


def test_one_answer_over_several_boxes():
    """Boxes joined by commas, spacing (\\quad) and one "and" / "or" are one answer, as math-verify joins them."""
    gold = "(2, 2), (6, 2)"
    for out, extracted in [("\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}", "(2, 2), (6, 2)"),
                           ("$\\boxed{(6, 2)}$ \\qquad \\text{or} \\qquad $\\boxed{(2, 2)}$.", "(6, 2), (2, 2)"),
                           ("\\boxed{(2, 2)},~\\boxed{(6, 2)}", "(2, 2), (6, 2)")]:
        v = grade(out, gold)
        assert v.correct is True and v.extracted == extracted, (out, v)
    assert grade("\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 3)}", gold).correct is False
    assert grade("\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}", "(6, 2)").correct is False  # two for one
    # prose between two boxes: the last one is the answer
    assert grade("First \\boxed{(2, 2)}; checking again, it is \\boxed{(6, 2)}", gold) == Verdict(False, "(6, 2)", "math_verify")


def test_percent_spelled_out():
    """"28 percent" in any spelling is 28\\% (right for 28 and 28\\%; under "math" also for 0.28, as 28\\% is)."""
    outs = ("\\boxed{28 \\text{ percent}}", "\\boxed{\\text{28 percent}}", "\\boxed{28\\,\\mbox{per cent}}",
            "The answer is 28 percent.", "\\boxed{28\\textrm{ percent}}")
    for out in outs:
        for gold in ("28", "28\\%", "0.28"):
            assert grade(out, gold).correct is True, (out, gold, grade(out, gold))
        assert grade(out, "27").correct is False and grade(out, "0.028").correct is False, out
        assert grade(out, "28", answer_filter="numeric").correct is True, out
    assert grade("\\boxed{\\text{28 percent}}", "28") == Verdict(True, "\\text{28 percent}", "exact")
