"""bench.memory_steps: the slope, its t-interval and the flat / not-flat rule against plain references."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from bench import memory_steps as ms


def test_slope_interval_against_numpy():
    rng = random.Random(0)
    x = list(range(1, 61))
    y = [3.0 + 0.002 * i + rng.gauss(0, 0.01) for i in x]
    b, lo, hi, df = ms.slope_interval(x, y)
    ref_b, ref_a = np.polyfit(x, y, 1)
    resid = np.array(y) - (ref_b * np.array(x) + ref_a)
    se = np.sqrt(resid @ resid / (len(x) - 2) / np.sum((np.array(x) - np.mean(x)) ** 2))
    assert b == pytest.approx(ref_b, rel=1e-9) and df == 58
    assert hi - b == pytest.approx(2.0017 * se, rel=2e-3) and b - lo == pytest.approx(hi - b)


def _run(tmp_path, per_step_gib: float, n: int = 60):
    run = tmp_path / f"run{per_step_gib}-{n}"
    (run / "metrics").mkdir(parents=True)
    rng = random.Random(1)
    lines = [{"step": s, "loss": 1.0, "sft/off_policy_step": 1.0, "memory/allocated_gib": 9.0} for s in range(1, 4)]
    lines += [{"step": s, "loss": 1.0, "sft/off_policy_step": 0.0,
               "memory/allocated_gib": 20.0 + per_step_gib * s + rng.gauss(0, 0.002),
               "memory/step_peak_gib": 40.0 + rng.uniform(0, 5)} for s in range(4, 4 + n)]
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_flat_and_climbing_runs_are_told_apart(tmp_path, capsys):
    flat = _run(tmp_path, 0.0)
    assert ms.main([str(flat)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**Memory flat** over on-policy steps 9-63 (55 steps, the first 5 skipped)")
    # a climb once seen: 0.13 GiB a step is ~234 GiB over 1,800 steps
    climb = _run(tmp_path, 0.13)
    assert ms.main([str(climb), "--md", str(tmp_path / "r.md")]) == 1
    res = ms.judge(ms.read_steps(climb), skip=5, horizon_steps=1800, limit_gib=1.0)
    assert res["memory/allocated_gib"]["slope"] == pytest.approx(0.13, abs=1e-3) and res["growth_bound_gib"] > 230
    assert (tmp_path / "r.md").read_text().startswith("**Memory not flat**")
    # the SFT steps are not judged, and too few on-policy steps say so
    assert ms.main([str(_run(tmp_path, 0.0, n=12))]) == 2 and "too few steps" in capsys.readouterr().out
    assert ms.main([str(tmp_path / "nowhere")]) == 2
