"""Grader speed and fidelity: ours (data_tools.grader) vs plain math-verify, same answers, one run.

Run: ``python bench/grader_bench.py [--reps N] [--gsm8k N]``

Workloads
- ``mixed``: the public answer-equivalence cases (../shared/grader_cases/public.jsonl, or
  $OPD_SHARED_DIR/grader_cases/public.jsonl) replicated ``--reps`` times (default 6 -> 348).
  Our grader caches worker verdicts by (gold, extracted answer), which replicated cases hit, as
  do repeated samples of one problem in curation; ``mixed-cold`` is one pass over the unique
  cases with the cache cleared, so both numbers are reported.
- ``math500``: MATH-500 reference solutions (full worked text ending in ``\\boxed{}``) graded
  against their own answers, problems 200-499 (disjoint from the warm-up), each once, cache
  cleared: unique competition-math answers of every kind (expressions, intervals, matrices...).
- ``integers``: GSM8K-style plain integer answers, "... The answer is N." with right and wrong
  N (gold from ../shared/data/gsm8k_test.jsonl when present, else synthetic).
- ``reports``: the public-report case set (tests/data/grader_reports.jsonl, each case citing the bug
  report or test it comes from), hostile cases left out, cache cleared. Plain math-verify is not
  told which completions were truncated; ours is.
- ``hostile``: that set's hostile cases (megabyte outputs, deep nesting, power towers), ours only:
  plain math-verify can hang on them for good (Math-Verify #65).

Agreement without math-verify: the same workloads are graded once more in a subprocess that blocks
the import (``sys.modules["math_verify"] = None``, ``--no-math-verify``), so the grader falls back to
its own LaTeX reader + sympy; the second table prints the agreement with and without it, and the
false accepts. Without math-verify installed at all, the plain math-verify columns print "-".

Plain math-verify is ``parse("$gold$")``, ``parse(pred)``, ``verify(gold, pred)`` with default
config (signal timeouts on, main thread), which is what docs/design.md section 8 timed (34.6/s).
Both are warmed up first on MATH-500 reference answers (see main). Timings are single-threaded (workers=1) for both, wall clock, answers per second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if "--no-math-verify" in sys.argv:  # before the grader is imported: it must find math-verify missing
    sys.modules["math_verify"] = None  # type: ignore[assignment]
    sys.modules["latex2sympy2_extended"] = None  # type: ignore[assignment]

from data_tools import grader  # noqa: E402


def shared_dir() -> Path:
    env = os.environ.get("OPD_SHARED_DIR")
    return Path(env) if env else REPO.parent / "shared"


def load_public() -> list[dict]:
    path = shared_dir() / "grader_cases" / "public.jsonl"
    if not path.exists():
        sys.exit(f"missing {path}: set OPD_SHARED_DIR to the shared folder")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def integer_cases(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    golds: list[str] = []
    path = shared_dir() / "data" / "gsm8k_test.jsonl"
    if path.exists():
        for line in path.read_text().splitlines()[:n]:
            g = grader.extract_gsm8k_answer(json.loads(line)["answer"])
            if g:
                golds.append(g)
    while len(golds) < n:
        golds.append(str(rng.randint(0, 100000)))
    cases = []
    for i, g in enumerate(golds):
        right = i % 2 == 0
        ans = g if right else str(int(float(g)) + rng.randint(1, 9))
        pred = f"She sells 16 - 3 - 4 = 9 eggs and earns 9 * 2 = 18 dollars.\nThe answer is {ans}."
        cases.append({"gold": g, "pred": pred, "expected": right})
    return cases


def math500_cases(start: int = 200) -> list[dict]:
    path = shared_dir() / "data" / "math500_test.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()[start:]]
    return [{"gold": r["answer"], "pred": r["solution"], "expected": True} for r in rows]


def warmup_answers(n: int) -> list[str]:
    path = shared_dir() / "data" / "math500_test.jsonl"
    if not path.exists() or n <= 0:
        return ["x^2", "\\frac{1}{2}", "(1,2)", "\\sqrt{3}"]
    return [json.loads(line)["answer"] for line in path.read_text().splitlines()[:n]]


def have_math_verify() -> bool:
    return grader.sandbox.backend() == "math_verify"


def plain_warm(answers: list[str]) -> None:
    if not have_math_verify():
        return
    from math_verify import parse, verify

    for a in answers:
        try:
            verify(parse(f"${a}$"), parse(f"${a}$"))
        except Exception:  # noqa: BLE001
            pass


def run_plain(cases: list[dict]) -> tuple[float, float]:
    from math_verify import parse, verify

    t = time.perf_counter()
    agree = 0
    for c in cases:
        try:
            ok = verify(parse(f"${c['gold']}$"), parse(c["pred"]))
        except Exception:  # noqa: BLE001
            ok = False
        agree += ok == c["expected"]
    dt = time.perf_counter() - t
    return len(cases) / dt, agree / len(cases)


def report_cases() -> tuple[list[dict], list[dict]]:
    """(non-hostile, hostile) cases of tests/data/grader_reports.jsonl, ``pred_build`` expanded."""
    rows = [json.loads(line) for line in (REPO / "tests" / "data" / "grader_reports.jsonl").read_text().splitlines()
            if line.strip()]
    for r in rows:
        for key in ("pred", "gold"):
            if f"{key}_build" in r:
                r[key] = "".join(text * n for text, n in r[f"{key}_build"])
    return [r for r in rows if r["kind"] != "hostile"], [r for r in rows if r["kind"] == "hostile"]


def run_ours(cases: list[dict], clear_cache: bool) -> tuple[float, float, dict, int]:
    if clear_cache:
        with grader.sandbox._CACHE_LOCK:
            grader.sandbox._CACHE.clear()
    paths: dict[str, int] = {}
    t = time.perf_counter()
    vs = grader.grade_batch([c["pred"] for c in cases], [c["gold"] for c in cases],
                            truncated=[c.get("truncated", False) for c in cases], workers=1)
    dt = time.perf_counter() - t
    agree = sum(v.correct == c["expected"] for v, c in zip(vs, cases))
    false_accepts = sum(v.correct and not c["expected"] for v, c in zip(vs, cases))
    for v in vs:
        paths[v.path] = paths.get(v.path, 0) + 1
    return len(cases) / dt, agree / len(cases), paths, false_accepts


def without_math_verify(argv: list[str]) -> dict:
    """{workload: (agreement, false accepts)} from a subprocess in which math-verify cannot be imported."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--no-math-verify", *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"grader_bench: the run without math-verify failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=6, help="replications of the public cases")
    ap.add_argument("--gsm8k", type=int, default=300, help="number of integer-answer cases")
    ap.add_argument("--warmup", type=int, default=200, help="MATH-500 answers to warm up on")
    ap.add_argument("--no-math-verify", action="store_true",
                    help="grade as if math-verify were not installed and print only the agreement per workload "
                         "(JSON); the normal run calls itself this way for its second table")
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    public = load_public()
    workloads = {
        "mixed-cold": (public, True),
        "mixed": (public * args.reps, False),
        "integers": (integer_cases(args.gsm8k), True),
    }
    if math500_cases():
        workloads["math500"] = (math500_cases(args.warmup), True)
    reports, hostile = report_cases()
    workloads["reports"] = (reports, True)
    workloads["hostile"] = (hostile, True)
    if args.no_math_verify:
        out = {}
        for name, (cases, cold) in workloads.items():
            _, agree, _, fa = run_ours(cases, clear_cache=cold)
            out[name] = (agree, fa)
        grader.sandbox._POOL.close()
        print(json.dumps(out))
        return
    # Warm both sides on answers disjoint from the timed ones (MATH-500 references): ANTLR,
    # which latex2sympy parses with, builds its prediction tables lazily, so the first parses
    # of each construct are several times slower than steady state in a long curation run.
    warm = warmup_answers(args.warmup)
    t = time.perf_counter()
    plain_warm(warm)
    t_plain_warm = time.perf_counter() - t
    t = time.perf_counter()
    for a in warm:
        grader.parse_gold(a)
    t_ours_warm = time.perf_counter() - t
    with grader.sandbox._CACHE_LOCK:
        grader.sandbox._CACHE.clear()
    print(f"warm-up on {len(warm)} MATH-500 answers: plain {t_plain_warm:.1f} s, "
          f"ours {t_ours_warm:.1f} s (incl. worker start)")

    print(f"{'workload':<11} {'n':>5} {'plain a/s':>10} {'ours a/s':>10} {'ratio':>7} "
          f"{'plain agree':>11} {'ours agree':>10}  ours paths")
    with_mv: dict = {}
    for name, (cases, cold) in workloads.items():
        if name == "hostile" or not have_math_verify():
            o_rate, o_agree, paths, fa = run_ours(cases, clear_cache=cold)
            with_mv[name] = (o_agree, fa)
            print(f"{name:<11} {len(cases):>5} {'-':>10} {o_rate:>10.1f} {'-':>7} {'-':>11} {o_agree:>10.3f}  "
                  f"{json.dumps(paths)}  ({len(cases) / o_rate:.1f} s in all)")
            continue
        p_rate, p_agree = run_plain(cases)
        o_rate, o_agree, paths, fa = run_ours(cases, clear_cache=cold)
        with_mv[name] = (o_agree, fa)
        print(f"{name:<11} {len(cases):>5} {p_rate:>10.1f} {o_rate:>10.1f} {o_rate / p_rate:>6.1f}x "
              f"{p_agree:>11.3f} {o_agree:>10.3f}  {json.dumps(paths)}")
    grader.sandbox._POOL.close()

    label = "with math-verify" if have_math_verify() else "(math-verify not installed)"
    without = without_math_verify([f"--reps={args.reps}", f"--gsm8k={args.gsm8k}", f"--warmup={args.warmup}"])
    print(f"\nagreement of ours {label} / without it (import blocked in a subprocess: own LaTeX reader + sympy)")
    print(f"{'workload':<11} {'n':>5} {'with':>7} {'without':>8}  false accepts with / without")
    for name, (cases, _) in workloads.items():
        (a1, f1), (a2, f2) = with_mv[name], without[name]
        print(f"{name:<11} {len(cases):>5} {a1:>7.3f} {a2:>8.3f}  {f1} / {f2}")


if __name__ == "__main__":
    main()
