"""Deterministic generator of easy math problems with exact answers (the embedded default data).

The embedded student (SmolLM2-135M-Instruct) cannot solve MATH problems, so the CPU demo uses a
ladder of easy ones whose difficulty spreads its pass rate between 0 and 1 (design.md section 8
measured 0.04-0.29 by level on addition-style problems). Levels:

1. one-digit addition            4. fractions, percentages, two-digit x one-digit
2. two-digit addition/subtraction 5. linear equations, two-step expressions
3. one-digit multiplication, sums of three numbers

Each problem is assigned to the ``train`` or ``test`` split by a hash of its text, so the splits
are disjoint however many problems are drawn from each, and a given ``(split, n, seed)`` always
yields the same rows.
"""

from __future__ import annotations

import hashlib
import random
from fractions import Fraction

LEVELS = (1, 2, 3, 4, 5)


def _frac_tex(q: Fraction) -> str:
    """Exact answer as a string: an integer, or ``\\frac{p}{q}`` (sign in front)."""
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _problem(level: int, rng: random.Random) -> tuple[str, str, str]:
    """One problem of ``level``: (problem text, exact answer, worked solution)."""
    r = rng.randint
    if level == 1:
        a, b = r(1, 9), r(1, 19)
        return f"What is {a} + {b}?", str(a + b), f"{a} + {b} = {a + b}."
    if level == 2:
        a, b = r(10, 99), r(10, 99)
        if rng.random() < 0.5:
            return f"What is {a} + {b}?", str(a + b), f"{a} + {b} = {a + b}."
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", str(a - b), f"{a} - {b} = {a - b}."
    if level == 3:
        if rng.random() < 0.5:
            a, b = r(2, 9), r(2, 9)
            return f"What is {a} times {b}?", str(a * b), f"{a} x {b} = {a * b}."
        a, b, c = r(2, 30), r(2, 30), r(2, 30)
        return f"What is {a} + {b} + {c}?", str(a + b + c), f"{a} + {b} = {a + b}; {a + b} + {c} = {a + b + c}."
    if level == 4:
        kind = rng.choice(["frac", "pct", "mul"])
        if kind == "frac":
            d = r(2, 9)
            a, b = r(1, d - 1) if d > 2 else 1, r(1, d - 1) if d > 2 else 1
            s = Fraction(a, d) + Fraction(b, d)
            return (f"What is {a}/{d} + {b}/{d}? Give the answer as a fraction in lowest terms or an integer.",
                    _frac_tex(s), f"{a}/{d} + {b}/{d} = {a + b}/{d} = {s}.")
        if kind == "pct":
            p, base = rng.choice([10, 20, 25, 50]), r(1, 20) * 20
            v = p * base // 100
            return f"What is {p}% of {base}?", str(v), f"{p}% of {base} = {p}/100 x {base} = {v}."
        a, b = r(11, 49), r(2, 9)
        return f"What is {a} times {b}?", str(a * b), f"{a} x {b} = {a * b}."
    # level 5
    if rng.random() < 0.5:
        a, x, b = r(2, 9), r(1, 12), r(1, 20)
        c = a * x + b
        return (f"Solve for x: {a}x + {b} = {c}.", str(x),
                f"{a}x = {c} - {b} = {c - b}, so x = {c - b}/{a} = {x}.")
    a, b, c = r(2, 12), r(2, 12), r(2, 20)
    return f"What is {a} times {b}, plus {c}?", str(a * b + c), f"{a} x {b} = {a * b}; {a * b} + {c} = {a * b + c}."


def _split_of(text: str) -> str:
    """Stable split assignment: 1 in 5 problem texts (by SHA-1) is held out as ``test``."""
    return "test" if int(hashlib.sha1(text.encode()).hexdigest(), 16) % 5 == 0 else "train"


def generate(split: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct problems of ``split`` ("train" or "test"), levels cycling 1..5.

    Returns rows with ``problem_id`` (``synth-<split>-<sha1[:10]>``), ``problem``, ``answer``,
    ``solution`` (worked, ending in ``\\boxed{answer}``), ``source`` ("synth") and ``level``.

    Raises:
        ValueError: unknown split, or ``n`` larger than the distinct problems the ladder can make.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"opd-synth-{seed}")
    seen: set[str] = set()
    rows: list[dict] = []
    exhausted: set[int] = set()
    turn = misses = 0
    while len(rows) < n:
        live = [lv for lv in LEVELS if lv not in exhausted]
        if not live:
            raise ValueError(f"could not draw {n} distinct {split} problems (got {len(rows)})")
        level = live[turn % len(live)]
        problem, answer, solution = _problem(level, rng)
        if problem in seen or _split_of(problem) != split:
            misses += 1
            if misses > 2000:  # this level's small problem space is used up: go on without it
                exhausted.add(level)
                misses = 0
            continue
        turn, misses = turn + 1, 0
        seen.add(problem)
        pid = hashlib.sha1(problem.encode()).hexdigest()[:10]
        rows.append({"problem_id": f"synth-{split}-{pid}", "problem": problem, "answer": answer,
                     "solution": f"{solution} The answer is \\boxed{{{answer}}}.", "source": "synth",
                     "level": str(level)})
    return rows
