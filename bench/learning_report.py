"""Reports of bench/learning.py: per-mark summaries, paired differences, results.md, the plot.

Reads ``<out>/evals/*.parquet`` (one row per mark x problem x sample); ``cfg`` is a
``bench.learning_config.LearningConfig`` (its ``label`` names arms, its marks and filters shape the tables).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
from pathlib import Path

from bench.learning_config import ARM_SPECS, HANDOVER_MARK, LearningConfig
from bench.stats import t_quantile


def summarize_mark(rows: list[dict], answer_filter: str | None = None) -> dict:
    """avg@k, its standard error over problems, clip rate and mean completion tokens of one mark's rows.

    ``answer_filter``: read ``correct_<filter>`` instead of ``correct``. ``step`` and ``train_s`` are the largest
    over the rows; ``step_min`` the smallest, which differs from ``step`` when the rows pool several seeds of one arm.
    """
    from data_tools.evalstats import summarize

    if answer_filter:
        rows = [{**r, "correct": r[f"correct_{answer_filter}"]} for r in rows]
    s = summarize(rows)
    return dict(avg_at_k=s["pass_at_1"], stderr=s["pass_at_1_stderr"], clip_rate=s["clip_rate"],
                mean_tokens=sum(r["n_tokens"] for r in rows) / len(rows), n_problems=s["n_problems"],
                train_s=max(r["train_s"] for r in rows), step=max(r["step"] for r in rows),
                step_min=min(r["step"] for r in rows))


def paired_difference(rows_x: list[dict], rows_y: list[dict]) -> tuple[float, float | None, int]:
    """Mean over problems of (pass rate under x - pass rate under y), its standard error, problem count.

    The standard error is the sample std (ddof=1) of the per-problem differences / sqrt(n): the
    paired form, since every arm is evaluated on the same problems (the problem is the unit of
    sampling, as in ``data_tools.evalstats``). Only problems present in both are used.

    Raises:
        ValueError: no problem in common.
    """
    from data_tools.evalstats import per_problem_rates, stderr_over_problems

    rx, ry = per_problem_rates(rows_x), per_problem_rates(rows_y)
    common = [p for p in rx if p in ry]
    if not common:
        raise ValueError("the two evaluations share no problem")
    diffs = [rx[p][1] / rx[p][0] - ry[p][1] / ry[p][0] for p in common]
    return sum(diffs) / len(diffs), stderr_over_problems(diffs), len(common)


def seed_stderr(x: list[float], y: list[float]) -> float | None:
    """Standard error of mean(x) - mean(y) from the spread *between runs* (seeds): sqrt(s_x^2/n_x + s_y^2/n_y),
    sample variances (ddof=1), Welch's form; None unless both arms have >= 2 runs.

    The paired standard error over problems measures the evaluation's sampling only; two runs of one arm differ by
    more than it (bench/LEARNING.md, regime (ii): 3.3 of them), and this term is what seeds measure.
    """
    if len(x) < 2 or len(y) < 2:
        return None
    return (statistics.variance(x) / len(x) + statistics.variance(y) / len(y)) ** 0.5


def t_interval(d: float, se: float | None, df: float | None, level: float = 0.95) -> tuple[float, float] | None:
    """``d ± t_{(1+level)/2, df} x se``; None without a standard error or df."""
    if se is None or not df or df <= 0:
        return None
    h = t_quantile((1 + level) / 2, df) * se
    return d - h, d + h


def welch(x: list[float], y: list[float]) -> tuple[float, float] | None:
    """Standard error of mean(x) - mean(y) between runs (``seed_stderr``) and its Welch–Satterthwaite degrees of
    freedom ``(a + b)^2 / (a^2 / (n_x - 1) + b^2 / (n_y - 1))``, a = s_x^2 / n_x, b = s_y^2 / n_y; None unless both have
    >= 2 runs and some spread."""
    se = seed_stderr(x, y)
    if se is None or se == 0:
        return None
    a, b = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    return se, (a + b) ** 2 / (a * a / (len(x) - 1) + b * b / (len(y) - 1))


def _ci(d: float, se: float | None, df: float | None) -> str:
    """'95% t-interval lo to hi, df N' (df whole or to one decimal), or '' without one."""
    ci = t_interval(d, se, df)
    if ci is None:
        return ""
    dfs = f"{df:.0f}" if float(df).is_integer() else f"{df:.1f}"
    return f"95% t-interval {ci[0]:+.3f} to {ci[1]:+.3f}, df {dfs}"


def _compare(pooled: dict[str, list[dict]], start: list[dict]) -> tuple[str, dict[str, dict]]:
    """The best arm of ``pooled`` (arm -> its graded rows) by avg@k, and per arm: best − arm and arm − start,
    paired over problems, with their standard errors and degrees of freedom (problems − 1)."""
    best = max(pooled, key=lambda a: summarize_mark(pooled[a])["avg_at_k"])
    cmp = {}
    for arm, rows in pooled.items():
        d, se, n = paired_difference(pooled[best], rows) if arm != best else (0.0, None, 0)
        d0, se0, n0 = paired_difference(rows, start)
        cmp[arm] = {"best_minus_arm": d, "stderr": se, "n_sigma": (d / se) if se else None, "df": n - 1 if n else None,
                    "gain_over_start": d0, "gain_stderr": se0, "gain_df": n0 - 1}
    return best, cmp


def _collect(cfg: LearningConfig, evals: dict[str, list[dict]], f: str) -> dict:
    """Per-mark summaries under answer filter ``f``, the best arm at the last mark, paired comparisons.

    Runs of one arm that differ only in seed (``<arm>-s<seed>``) are pooled: per problem, the pass rate
    over all their samples; ``last_mark_by_run`` keeps each seed's own avg@k at the last mark.
    """
    base = evals["student"]
    out: dict = {"answer_filter": f, "student": summarize_mark(base, f), "arms": {}}
    if "teacher" in evals:
        out["teacher"] = summarize_mark(evals["teacher"], f)
    finals: dict[str, list[dict]] = {}
    groups: dict[str, list[str]] = {}
    for name in sorted(n for n in evals if n not in ("student", "teacher")):
        groups.setdefault(arm_group(name), []).append(name)
    for arm, names in groups.items():  # an arm's seeds pooled: every sample of every seed, per problem
        rows = [r for n in names for r in evals[n]]
        by_mark = {str(m): summarize_mark(mr, f) for m in cfg.mark_list if (mr := [r for r in rows if r["mark_s"] == m])}
        last_mark = [{**r, "correct": r[f"correct_{f}"]} for r in rows if r["mark_s"] == cfg.mark_list[-1]]
        per_seed = {n: summarize_mark([r for r in last_mark if r["name"] == n])["avg_at_k"] for n in names
                    if any(r["name"] == n for r in last_mark)}
        out["arms"][arm] = {"label": cfg.label(arm), "marks": by_mark, "runs": names, "last_mark_by_run": per_seed}
        if last_mark:
            finals[arm] = last_mark
    start = [{**r, "correct": r[f"correct_{f}"]} for r in base]
    if finals:  # paired comparisons at the last mark: the best arm against every other, each against the start
        out["best_arm"], out["comparisons_at_last_mark"] = _compare(finals, start)
    late_m = cfg.mark_list[-cfg.late_marks:] if cfg.late_marks else []
    by_run: dict[str, dict[str, list[dict]]] = {}  # arm -> run -> its late rows, for runs evaluated at every late mark
    for arm, names in groups.items():
        for n in names:
            rows = [{**r, "correct": r[f"correct_{f}"]} for r in evals[n] if r["mark_s"] in late_m]
            if late_m and {r["mark_s"] for r in rows} == set(late_m):
                by_run.setdefault(arm, {})[n] = rows
    if by_run:  # the late mean: per problem, the pass rate pooled over the last marks (every sample of every seed)
        late = {arm: [r for rows in runs.values() for r in rows] for arm, runs in by_run.items()}
        best, cmp = _compare(late, start)
        per_run = {arm: {n: summarize_mark(rows)["avg_at_k"] for n, rows in runs.items()} for arm, runs in by_run.items()}
        for arm, c in cmp.items():
            w = welch(list(per_run[best].values()), list(per_run[arm].values())) if arm != best else None
            c.update(late_mean=summarize_mark(late[arm])["avg_at_k"], by_run=per_run[arm],
                     seed_stderr=seed_stderr(list(per_run[best].values()), list(per_run[arm].values()))
                     if arm != best else None, seed_df=w[1] if w else None)
        out["late_mean"] = {"marks": late_m, "best_arm": best, "comparisons": cmp}
    sweep = rate_sweep(out, cfg)
    if sweep:
        out["rate_sweep"] = sweep
    if cfg.contrast_list:
        out["contrasts"] = contrasts(cfg, evals, groups, f, late_m)
    handover = {}  # per run of a sequential arm: its model at the hand-over, and what the on-policy steps did to it
    for name in sorted(n for n in evals if n not in ("student", "teacher")):
        ho = [{**r, "correct": r[f"correct_{f}"]} for r in evals[name] if r["mark_s"] == HANDOVER_MARK]
        last = [{**r, "correct": r[f"correct_{f}"]} for r in evals[name] if r["mark_s"] == cfg.mark_list[-1]]
        if not ho:
            spec = ARM_SPECS.get(cfg.parse_run(name)[0])
            if spec and spec.off_policy == "seq" and last:
                # a sequential run whose clock ended in its SFT passes: say so (LEARNING.md command 16 had two)
                handover[name] = {"reached": False, "last_step": max(r["step"] for r in last)}
            continue
        handover[name] = {"reached": True, **summarize_mark(ho)}
        if last:
            d, se, _ = paired_difference(last, ho)
            handover[name].update(last_avg_at_k=summarize_mark(last)["avg_at_k"], last_step=max(r["step"] for r in last),
                                  last_minus_handover=d, last_minus_handover_stderr=se)
    if handover:
        out["handover"] = handover
    shared = shared_handovers(evals, handover, f, cfg, late_m)
    if shared:
        out["shared_handovers"] = shared
    return out


def contrasts(cfg: LearningConfig, evals: dict[str, list[dict]], groups: dict[str, list[str]], f: str,
              late_m: list[float]) -> list[dict]:
    """``cfg.contrasts``' pairs x − y (arms: run names without the seed), each seeds pooled per problem and paired
    over problems (``paired_difference``), with df = problems − 1: at the last mark (``last``) and on the late mean
    (``late``: ``late_m``'s marks, runs evaluated at all of them); and ``between_runs``: the difference of the runs'
    mean late means with Welch's error and df (``welch``), where both arms have >= 2 such runs. A pair with an arm
    that has no runs is kept with ``missing`` naming it."""
    out = []
    for x0, y0 in cfg.contrast_list:
        x, y = cfg.canonical(x0), cfg.canonical(y0)
        item: dict = {"x": x, "y": y}
        missing = [a for a in (x, y) if a not in groups]
        if missing:
            out.append({**item, "missing": missing})
            continue

        def rows(arm, marks):
            return [{**r, "correct": r[f"correct_{f}"]} for n in groups[arm] for r in evals[n] if r["mark_s"] in marks]

        for key, marks in (("last", [cfg.mark_list[-1]]), ("late", late_m)):
            rx, ry = rows(x, marks), rows(y, marks)
            if marks and rx and ry:
                d, se, n = paired_difference(rx, ry)
                item[key] = {"marks": marks, "diff": d, "stderr": se, "df": n - 1,
                             "ci95": t_interval(d, se, n - 1)}

        def late_by_run(arm):
            got = {}
            for n in groups[arm]:
                r = [{**q, "correct": q[f"correct_{f}"]} for q in evals[n] if q["mark_s"] in late_m]
                if late_m and {q["mark_s"] for q in r} == set(late_m):
                    got[n] = summarize_mark(r)["avg_at_k"]
            return list(got.values())

        lx, ly = late_by_run(x), late_by_run(y)
        w = welch(lx, ly)
        if w:
            d = sum(lx) / len(lx) - sum(ly) / len(ly)
            item["between_runs"] = {"runs": [len(lx), len(ly)], "diff": d, "stderr": w[0], "df": w[1],
                                    "ci95": t_interval(d, *w)}
        out.append(item)
    return out


def setup_measures(cfg: LearningConfig, f: str) -> dict:
    """The setup's measurement before any arm (the gap a teacher must show first): teacher − start on the held-out problems, paired, with
    df = problems − 1; the problems the start fails (none of its samples right): how many, and the teacher's avg@k
    on them; and ``data/setup_kl.json`` (the per-token reverse KL of the start's samples under the teacher) when
    measured. Raises FileNotFoundError without both evaluations."""
    import pyarrow.parquet as pq

    ev = {n: [{**r, "correct": r[f"correct_{f}"]} for r in pq.read_table(cfg.dir / "evals" / f"{n}.parquet").to_pylist()]
          for n in ("student", "teacher")}
    s, t = summarize_mark(ev["student"]), summarize_mark(ev["teacher"])
    d, se, n = paired_difference(ev["teacher"], ev["student"])
    out = {"start": s["avg_at_k"], "teacher": t["avg_at_k"], "lead": d, "lead_stderr": se, "lead_df": n - 1,
           "lead_ci95": t_interval(d, se, n - 1), "start_tokens": s["mean_tokens"], "teacher_tokens": t["mean_tokens"],
           "start_clip": s["clip_rate"], "teacher_clip": t["clip_rate"]}
    from data_tools.evalstats import per_problem_rates

    failed = {p for p, (k, c) in per_problem_rates(ev["student"]).items() if c == 0}
    on = [r for r in ev["teacher"] if str(r["problem_id"]) in failed]
    out["start_fails"] = {"problems": len(failed), "of": n,
                          "teacher": summarize_mark(on)["avg_at_k"] if on else None,
                          "teacher_stderr": summarize_mark(on)["stderr"] if on else None}
    kl = cfg.dir / "data" / "setup_kl.json"
    if kl.exists():
        out["reverse_kl"] = json.loads(kl.read_text())
    return out


def setup_lines(m: dict, cfg: LearningConfig) -> list[str]:
    """``setup_measures`` as lines of text (results.md, and the setup's log)."""
    k = cfg.eval_samples
    ci = _ci(m["lead"], m["lead_stderr"], m["lead_df"])
    lines = [f"teacher − start on the {m['lead_df'] + 1} held-out problems: {m['lead']:+.3f} ± {_fmt(m['lead_stderr'])}"
             + (f" ({ci})" if ci else "") + f"; start {m['start']:.3f} ({m['start_tokens']:.0f} tokens, clip "
             f"{m['start_clip']:.2f}), teacher {m['teacher']:.3f} ({m['teacher_tokens']:.0f} tokens, clip "
             f"{m['teacher_clip']:.2f})"]
    sf = m["start_fails"]
    lines.append(f"on the {sf['problems']} held-out problems the start fails (0 of {k} samples right): teacher "
                 + (f"{sf['teacher']:.3f} ± {_fmt(sf['teacher_stderr'])}" if sf["teacher"] is not None else "—"))
    kl = m.get("reverse_kl")
    if kl:
        lines.append(f"per-token reverse KL of the start's samples under the teacher: {kl['kl_sampled']:.3f} nats "
                     f"(sampled-token estimate), {kl['kl_full']:.3f} exact over the vocabulary; {kl['tokens']} tokens "
                     f"of {kl['problems']} samples of the arms' problems at T={kl['temperature']:g}, "
                     f"{kl['max_new_tokens']}-token cap, {kl['clipped']} clipped")
    return lines


def shared_handovers(evals: dict[str, list[dict]], handover: dict[str, dict], f: str, cfg: LearningConfig,
                     late_m: list[float]) -> dict:
    """Sequential runs that handed over one model, and their on-policy phases compared from it.

    Two runs share a hand-over when they have the same seed and their evaluations at it (``mark_s =
    HANDOVER_MARK``) the same step and the same completion for every (problem, sample): one seed's SFT passes are
    deterministic, so ``j-s1`` and ``l-s1`` differ only in what follows (LEARNING.md command 17b). The seed is
    required because equal completions alone do not prove one model where they are few or degenerate (a toy run's
    all-clipped samples matched across seeds). For each pair ``a, b`` (in run-name order, so arm ``j`` before
    ``l``): ``a - b`` at the last mark (``cfg.mark_list[-1]``) and on the late mean (``late_m``'s marks pooled per
    problem), paired over problems (``paired_difference``), each only over marks where *both* runs had stepped past
    the hand-over (a mark at or before it is an SFT checkpoint, not the phase being compared; a slow machine hands
    over after the first late mark). For each two arms, the same pooled over their pairs that have the measure
    (every seed's samples per problem; >= 2 pairs), and ``between_pairs_stderr``, the standard deviation of those
    pairs' own late-mean differences / sqrt(pairs), the runs' variation that the paired error over problems leaves
    out. Differences are fractions of problems solved (pass rate), standard errors likewise; None where a pair has
    no such mark. Returns ``{"pairs": [...], "arms": [...]}``, or {} when no two runs share a hand-over.
    """
    def rows(n, marks):
        return [{**r, "correct": r[f"correct_{f}"]} for r in evals[n] if r["mark_s"] in marks]

    def stepped_past(n, step):  # the marks at which run n had made at least one on-policy step
        return {r["mark_s"] for r in evals[n] if r["mark_s"] != HANDOVER_MARK and r["step"] > step}

    last_mark = cfg.mark_list[-1]
    reached = sorted(n for n, h in handover.items() if h["reached"])
    ho = {n: {(r["problem_id"], r["sample_index"]): r["completion"] for r in evals[n] if r["mark_s"] == HANDOVER_MARK}
          for n in reached}
    pairs = []
    for i, a in enumerate(reached):
        for b in reached[i + 1:]:
            step = handover[a]["step"]
            if cfg.parse_run(a)[2] != cfg.parse_run(b)[2] or handover[b]["step"] != step or ho[a] != ho[b]:
                continue
            after = stepped_past(a, step) & stepped_past(b, step)
            pr = {"runs": [a, b], "step": step, "completions": len(ho[a]), "late_marks": [m for m in late_m if m in after],
                  "last_minus": None, "last_stderr": None, "late_minus": None, "late_stderr": None}
            if last_mark in after:
                pr["last_minus"], pr["last_stderr"], _ = paired_difference(rows(a, [last_mark]), rows(b, [last_mark]))
            if pr["late_marks"]:
                pr["late_minus"], pr["late_stderr"], _ = paired_difference(rows(a, pr["late_marks"]),
                                                                            rows(b, pr["late_marks"]))
            pairs.append(pr)
    by_arms: dict[tuple[str, str], list[dict]] = {}
    for pr in pairs:
        by_arms.setdefault(tuple(arm_group(n) for n in pr["runs"]), []).append(pr)
    arms = []
    for (ga, gb), prs in by_arms.items():
        x = {"arms": [ga, gb], "last_pairs": 0, "last_minus": None, "last_stderr": None, "late_pairs": 0,
             "late_minus": None, "late_stderr": None, "between_pairs_stderr": None}
        for key in ("last", "late"):  # each measure pooled over the pairs that have it, at their own marks
            have = [pr for pr in prs if pr[f"{key}_minus"] is not None]
            if len(have) < 2:
                continue
            x[f"{key}_pairs"] = len(have)
            x[f"{key}_minus"], x[f"{key}_stderr"], _ = paired_difference(
                *([r for pr in have for r in rows(pr["runs"][side], [last_mark] if key == "last" else pr["late_marks"])]
                  for side in (0, 1)))
        own = [pr["late_minus"] for pr in prs if pr["late_minus"] is not None]
        if len(own) >= 2:
            x["between_pairs_stderr"] = statistics.stdev(own) / len(own) ** 0.5
        if x["last_pairs"] or x["late_pairs"]:
            arms.append(x)
    return {"pairs": pairs, "arms": arms} if pairs else {}


def rate_sweep(col: dict, cfg: LearningConfig) -> dict[str, dict]:
    """Per arm run at >= 2 learning rates (``a``, ``a@3e-05``, ...): each rate's avg@k at the last mark and on the
    late mean (seeds pooled), and the best rate, chosen on the late mean where every rate has one, else on the last
    mark. ``edge`` is True when the best is the lowest or highest rate tried: the sweep has not bracketed the
    optimum, and a rate beyond it may do better. Rates with no evaluation at the last mark are left out."""
    late = (col.get("late_mean") or {}).get("comparisons", {})
    last = str(cfg.mark_list[-1])
    by_arm: dict[str, dict[float, dict]] = {}
    for group, a in col["arms"].items():
        if last not in a["marks"]:
            continue
        arm, lr, _ = cfg.parse_run(group)  # one sweep per arm and its +kl / +ep options
        variant = cfg.run_name(arm, cfg.learning_rate, cfg.seed, **cfg.run_options(group))
        by_arm.setdefault(variant, {})[lr] = {"run": group, "last_mark": a["marks"][last]["avg_at_k"],
                                              "late_mean": late.get(group, {}).get("late_mean")}
    out = {}
    for arm, rates in by_arm.items():
        if len(rates) < 2:
            continue
        key = "late_mean" if all(r["late_mean"] is not None for r in rates.values()) else "last_mark"
        best = max(rates, key=lambda lr: rates[lr][key])
        out[arm] = {"rates": {f"{lr:g}": r for lr, r in sorted(rates.items())}, "chosen_on": key,
                    "best_lr": best, "edge": best in (min(rates), max(rates))}
    return out


def load_evals(cfg: LearningConfig) -> dict[str, list[dict]]:
    """``evals/<name>.parquet`` rows by name (student, teacher, arms).

    Raises:
        FileNotFoundError: no ``evals/student.parquet`` (the run has not started).
        ValueError: rows lack ``correct_numeric`` / ``correct_math`` (written before both were stored:
            run ``--stage regrade``).
    """
    import pyarrow.parquet as pq

    ev = cfg.dir / "evals"
    if not (ev / "student.parquet").exists():
        raise FileNotFoundError(f"{ev / 'student.parquet'} not found: run the experiment first")
    out = {}
    for p in sorted(ev.glob("*.parquet")):  # every arm this directory has results for
        out[p.stem] = pq.read_table(p).to_pylist()
        if out[p.stem] and "correct_numeric" not in out[p.stem][0]:
            raise ValueError(f"{p} has no correct_numeric/correct_math columns: run --stage regrade first")
    return out


def report(cfg: LearningConfig) -> dict:
    """Collect ``evals/*.parquet`` into ``results.json``, ``results.md`` and ``learning.png``.

    The top-level numbers use ``cfg.report_filter``; ``other_filter`` holds the same under the other one.
    """
    from data_tools.grader import ANSWER_FILTERS
    from data_tools.runio import write_json

    evals = load_evals(cfg)
    saved = cfg.dir / "settings.json"
    # the runs the directory's commands asked for (since 2026-12-03); before, the recorded arms x the last seeds,
    # which named runs never asked for once a later command ran other seeds
    runs = json.loads(saved.read_text()).get("runs") if saved.exists() else None
    # preset "": its values are already in the fields, as settings.json records them (a report run later has no preset)
    res: dict = {"settings": {**dataclasses.asdict(cfg), "preset": ""}, **_collect(cfg, evals, cfg.report_filter),
                 "skipped": {a: "not run (see the run log)" for a in (cfg.instances if runs is None else runs)
                             if a not in evals}}
    skip_file = cfg.dir / "skipped.json"  # why run_all skipped or lost arms, kept for later reports
    if skip_file.exists():
        res["skipped"].update({a: w for a, w in json.loads(skip_file.read_text()).items() if a not in evals})
    other = [f for f in ANSWER_FILTERS if f != cfg.report_filter][0]
    res["other_filter"] = _collect(cfg, evals, other)
    if "teacher" in evals:
        res["setup"] = setup_measures(cfg, cfg.report_filter)
    write_json(res, cfg.dir / "results.json")
    (cfg.dir / "results.md").write_text(results_markdown(res, cfg))
    plot(res, cfg, cfg.dir / "learning.png")
    return res


def arm_group(name: str) -> str:
    """The arm an evaluation belongs to: its name without the ``-s<seed>`` suffix (``f@3e-05-s1`` -> ``f@3e-05``)."""
    return re.sub(r"-s\d+$", "", name)


def _fmt(x, nd=3):
    return "—" if x is None else f"{x:.{nd}f}"


def _table(col: dict, cfg: LearningConfig) -> list[str]:
    k = cfg.eval_samples
    lines = []
    s, t = col["student"], col.get("teacher")
    given = f" = {cfg.start_model}" if cfg.start_model else ""
    if cfg.student_layers:  # regime (iii): a cut student, healed by the start's SFT
        heal = f"{cfg.start_sft_steps} steps" if cfg.start_sft_steps else f"{cfg.start_sft_s:.0f} s"
        given = (f": {cfg.student_layers} of its layers ({cfg.student_layer_choice}), healed by {heal} of SFT on "
                 f"reference solutions, lr {cfg.start_lr or cfg.teacher_lr}")
    lines.append(f"- start (the student{given}): avg@{k} {_fmt(s['avg_at_k'])} ± {_fmt(s['stderr'])}, clip {_fmt(s['clip_rate'], 2)}, "
                 f"{s['mean_tokens']:.1f} tokens")
    if t:
        amount = f"{cfg.teacher_sft_steps} steps" if cfg.teacher_sft_steps else f"{cfg.teacher_sft_s:.0f} s"
        wider = f" of {cfg.teacher_n_train} problems" if cfg.teacher_n_train > cfg.n_train else ""
        what = ("of reward-only RL (the verifier's reward, no references)" if cfg.teacher_objective == "rl"
                else "of SFT on reference solutions")
        src = (f"{cfg.teacher_init} (an earlier link's teacher)" if cfg.teacher_init
               else "the whole student" if cfg.student_layers else "start")
        how = cfg.teacher_model if cfg.teacher_model else f"{src} + {amount} {what}{wider}, lr {cfg.teacher_lr}"
        lines.append(f"- teacher ({how}): "
                     f"avg@{k} {_fmt(t['avg_at_k'])} ± {_fmt(t['stderr'])}, clip {_fmt(t['clip_rate'], 2)}, "
                     f"{t['mean_tokens']:.1f} tokens")
    lines += ["", "| arm | " + " | ".join(f"{m:g} s" for m in cfg.mark_list) + " | last mark at s | steps | clip | tokens |",
              "|---|" + "---|" * (len(cfg.mark_list) + 4)]
    for arm, a in col["arms"].items():
        cells = [f"{_fmt(a['marks'][str(m)]['avg_at_k'])} ± {_fmt(a['marks'][str(m)]['stderr'])}"
                 if str(m) in a["marks"] else "—" for m in cfg.mark_list]
        last = a["marks"].get(str(cfg.mark_list[-1]), {})
        steps = last.get("step", "—")  # seeds pooled: the range of their step counts, not the largest alone
        if last.get("step_min", steps) != steps:
            steps = f"{last['step_min']}–{steps}"
        lines.append(f"| {arm}: {a['label']} | " + " | ".join(cells) + f" | {_fmt(last.get('train_s'), 1)}"
                     f" | {steps} | {_fmt(last.get('clip_rate'), 2)} | {_fmt(last.get('mean_tokens'), 1)} |")
    if col.get("comparisons_at_last_mark"):
        b = col["best_arm"]
        finals = [a["marks"][str(cfg.mark_list[-1])]["avg_at_k"] for a in col["arms"].values()
                  if str(cfg.mark_list[-1]) in a["marks"]]
        head = (f"Best at {cfg.mark_list[-1]:g} s: **{b}** ({cfg.label(b)})." if max(finals) > min(finals)
                else f"No arm ahead at {cfg.mark_list[-1]:g} s: all at {max(finals):.3f}.")
        lines += ["", f"{head} Paired differences over the same problems:", ""]
        for arm, c in col["comparisons_at_last_mark"].items():
            if arm == b:
                continue
            ci = _ci(c["best_minus_arm"], c["stderr"], c.get("df"))
            lines.append(f"- {b} − {arm}: {c['best_minus_arm']:+.3f} ± {_fmt(c['stderr'])} "
                         f"({_fmt(c['n_sigma'], 1)} standard errors" + (f"; {ci}" if ci else "") + ")")
        lines.append("")
        for arm, c in col["comparisons_at_last_mark"].items():
            lines.append(f"- {arm} − start: {c['gain_over_start']:+.3f} ± {_fmt(c['gain_stderr'])}")
    if col.get("late_mean"):
        lm = col["late_mean"]
        b, cmp = lm["best_arm"], lm["comparisons"]
        marks = ", ".join(f"{m:g}" for m in lm["marks"])
        means = [c["late_mean"] for c in cmp.values()]
        lead = (f"best **{b}** {cmp[b]['late_mean']:.3f}" if max(means) > min(means)
                else f"no arm ahead, all at {max(means):.3f}")
        lines += ["", f"Late mean (each problem's pass rate pooled over the marks at {marks} s; runs that completed "
                      f"all of them): {lead}. Paired over the same problems:", ""]
        for arm, c in cmp.items():
            if arm != b:
                seeds = (f"; between runs ± {c['seed_stderr']:.3f} from {len(cmp[b]['by_run'])} and {len(c['by_run'])} "
                         "seeds" if c.get("seed_stderr") is not None else "")
                if seeds and c.get("seed_df"):
                    between = (sum(cmp[b]["by_run"].values()) / len(cmp[b]["by_run"])
                               - sum(c["by_run"].values()) / len(c["by_run"]))
                    seeds += f" ({_ci(between, c['seed_stderr'], c['seed_df']).replace('t-interval', 'Welch t-interval')})"
                ci = _ci(c["best_minus_arm"], c["stderr"], c.get("df"))
                lines.append(f"- {b} − {arm}: {c['best_minus_arm']:+.3f} ± {_fmt(c['stderr'])} "
                             f"({_fmt(c['n_sigma'], 1)} standard errors" + (f", {ci}" if ci else "")
                             + f"; {arm} {c['late_mean']:.3f}{seeds})")
        lines.append("")
        for arm, c in cmp.items():
            lines.append(f"- {arm} − start: {c['gain_over_start']:+.3f} ± {_fmt(c['gain_stderr'])}")
    lines += _seed_lines(col, cfg)
    lines += _contrast_lines(col, cfg)
    if col.get("rate_sweep"):
        lines += ["", "Learning-rate sweep (each arm at the rates it ran; seeds pooled):", ""]
        for arm, sw in col["rate_sweep"].items():
            on = "on the late mean" if sw["chosen_on"] == "late_mean" else f"at {cfg.mark_list[-1]:g} s"
            cells = [f"{lr} {r['last_mark']:.3f}" + (f" (late {r['late_mean']:.3f})" if r["late_mean"] is not None else "")
                     for lr, r in sw["rates"].items()]
            edge = ": the sweep's edge, a rate beyond it is untried" if sw["edge"] else ""
            lines.append(f"- {arm} ({cfg.label(arm)}), at {cfg.mark_list[-1]:g} s: " + ", ".join(cells)
                         + f"; best {on}: **{sw['best_lr']:g}**{edge}")
    if col.get("handover"):
        last = f"{cfg.mark_list[-1]:g} s"
        lines += ["", f"At the hand-over (sequential arms: the model after the last off-policy step, mark_s = "
                      f"{HANDOVER_MARK:g} in evals/) and at {last}, paired over the same problems:", ""]
        for n, h in col["handover"].items():
            if not h["reached"]:
                lines.append(f"- {n}: hand-over not reached: every step to {last} (step {h['last_step']}) was "
                             f"off-policy, an SFT run (raise --budget_s or lower --sft_max_epochs to measure it)")
                continue
            after = (f"; at {last} (step {h['last_step']}) {h['last_avg_at_k']:.3f}, on-policy steps' effect "
                     f"{h['last_minus_handover']:+.3f} ± {_fmt(h['last_minus_handover_stderr'])}"
                     if "last_minus_handover" in h else f"; no evaluation at {last}")
            lines.append(f"- {n}: hand-over at {h['train_s']:.0f} s (step {h['step']}) {h['avg_at_k']:.3f} ± "
                         f"{_fmt(h['stderr'])}{after}")
    lines += _shared_handover_lines(col, cfg)
    return lines


def _shared_handover_lines(col: dict, cfg: LearningConfig) -> list[str]:
    """The markdown of ``shared_handovers``: one line per pair of runs, one per two arms over their pairs."""
    sh = col.get("shared_handovers")
    if not sh:
        return []
    last = f"{cfg.mark_list[-1]:g} s"

    def marks(ms):
        return ", ".join(f"{m:g}" for m in ms) + " s"

    lines = ["", "Runs of one seed that handed over one model (the same step, every completion at the hand-over equal): "
                 "their on-policy phases compared from it, paired over the same problems, at marks where both had "
                 "stepped past it:", ""]
    for pr in sh["pairs"]:
        a, b = pr["runs"]
        at = (f"at {last} {pr['last_minus']:+.3f} ± {_fmt(pr['last_stderr'])}" if pr["last_minus"] is not None
              else f"no mark at {last} past the hand-over in both")
        late = (f"; late mean ({marks(pr['late_marks'])}) {pr['late_minus']:+.3f} ± {_fmt(pr['late_stderr'])}"
                if pr["late_minus"] is not None else "; no late mark past the hand-over in both")
        lines.append(f"- {a} − {b} (step {pr['step']}, {pr['completions']} completions equal): {at}{late}")
    for x in sh["arms"]:
        a, b = x["arms"]
        parts = []
        if x["last_pairs"]:
            parts.append(f"at {last} {x['last_minus']:+.3f} ± {_fmt(x['last_stderr'])} ({x['last_pairs']} pairs)")
        if x["late_pairs"]:
            parts.append(f"late mean {x['late_minus']:+.3f} ± {_fmt(x['late_stderr'])} ({x['late_pairs']} pairs; "
                         f"between pairs ± {_fmt(x['between_pairs_stderr'])})")
        lines.append(f"- {a} − {b}, seeds pooled per problem: " + "; ".join(parts))
    return lines


def _contrast_lines(col: dict, cfg: LearningConfig) -> list[str]:
    """The markdown of ``contrasts``: one line per pair."""
    if not col.get("contrasts"):
        return []
    lines = ["", "Contrasts asked for (x − y, seeds pooled per problem, paired over the same problems; the rules of "
                 "bench/LEARNING.md read these):", ""]
    for c in col["contrasts"]:
        if c.get("missing"):
            lines.append(f"- {c['x']} − {c['y']}: no runs of {', '.join(c['missing'])}")
            continue
        parts = []
        for key, what in (("last", f"at {cfg.mark_list[-1]:g} s"), ("late", "late mean")):
            if key in c:
                e = c[key]
                parts.append(f"{what} {e['diff']:+.3f} ± {_fmt(e['stderr'])} ({_ci(e['diff'], e['stderr'], e['df'])})")
        if "between_runs" in c:
            e = c["between_runs"]
            parts.append(f"between runs ({e['runs'][0]} and {e['runs'][1]}), late mean {e['diff']:+.3f} ± "
                         f"{e['stderr']:.3f} ({_ci(e['diff'], e['stderr'], e['df']).replace('t-interval', 'Welch t-interval')})")
        lines.append(f"- {c['x']} − {c['y']}: " + "; ".join(parts))
    return lines


def _seed_lines(col: dict, cfg: LearningConfig) -> list[str]:
    """Per arm with >= 2 runs: each run's avg@k at the last mark and on the late mean, in run order, with their
    sample standard deviation (ddof=1): how far one checkpoint and one late mean move between seeds."""
    late = (col.get("late_mean") or {}).get("comparisons", {})
    out = []
    for arm, a in col["arms"].items():
        parts = []
        for what, vals in ((f"at {cfg.mark_list[-1]:g} s", a.get("last_mark_by_run", {})),
                           ("late mean", late.get(arm, {}).get("by_run", {}))):
            if len(vals) >= 2:
                v = [vals[n] for n in a["runs"] if n in vals]
                parts.append(f"{what} " + " / ".join(f"{x:.4f}" for x in v)  # four decimals: rule 1's Welch reads them
                             + f" (standard deviation {statistics.stdev(v):.4f})")
        if parts:
            out.append(f"- {arm}, runs {', '.join(a['runs'])}: " + "; ".join(parts))
    return ["", "Between seeds (each run alone):", ""] + out if out else []


def results_markdown(res: dict, cfg: LearningConfig) -> str:
    k = cfg.eval_samples
    lines = [f"Task `{cfg.data_name}`, {cfg.n_test} held-out problems x {k} samples (T={cfg.eval_temperature}, "
             f"{cfg.max_completion_length}-token cap). Budget {cfg.budget_s:.0f} training seconds per arm. "
             f"Training reward and stage one graded with answer filter `{cfg.answer_filter}`. A mark is evaluated "
             f"at the first optimizer step that ends past it (\"last mark at s\"; 0 steps: no update in time)."
             + (f" The arms trained on problems {cfg.n_train + 1}-{2 * cfg.n_train} of the teacher's, which the start "
                f"never saw (its SFT: problems 1-{cfg.n_train}; --fresh_arm_problems)."
                if getattr(cfg, "fresh_arm_problems", False) else "")
             + (f" The arms trained on problems {max(cfg.n_train, cfg.teacher_n_train) + 1}-"
                f"{max(cfg.n_train, cfg.teacher_n_train) + cfg.n_train}, which neither the start nor the teacher saw "
                f"(their SFT: problems 1-{max(cfg.n_train, cfg.teacher_n_train)}; --unseen_arm_problems)."
                if cfg.unseen_arm_problems else ""), "",
             f"### avg@{k}, answer filter `{res['answer_filter']}`", ""]
    if res.get("setup"):
        lines[-2:-2] = ["### The setup, before any arm", ""] + [f"- {x}" for x in setup_lines(res["setup"], cfg)] + [""]
    lines += _table(res, cfg)
    o = res["other_filter"]
    lines += ["", f"### avg@{k}, answer filter `{o['answer_filter']}`", ""] + _table(o, cfg)
    for arm, why in res["skipped"].items():
        lines.append(f"- arm {arm} skipped: {why}")
    return "\n".join(lines) + "\n"


def y_floor(lows: list[float], highs: list[float]) -> float:
    """The plot's lowest avg@k shown: 0, unless every error bar lies in the top half of the plotted range.

    ``lows`` / ``highs`` are the plotted points' avg@k minus / plus their standard error (fractions in [0, 1]).
    Regime (ii)'s arms all sat within 0.72-0.82 (LEARNING.md command 19): from 0 their 0.02 differences were one
    line. Then the axis starts at the lowest error bar less 0.02, rounded down to a multiple of 0.05, and the axis
    label says so. Raises ValueError on no points.
    """
    if not lows or not highs:
        raise ValueError("y_floor: no points to plot")
    lo, hi = min(lows), max(highs)
    if lo <= 0.5 * hi:
        return 0.0
    return max(0.0, math.floor((lo - 0.02) * 20 + 1e-9) / 20)


def legend_label(arm: str, a: dict) -> str:
    """An arm's line in the plot's legend: its name and label, and how many seeds its points pool."""
    seeds = f" ({len(a['runs'])} seeds pooled)" if len(a.get("runs", [])) > 1 else ""
    return f"{arm}: {a['label']}{seeds}"


def plot(res: dict, cfg: LearningConfig, path: Path) -> list[tuple[str, str, float, float]]:
    """avg@k against training minutes, one line per arm (error bars: standard error), one panel per answer
    filter, and an open diamond per sequential run at its hand-over; skipped without matplotlib.

    Returns the hand-over points drawn, ``(answer filter, run, minutes, avg@k)`` ([] when skipped).
    """
    try:
        import matplotlib
    except ImportError:  # the GPU machine has no matplotlib: `--stage report` redraws it from evals/
        print(f"[learning] matplotlib missing: {path.name} not drawn (run --stage report where it is installed)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [res, res["other_filter"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), sharey=True)
    drawn, lows, highs = [], [], []
    for ax, col in zip(axes, panels):
        s = col["student"]
        colors: dict[str, str] = {}
        for arm, a in col["arms"].items():
            ms = [m for m in cfg.mark_list if str(m) in a["marks"]]
            xs = [0.0] + [a["marks"][str(m)]["train_s"] / 60 for m in ms]
            ys = [s["avg_at_k"]] + [a["marks"][str(m)]["avg_at_k"] for m in ms]
            es = [s["stderr"] or 0] + [a["marks"][str(m)]["stderr"] or 0 for m in ms]
            # past the colour cycle's 10 colours a line style tells two arms of one colour apart
            style = ("-", "--", ":", "-.")[(len(colors) // 10) % 4]
            line = ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, ls=style, label=legend_label(arm, a))
            lows += [y - e for y, e in zip(ys, es)]
            highs += [y + e for y, e in zip(ys, es)]
            colors[arm] = line.lines[0].get_color()
        reached = {run: h for run, h in (col.get("handover") or {}).items() if h["reached"]}
        for run, h in reached.items():  # a sequential run's model after its last SFT step, in its arm's colour
            ax.plot(h["train_s"] / 60, h["avg_at_k"], marker="D", ms=7, mfc="none", ls="none", clip_on=False,
                    color=colors.get(arm_group(run), "k"))
            drawn.append((col["answer_filter"], run, h["train_s"] / 60, h["avg_at_k"]))
        if reached:  # one legend entry, in no arm's colour
            ax.plot([], [], marker="D", ms=7, mfc="none", ls="none", color="k", label="hand-over (SFT passes end)")
        if col.get("teacher"):
            ax.axhline(col["teacher"]["avg_at_k"], color="grey", ls="--", lw=1, label="teacher")
            lows.append(col["teacher"]["avg_at_k"])
            highs.append(col["teacher"]["avg_at_k"])
        lows += [h["avg_at_k"] for h in reached.values()]
        highs += [h["avg_at_k"] for h in reached.values()]
        ax.set_xlabel("training minutes on the arm's own clock (evaluation excluded)")
        ax.set_title(f"answer filter: {col['answer_filter']}" +
                     (" (reported)" if col is res else " (equal expressions accepted)"))
        ax.grid(alpha=0.3)
    bottom = y_floor(lows, highs) if lows else 0.0
    for ax in axes:  # sharey: one range for both panels
        ax.set_ylim(bottom=bottom)
    axes[0].set_ylabel(f"avg@{cfg.eval_samples} on {cfg.n_test} held-out problems ({cfg.task})"
                       + (f"\naxis from {bottom:.2f}, not 0" if bottom > 0 else ""))
    # The legend goes under the panels: inside them it hid lines (a sweep of 10 arms covered d's, 2026-12-03).
    handles, labels = axes[0].get_legend_handles_labels()
    ncol = 2 if len(labels) > 4 else 1
    rows = -(-len(labels) // ncol)
    fig.set_size_inches(6.5 * len(panels), 4.5 + 0.2 * rows)
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=ncol, frameon=False)
    fig.suptitle(f"SmolLM2-135M-Instruct: arms at equal training seconds (reward graded '{cfg.answer_filter}')")
    fig.tight_layout(rect=(0, (0.2 * rows + 0.15) / (4.5 + 0.2 * rows), 1, 1))
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    plt.close(fig)
    return drawn




def welch_line(x_name: str, x: list[float], y_name: str, y: list[float], level: float = 0.95) -> str:
    """Rule 1's test over seeds as one line: mean(x) − mean(y) with its Welch standard error, t-interval and
    degrees of freedom, from one score per seed (each run's avg@k at the last mark). Raises ValueError with fewer
    than 2 scores on a side or none of them spread (no Welch interval exists then)."""
    few = [f"{n} has {len(v)}" for n, v in ((x_name, x), (y_name, y)) if len(v) < 2]
    if few:
        raise ValueError(f"a Welch interval needs >= 2 scores (seeds) on each side: {', '.join(few)}")
    w = welch(x, y)
    if w is None:
        raise ValueError(f"the scores of {x_name} and of {y_name} are each all equal: no spread between seeds, "
                         "so no Welch interval (their difference is exact, or the scores were rounded too far)")
    se, df = w
    d = statistics.fmean(x) - statistics.fmean(y)
    lo, hi = t_interval(d, se, df, level)
    verdict = "ahead" if lo > 0 else "behind" if hi < 0 else "level"
    return (f"{x_name} − {y_name} over seeds: {d:+.4f} ± {se:.4f} ({level:.0%} Welch t-interval {lo:+.4f} to "
            f"{hi:+.4f}, df {df:.1f}; {x_name} {statistics.fmean(x):.4f} over {len(x)} seeds, {y_name} "
            f"{statistics.fmean(y):.4f} over {len(y)}): {x_name} {verdict}")


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.learning_report welch X=0.383,0.384 Y=0.365,0.363``: rule 1's Welch test over seeds from each
    run's score at the last mark, as each lease's results.md lists them ("Between seeds"). For seeds whose tables
    are on no one machine (each lease reports its own; the scores are in the run logs under bench/learning/)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.learning_report", description=main.__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("welch", help="mean(X) − mean(Y) over seeds with its Welch t-interval and degrees of freedom")
    w.add_argument("x", help="NAME=score,score,...: one arm's score per seed (avg@k at the last mark)")
    w.add_argument("y", help="NAME=score,score,...: the arm it is compared with")
    args = p.parse_args(argv)

    def side(spec: str) -> tuple[str, list[float]]:
        name, sep, vals = spec.rpartition("=")  # a score never holds "=", a name may
        name = name.strip()
        if not sep or not name:
            p.error(f"{spec!r}: expected NAME=score,score,... (an arm's name, then its scores)")
        items = [v.strip() for v in vals.split(",")]
        if "" in items:
            p.error(f"{spec!r}: an empty score (a comma too many?)")
        try:
            scores = [float(v) for v in items]
        except ValueError:
            p.error(f"{spec!r}: not a number among the scores")
        bad = [v for v, f in zip(items, scores) if not 0 <= f <= 1]  # NaN fails this too
        if bad:
            p.error(f"{spec!r}: {', '.join(bad)} not between 0 and 1 (scores are avg@k)")
        return name, scores

    (xn, xs), (yn, ys) = side(args.x), side(args.y)
    if xn == yn:
        p.error(f"both sides are named {xn!r}: compare two arms")
    try:
        line = welch_line(xn, xs, yn, ys)
    except ValueError as e:
        p.error(str(e))
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
