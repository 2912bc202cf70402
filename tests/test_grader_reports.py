"""The grader on answer cases taken from public bug reports and tests of other answer checkers.

``tests/data/grader_reports.jsonl``: one case per line with ``kind``, ``gold``, ``pred`` (or
``gold_build`` / ``pred_build``, a list of ``[text, repeat]`` pieces for the megabyte-sized hostile
outputs and the 10,000-digit answers),
``expected`` (the right verdict), optional ``truncated``, and ``source``: the report or test file the
case comes from (``owner/repo#N`` or ``owner/repo:path``). data_tools/grader/README.md lists the kinds.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

# No importorskip: without math-verify the grader reads answers with its own LaTeX reader + sympy, and
# these cases must come out right either way (tests/test_grader_optional.py runs them with it blocked).
from data_tools.grader import grade, grade_batch  # noqa: E402

CASES_PATH = Path(__file__).resolve().parent / "data" / "grader_reports.jsonl"
SOURCE_RE = re.compile(r"^[\w.-]+/[\w.-]+(?:#\d+|:[\w./-]+)$")
# Seconds one hostile answer may take, end to end, the worker's deadline included.
HOSTILE_BUDGET_S = 6.0


def load_cases() -> list[dict]:
    rows = [json.loads(line) for line in CASES_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    for r in rows:
        for key in ("pred", "gold"):
            if f"{key}_build" in r:
                r[key] = "".join(text * n for text, n in r[f"{key}_build"])
    return rows


CASES = load_cases()


def test_case_set_shape():
    assert len(CASES) >= 100
    assert len({c["id"] for c in CASES}) == len(CASES)
    for c in CASES:
        assert SOURCE_RE.match(c["source"]), c["id"]
        assert isinstance(c["expected"], bool) and isinstance(c["gold"], str) and isinstance(c["pred"], str), c["id"]
    kinds = {c["kind"] for c in CASES}
    for kind in kinds:  # every kind has an accept and a refuse case
        assert {c["expected"] for c in CASES if c["kind"] == kind} == {True, False}, kind


def test_report_cases_all_right_no_false_accepts():
    verdicts = grade_batch([c["pred"] for c in CASES], [c["gold"] for c in CASES],
                           truncated=[c.get("truncated", False) for c in CASES], workers=2)
    false_accepts = [(c["id"], v) for c, v in zip(CASES, verdicts) if v.correct and not c["expected"]]
    false_rejects = [(c["id"], v) for c, v in zip(CASES, verdicts) if not v.correct and c["expected"]]
    assert not false_accepts
    assert not false_rejects


HOSTILE = [c for c in CASES if c["kind"] == "hostile"]


@pytest.mark.parametrize("case", HOSTILE, ids=[c["id"] for c in HOSTILE])
def test_hostile_decided_right_in_a_thread_within_deadline(case):
    out: list = []
    th = threading.Thread(target=lambda: out.append(grade(case["pred"], case["gold"], timeout_s=3.0)))
    t = time.monotonic()
    th.start()
    th.join(60)
    elapsed = time.monotonic() - t
    assert out, "grade did not return"
    assert out[0].correct is case["expected"], out[0]
    assert elapsed < HOSTILE_BUDGET_S, elapsed
