"""The grader without math-verify (math-verify is optional): its own LaTeX reader + sympy, one warning line.

Runs whether or not math-verify is installed: the "without" cases block the import in a subprocess
(``sys.modules["math_verify"] = None``), as an image that lacks the package would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_tools.grader.latex import LatexError, equivalent, read

REPO = Path(__file__).resolve().parents[1]
WARNING = "math-verify unavailable"

# (prediction, gold, right verdict): answers that need the sympy step, and a few that do not.
CASES = [
    ("\\boxed{\\sec^2(y)}", "\\tan^2(y)+1", True),
    ("\\boxed{x^2 + 2x}", "(x+1)^2", False),
    ("41 * 74", "3034", True),
    ("\\boxed{\\frac{x}{7}+\\frac{2}{7}}", "\\frac{x+2}{7}", True),
    ("\\sqrt[3]2", "2^{1/3}", True),
    ("\\boxed{\\sqrt[4]2}", "\\sqrt{2}", False),
    ("The answer is pi/2", "\\frac{\\pi}{2}", True),
    ("\\boxed{[-2,7]}", "-2 \\le x \\le 7", True),
    ("\\boxed{(-2,7]}", "-2 \\le x \\le 7", False),
    ("\\boxed{3}, \\boxed{5}, \\boxed{7}", "3, 5, 7", True),
    ("\\boxed{3, 5}", "3, 5, 7", False),
    ("\\boxed{\\frac{1}{2^{99}}}", "\\frac{1}{2^{98}}", False),
    ("\\boxed{y = -\\frac{1}{2}x + \\frac{3}{4}}", "2x+4y-3=0", True),
    ("\\boxed{14.0 + -1.0i}", "14 - i", True),
    ("\\boxed{42}", "42", True),
    ("\\boxed{41}", "42", False),
]

SCRIPT = """
import json, sys
sys.modules["math_verify"] = None
sys.modules["latex2sympy2_extended"] = None
from data_tools import grader
from data_tools.grader import grade_batch, parse_gold
cases = json.loads(sys.argv[1])
first = grade_batch([c[0] for c in cases], [c[1] for c in cases], workers=2)
again = grade_batch([c[0] for c in cases], [c[1] for c in cases], workers=2)  # cached and fresh workers alike
print(json.dumps({"backend": grader.sandbox.backend(),
                  "verdicts": [[v.correct, v.path] for v in first],
                  "again": [v.correct for v in again],
                  "gold": [parse_gold("x^2+1"), parse_gold("\\\\frac{"), parse_gold("3034")]}))
"""


def _run(script: str, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_grader_without_math_verify_gives_real_verdicts_and_says_so_once():
    r = _run(SCRIPT, json.dumps(CASES))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["backend"] == "sympy"
    assert [v[0] for v in out["verdicts"]] == [c[2] for c in CASES], list(zip(CASES, out["verdicts"]))
    assert out["again"] == [c[2] for c in CASES]
    paths = {v[1] for v in out["verdicts"]}
    assert "sympy" in paths and "math_verify" not in paths
    assert out["gold"] == ["x^2+1", None, "3034"]
    assert r.stderr.count(WARNING) == 1, r.stderr  # one line per process, however many workers and calls
    assert "math_verify, latex2sympy2_extended not installed" in r.stderr


def test_broken_math_verify_install_falls_back_once(tmp_path):
    """math-verify present but failing to import (a broken install): the worker says so, the grader
    uses the sympy reader from then on, and the warning is printed once."""
    for name, body in (("math_verify", "raise ImportError('broken on purpose')\n"), ("latex2sympy2_extended", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(body)
    script = ("import json\nfrom data_tools.grader import grade, sandbox\n"
              "vs = [grade('\\\\boxed{\\\\sec^2(y)}', '\\\\tan^2(y)+1'), grade('\\\\boxed{x+1}', 'x-1'),"
              " grade('\\\\boxed{\\\\sqrt{12}}', '2\\\\sqrt{3}')]\n"
              "print(json.dumps([[v.correct, v.path] for v in vs] + [sandbox.backend()]))\n")
    r = _run(script, env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[True, "sympy"], [False, "sympy"], [True, "sympy"], "sympy"]
    assert r.stderr.count(WARNING) == 1 and "broken on purpose" in r.stderr, r.stderr


REPORTS_SCRIPT = """
import sys
sys.modules["math_verify"] = None
sys.modules["latex2sympy2_extended"] = None
sys.path.insert(0, "tests")
from test_grader_reports import CASES
from data_tools.grader import grade_batch, sandbox
vs = grade_batch([c["pred"] for c in CASES], [c["gold"] for c in CASES],
                 truncated=[c.get("truncated", False) for c in CASES], workers=2)
assert sandbox.backend() == "sympy"
wrong = [(c["id"], v) for c, v in zip(CASES, vs) if v.correct != c["expected"]]
print(len(CASES), "cases; wrong:", wrong)
"""


def test_report_cases_all_right_without_math_verify():
    """Every case of tests/data/grader_reports.jsonl, math-verify blocked: no false accepts, no false rejects."""
    r = _run(REPORTS_SCRIPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("wrong: []"), r.stdout


def test_import_never_fails_without_math_verify():
    r = _run("import sys; sys.modules['math_verify'] = None; sys.modules['latex2sympy2_extended'] = None\n"
             "import data_tools.grader, data_tools.grader.__main__\n"
             "from data_tools.grader import grade\n"
             "print(grade('The answer is 1,234.', '1234').correct)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
    assert WARNING not in r.stderr  # the exact/numeric path never needed the sympy step


# The reader on its own (sympy only; no subprocess): (gold, answer, equal?).
READER_CASES = [
    ("\\frac{1}{2}", "0.5", True), ("\\frac12", "\\dfrac{1}{2}", True), ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("\\sqrt[3]{2}", "\\sqrt[3]2", True), ("\\sqrt[3]27", "3", False),  # TeX: the index takes one token
    ("x^2+2x+1", "(x+1)^2", True), ("x^2+2x", "(x+1)^2", False), ("e^{i\\pi}", "-1", True),
    ("(1,2)", "(2,1)", False), ("[0,1)", "(0,1]", False), ("3, 5, 7", "7, 5, 3", True), ("3, 5, 7", "3, 5", False),
    ("\\pm 2021", "-2021, 2021", True), ("\\{1, 2\\}", "\\{2, 1\\}", True), ("k=1", "1", True),
    ("7 = 11a+c", "11a+c", False), ("2x+4y-3=0", "4y = 3 - 2x", True), ("x < 1", "-x > -1", True),
    ("x \\ge 5", "[5, \\infty)", True), ("(-\\infty,-2)\\cup(3,\\infty)", "x<-2 \\text{ or } x>3", False),
    ("\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}", "\\begin{bmatrix}1&2\\\\3&4\\end{bmatrix}", True),
    ("\\begin{pmatrix}1 & 2 \\\\ 3 & 4\\end{pmatrix}", "\\begin{pmatrix}1&2\\\\4&3\\end{pmatrix}", False),
    ("\\frac{1}{2004!}", "\\frac{1}{2006!}", False), ("\\pi", "3.14", False), ("\\pi", "3.141593", True),
    ("\\frac{639}{40}", "15\\frac{39}{40}", True), ("\\log_2 8", "3", True), ("|{-3}|", "3", True),
    ("\\binom{5}{2}", "10", True), ("\\lfloor 2.5 \\rfloor", "2", True), ("14 - i", "14 + i", False),
]


@pytest.mark.parametrize("gold,answer,equal", READER_CASES, ids=[f"{g}|{a}" for g, a, _ in READER_CASES])
def test_latex_reader(gold, answer, equal):
    assert equivalent(read(gold), read(answer)) is equal


def test_latex_reader_refuses_what_it_cannot_read():
    for s in ("\\overline{CD}", "x \\mapsto 2", "\\frac{1}{", "(1, 2", "\\int_0^1 x\\,dx", "a \\pm b \\pm c", "1/0"):
        with pytest.raises(LatexError):
            read(s)
