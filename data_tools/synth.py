"""Deterministic generators of math problems with exact answers and worked solutions.

The embedded student (SmolLM2-135M-Instruct) cannot solve MATH problems, so the CPU demo uses a
ladder of easy ones whose difficulty spreads its pass rate between 0 and 1 (docs/design.md section 8
measured 0.04-0.29 by level on addition-style problems). Ladder ``easy`` (source ``synth:``):

1. one-digit addition            4. fractions, percentages, two-digit x one-digit
2. two-digit addition/subtraction 5. linear equations, two-step expressions
3. one-digit multiplication, sums of three numbers

Ladder ``hard`` (source ``synth-hard:``), for the learning-efficacy experiment (bench/learning.py), where
reward-only training on easy arithmetic saturated in five GPU minutes: every problem needs two or
more dependent steps, and each worked solution spells the steps out (what a small teacher can learn
to imitate and a student cannot guess in one token):

1. precedence: a + b x c, a x b - c   4. fractions with unlike denominators (reduced)
2. multi-digit x one-digit            5. two-step word problems (five templates)
3. a x b - c x d                      6. two-digit x two-digit

Each problem is assigned to the ``train`` or ``test`` split by a hash of its text, so the splits
are disjoint however many problems are drawn from each, and a given ``(split, n, seed)`` always
yields the same rows.
"""

from __future__ import annotations

import hashlib
import random
from fractions import Fraction

LEVELS = (1, 2, 3, 4, 5)
HARD_LEVELS = (1, 2, 3, 4, 5, 6)
LADDERS = ("easy", "hard")


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


def _mul_steps(a: int, b: int) -> str:
    """Worked product of ``a`` and a one- or two-digit ``b`` by place value: ``47 x 6 = 40 x 6 + 7 x 6 = ...``."""
    if b < 10:  # split the multi-digit a into its tens part and units
        hi, lo = a - a % 10, a % 10
        if lo == 0:
            return f"{a} x {b} = {a * b}"
        return f"{a} x {b} = {hi} x {b} + {lo} x {b} = {hi * b} + {lo * b} = {a * b}"
    hi, lo = b - b % 10, b % 10
    if lo == 0:
        return f"{a} x {b} = {a} x {b // 10} x 10 = {a * (b // 10)} x 10 = {a * b}"
    return f"{a} x {b} = {a} x {hi} + {a} x {lo} = {a * hi} + {a * lo} = {a * b}"


_NAMES = ("Sam", "Mia", "Ali", "Zoe", "Ben", "Ana", "Leo", "Ivy")


def _hard_problem(level: int, rng: random.Random) -> tuple[str, str, str]:
    """One problem of the hard ladder's ``level``: (problem text, exact answer, worked solution)."""
    r = rng.randint
    if level == 1:
        a, b, c = r(2, 60), r(2, 12), r(2, 12)
        if rng.random() < 0.5:
            return (f"What is {a} + {b} x {c}?", str(a + b * c),
                    f"Multiply first: {b} x {c} = {b * c}. Then {a} + {b * c} = {a + b * c}.")
        a, b = r(2, 12), r(2, 12)
        c = r(1, a * b - 1)  # keep the result positive
        return (f"What is {a} x {b} - {c}?", str(a * b - c),
                f"Multiply first: {a} x {b} = {a * b}. Then {a * b} - {c} = {a * b - c}.")
    if level == 2:
        a, b = r(12, 999), r(3, 9)
        if a % 10 == 0:
            a += 1
        return f"What is {a} x {b}?", str(a * b), f"{_mul_steps(a, b)}."
    if level == 3:
        a, b, c, d = r(3, 20), r(2, 9), r(2, 12), r(2, 9)
        if a * b <= c * d:
            a, b, c, d = c, d, a, b
        if a * b == c * d:
            a += 1
        return (f"What is {a} x {b} - {c} x {d}?", str(a * b - c * d),
                f"{a} x {b} = {a * b}. {c} x {d} = {c * d}. {a * b} - {c * d} = {a * b - c * d}.")
    if level == 4:
        b, d = rng.sample(range(2, 13), 2)
        a, c = r(1, b - 1), r(1, d - 1)
        num, den = a * d + c * b, b * d
        s = Fraction(num, den)
        steps = f"{a}/{b} + {c}/{d} = ({a} x {d} + {c} x {b})/({b} x {d}) = {num}/{den}"
        if (s.numerator, s.denominator) != (num, den):
            steps += f" = {s.numerator}/{s.denominator}" if s.denominator != 1 else f" = {s.numerator}"
        return (f"What is {a}/{b} + {c}/{d}? Give the answer as a fraction in lowest terms or an integer.",
                _frac_tex(s), f"{steps}.")
    if level == 5:
        name = rng.choice(_NAMES)
        kind = rng.randrange(5)
        if kind == 0:
            a, b = r(6, 24), r(3, 9)
            c = r(1, a * b - 1)
            return (f"A box holds {a} pencils. {name} buys {b} boxes and then gives away {c} pencils. "
                    f"How many pencils does {name} have now?", str(a * b - c),
                    f"{b} x {a} = {a * b} pencils. {a * b} - {c} = {a * b - c}.")
        if kind == 1:
            a, b = r(3, 15), r(2, 9)
            m = next(x for x in (20, 50, 100, 200) if x > a * b)
            return (f"A ticket costs {a} dollars. {name} buys {b} tickets and pays with a {m}-dollar bill. "
                    f"How much change does {name} get, in dollars?", str(m - a * b),
                    f"{b} x {a} = {a * b} dollars. {m} - {a * b} = {m - a * b}.")
        if kind == 2:
            k, q = r(2, 9), r(3, 12)
            e = r(1, q - 1)
            return (f"{k * q} cookies are shared equally among {k} children, and each child eats {e} of them. "
                    f"How many cookies does each child have left?", str(q - e),
                    f"{k * q} / {k} = {q} cookies each. {q} - {e} = {q - e}.")
        if kind == 3:
            v, t, d = r(20, 90), r(2, 6), r(5, 60)
            return (f"A train travels at {v} km per hour for {t} hours, then {d} km more. "
                    f"How many km does it travel in total?", str(v * t + d),
                    f"{v} x {t} = {v * t} km. {v * t} + {d} = {v * t + d}.")
        p, a, b = r(2, 9), r(2, 9), r(2, 9)
        return (f"{name} buys {a} notebooks and {b} pens. Each item costs {p} dollars. "
                f"How much does {name} pay in total, in dollars?", str(p * (a + b)),
                f"{a} + {b} = {a + b} items. {a + b} x {p} = {p * (a + b)}.")
    a, b = r(11, 99), r(11, 99)
    return f"What is {a} x {b}?", str(a * b), f"{_mul_steps(a, b)}."


def _split_of(text: str) -> str:
    """Stable split assignment: 1 in 5 problem texts (by SHA-1) is held out as ``test``."""
    return "test" if int(hashlib.sha1(text.encode()).hexdigest(), 16) % 5 == 0 else "train"


def generate(split: str, n: int, seed: int = 0, ladder: str = "easy") -> list[dict]:
    """``n`` distinct problems of ``split`` ("train" or "test"), levels cycling through the ladder's.

    Returns rows with ``problem_id`` (``synth-<split>-<sha1[:10]>``, ``synth-hard-...`` for the hard
    ladder), ``problem``, ``answer``, ``solution`` (worked, ending in ``\\boxed{answer}``), ``source``
    ("synth" / "synth-hard") and ``level``.

    Raises:
        ValueError: unknown split or ladder, or ``n`` larger than the distinct problems the ladder can make.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if ladder not in LADDERS:
        raise ValueError(f"ladder must be one of {LADDERS}, got {ladder!r}")
    make, levels = (_problem, LEVELS) if ladder == "easy" else (_hard_problem, HARD_LEVELS)
    prefix = "synth" if ladder == "easy" else "synth-hard"
    # the easy ladder keeps its original seed string, so existing runs draw the same problems
    rng = random.Random(f"opd-synth-{seed}" if ladder == "easy" else f"opd-synth-{ladder}-{seed}")
    seen: set[str] = set()
    rows: list[dict] = []
    exhausted: set[int] = set()
    turn = misses = 0
    while len(rows) < n:
        live = [lv for lv in levels if lv not in exhausted]
        if not live:
            raise ValueError(f"could not draw {n} distinct {split} problems (got {len(rows)})")
        level = live[turn % len(live)]
        problem, answer, solution = make(level, rng)
        if problem in seen or _split_of(problem) != split:
            misses += 1
            if misses > 2000:  # this level's small problem space is used up: go on without it
                exhausted.add(level)
                misses = 0
            continue
        turn, misses = turn + 1, 0
        seen.add(problem)
        pid = hashlib.sha1(problem.encode()).hexdigest()[:10]
        rows.append({"problem_id": f"{prefix}-{split}-{pid}", "problem": problem, "answer": answer,
                     "solution": f"{solution} The answer is \\boxed{{{answer}}}.", "source": prefix,
                     "level": str(level)})
    return rows


#: DAPO-Math-17k's user message around a problem, as the formal TRAIN_DATA carries it (verl format).
DAPO_WRAPPER = ("Solve the following math problem step by step. The last line of your response should be of the form "
                "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                "Remember to put your answer on its own line after \"Answer:\".")


def write_verl_parquet(rows: list[dict], path) -> None:
    """``rows`` (``generate``'s) as a verl-format parquet with the Arrow types of the formal ``TRAIN_DATA``:
    ``data_source``, ``prompt`` (list<struct<role, content>>, one user message in DAPO's wrapper), ``ability``,
    ``reward_model`` (struct<ground_truth, style>) and ``extra_info`` (struct<index>)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    msg = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(msg)), ("ability", pa.string()),
                        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
                        ("extra_info", pa.struct([("index", pa.int64())]))])
    table = pa.Table.from_pylist([{
        "data_source": r.get("source", "synth"),
        "prompt": [{"content": DAPO_WRAPPER.format(problem=r["problem"]), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(r["answer"]), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": i},
    } for i, r in enumerate(rows)], schema=schema)
    pq.write_table(table, str(path))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m data_tools.synth",
                                 description="Write generated problems to a file (a stand-in for a real data set).")
    ap.add_argument("--split", default="train", choices=("train", "test"))
    ap.add_argument("--n", type=int, default=60, help="how many problems")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ladder", default="easy", choices=LADDERS)
    ap.add_argument("--verl", metavar="OUT.parquet", required=True,
                    help="write the verl format of the formal TRAIN_DATA (DAPO's prompt wrapper, reward_model)")
    a = ap.parse_args(argv)
    rows = generate(a.split, a.n, a.seed, a.ladder)
    write_verl_parquet(rows, a.verl)
    print(f"{len(rows)} {a.ladder} {a.split} problems -> {a.verl} (verl format)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
