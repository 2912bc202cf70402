"""Evaluation statistics: pass@1 over k samples, its standard error over problems, clip rate, pass@k.

Pure functions over a per-sample table (rows with ``problem_id``, ``correct``, ``finish_reason``),
so the numbers in ``summary.json`` can be recomputed from ``samples.parquet`` with duckdb.

Conventions (docs/design.md section 7; lm-evaluation-harness for the standard error):

- **pass@1** = mean correctness over *all* samples. With the same k samples per problem this equals
  the mean of the per-problem pass rates.
- **stderr** = sample standard deviation (``ddof=1``, as lm-evaluation-harness's
  ``sample_stddev``) of the per-problem pass rates, divided by ``sqrt(n_problems)``. The problem is
  the unit of sampling (a benchmark is a draw of questions); the k samples of one problem only
  sharpen that problem's rate. ``None`` for fewer than two problems.
- **clip rate** = share of samples whose generation hit the token cap (``finish_reason ==
  "length"``); they are graded as produced, not dropped.
- **pass@k** = the unbiased estimator of Chen et al. 2021 (Codex paper), averaged over problems:
  ``1 - C(n - c, k) / C(n, k)`` for a problem with ``n`` samples of which ``c`` are correct.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterable, Mapping, Sequence

STDERR_METHOD = "sample std (ddof=1) of per-problem pass rates / sqrt(n_problems)"


def per_problem_rates(rows: Iterable[Mapping]) -> "OrderedDict[str, tuple[int, int]]":
    """``problem_id -> (n_samples, n_correct)`` in first-seen order."""
    out: OrderedDict[str, list[int]] = OrderedDict()
    for r in rows:
        acc = out.setdefault(str(r["problem_id"]), [0, 0])
        acc[0] += 1
        acc[1] += int(bool(r["correct"]))
    return OrderedDict((k, (n, c)) for k, (n, c) in out.items())


def mean_pass_at_1(rows: Sequence[Mapping]) -> float | None:
    """Mean correctness over all samples; ``None`` for an empty table."""
    if not rows:
        return None
    return sum(int(bool(r["correct"])) for r in rows) / len(rows)


def stderr_over_problems(rates: Sequence[float]) -> float | None:
    """Sample std (ddof=1) of per-problem pass rates / sqrt(n_problems); ``None`` if fewer than 2."""
    n = len(rates)
    if n < 2:
        return None
    mean = sum(rates) / n
    var = sum((x - mean) ** 2 for x in rates) / (n - 1)
    return math.sqrt(var) / math.sqrt(n)


def clip_rate(finish_reasons: Sequence[str]) -> float | None:
    """Share of samples that hit the generation cap (``finish_reason == "length"``)."""
    if not finish_reasons:
        return None
    return sum(1 for f in finish_reasons if f == "length") / len(finish_reasons)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` correct (Chen et al. 2021).

    Raises:
        ValueError: ``k > n`` or counts out of range.
    """
    if not (0 <= c <= n) or k < 1 or k > n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k/i): the numerically stable form from the paper's code
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def summarize(rows: Sequence[Mapping]) -> dict:
    """All headline numbers for a per-sample table (see the module docstring for definitions).

    Returns keys: ``pass_at_1``, ``pass_at_1_stderr``, ``stderr_method``, ``clip_rate``,
    ``n_problems``, ``n_samples``, ``samples_per_problem`` (min, max), ``pass_at_k`` (k -> value for
    k = 1, 2, 4, ... up to the smallest per-problem sample count), ``problems_all_correct``,
    ``problems_none_correct``.
    """
    counts = per_problem_rates(rows)
    rates = [c / n for n, c in counts.values()]
    ns = [n for n, _ in counts.values()]
    kmax = min(ns) if ns else 0
    ks = sorted({k for k in (2**i for i in range(0, 12)) if k <= kmax} | ({kmax} if kmax else set()))
    return {
        "pass_at_1": mean_pass_at_1(rows),
        "pass_at_1_stderr": stderr_over_problems(rates),
        "stderr_method": STDERR_METHOD,
        "clip_rate": clip_rate([r["finish_reason"] for r in rows]),
        "n_problems": len(counts),
        "n_samples": len(rows),
        "samples_per_problem": [min(ns), max(ns)] if ns else [0, 0],
        "pass_at_k": {str(k): sum(pass_at_k(n, c, k) for n, c in counts.values()) / len(counts) for k in ks},
        "problems_all_correct": sum(1 for n, c in counts.values() if c == n),
        "problems_none_correct": sum(1 for n, c in counts.values() if c == 0),
    }
