"""Is a run's memory flat over its steps? Reads a training run's ``metrics/train.jsonl`` (``memory/allocated_gib``:
held at each step's end; ``memory/step_peak_gib``: the step's own peak; ``trainers.model_utils.StepMemory``) and fits
a line to each over the on-policy steps (the question: is memory per step flat over >= 50 steps, or where does it climb).

    python -m bench.memory_steps RUN_DIR [--skip 5] [--horizon-steps 1800] [--limit-gib 1.0] [--md OUT.md]

The rule, set before any run: memory is **flat** when the upper end of the 95% t-interval of the slope of
``allocated_gib`` (GiB a step, ordinary least squares over the on-policy steps after the first ``--skip``,
df = n - 2), times ``--horizon-steps`` (the on-policy steps of a 12-hour formal run, ~250-1,800), stays under
``--limit-gib``. ``step_peak_gib`` varies with each step's lengths: its slope is reported, not judged. Exit 0 flat,
1 not flat, 2 too few steps (< 10 after the skip) or no memory columns (a CPU run logs only ``peak_gib``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from bench.stats import t_quantile


def slope_interval(x: list[float], y: list[float], level: float = 0.95) -> tuple[float, float, float, int]:
    """OLS slope of ``y`` on ``x`` with its two-sided ``level`` t-interval: ``(slope, low, high, df)``."""
    n = len(x)
    if n < 3:
        raise ValueError(f"a slope's interval needs >= 3 points, got {n}")
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    b = sum((a - mx) * (c - my) for a, c in zip(x, y)) / sxx
    resid = [c - my - b * (a - mx) for a, c in zip(x, y)]
    se = math.sqrt(sum(r * r for r in resid) / (n - 2) / sxx)
    t = t_quantile(0.5 + level / 2, n - 2)
    return b, b - t * se, b + t * se, n - 2


def read_steps(run: Path) -> list[dict]:
    """The on-policy step rows of ``run/metrics/train.jsonl`` that carry the GPU memory columns."""
    path = run / "metrics" / "train.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics of a training run")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r and r.get("sft/off_policy_step") != 1.0
            and r.get("memory/allocated_gib") is not None]


def judge(rows: list[dict], *, skip: int, horizon_steps: int, limit_gib: float) -> dict:
    """The fits and the verdict of the rule in the module docstring."""
    used = rows[skip:]
    if len(used) < 10:
        return {"steps": len(used), "verdict": "too few steps", "flat": None}
    x = [float(r["step"]) for r in used]
    out = {"steps": len(used), "first_step": int(x[0]), "last_step": int(x[-1]), "skip": skip,
           "horizon_steps": horizon_steps, "limit_gib": limit_gib}
    for key in ("memory/allocated_gib", "memory/step_peak_gib"):
        y = [float(r[key]) for r in used if r.get(key) is not None]
        if len(y) != len(x):
            continue
        b, lo, hi, df = slope_interval(x, y)
        out[key] = {"slope": b, "low": lo, "high": hi, "df": df, "min": min(y), "max": max(y), "first": y[0],
                    "last": y[-1]}
    a = out["memory/allocated_gib"]
    growth = max(a["high"], 0.0) * horizon_steps
    out["growth_bound_gib"] = growth
    out["flat"] = growth < limit_gib
    out["verdict"] = "flat" if out["flat"] else "not flat"
    return out


def markdown(res: dict, rows: list[dict], every: int = 10) -> str:
    """The verdict line, the fits and the per-step curve (every ``every``-th on-policy step)."""
    if res["flat"] is None:
        return f"memory over steps: {res['verdict']} ({res['steps']} on-policy steps after the skip; need >= 10)\n"
    a = res["memory/allocated_gib"]
    lines = [f"**Memory {res['verdict']}** over on-policy steps {res['first_step']}-{res['last_step']} "
             f"({res['steps']} steps, the first {res['skip']} skipped): `allocated_gib` slope "
             f"{a['slope'] * 1024:+.2f} MiB a step (95% t-interval {a['low'] * 1024:+.2f} to {a['high'] * 1024:+.2f}, "
             f"df {a['df']}); at most {res['growth_bound_gib']:.2f} GiB over {res['horizon_steps']} steps "
             f"(limit {res['limit_gib']:g} GiB).", "",
             "| series | first | last | min | max | slope MiB/step [95% CI] |", "|---|---|---|---|---|---|"]
    for key in ("memory/allocated_gib", "memory/step_peak_gib"):
        if key in res:
            f = res[key]
            lines.append(f"| `{key}` | {f['first']:.3f} | {f['last']:.3f} | {f['min']:.3f} | {f['max']:.3f} | "
                         f"{f['slope'] * 1024:+.2f} [{f['low'] * 1024:+.2f}, {f['high'] * 1024:+.2f}] |")
    lines += ["", "| step | allocated GiB | step peak GiB |", "|---|---|---|"]
    for i, r in enumerate(rows):
        if i % every == 0 or i == len(rows) - 1:
            peak = r.get("memory/step_peak_gib")
            lines.append(f"| {r['step']} | {r['memory/allocated_gib']:.3f} | "
                         f"{'' if peak is None else f'{peak:.3f}'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run's OUTPUT_DIR (with metrics/train.jsonl)")
    ap.add_argument("--skip", type=int, default=5, help="on-policy steps left out at the start (warm-up, compiles)")
    ap.add_argument("--horizon-steps", type=int, default=1800, help="steps the growth bound is projected over")
    ap.add_argument("--limit-gib", type=float, default=1.0, help="the growth over --horizon-steps judged flat")
    ap.add_argument("--md", type=Path, help="also write the markdown report here")
    a = ap.parse_args(argv)
    try:
        rows = read_steps(a.run)
    except FileNotFoundError as e:
        print(f"memory_steps: {e}", file=sys.stderr)
        return 2
    res = judge(rows, skip=a.skip, horizon_steps=a.horizon_steps, limit_gib=a.limit_gib)
    text = markdown(res, rows)
    print(text, end="")
    if a.md:
        a.md.write_text(text)
    return 2 if res["flat"] is None else (0 if res["flat"] else 1)


if __name__ == "__main__":
    sys.exit(main())
