"""Run report: training-dynamics plots, evaluation summary, and where everything is.

    python -m stages.report [--run OUTPUT_DIR]

Reads ``metrics/train.jsonl`` and ``eval/*/summary.json`` under the run directory and writes
``report/`` there: ``training.png`` (reverse KL, reward, group pass rate, completion length and
clip rate per step), ``report.json`` and ``report.md``; prints the same short report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from data_tools.runio import default_ckpt_dir, default_output_dir, write_json

#: (metric key, panel title) of the training plot, in panel order.
PANELS = [
    ("kl/sampled_mean", "sampled reverse KL (nats/token)"),
    ("reward/mean", "verifier reward (mean)"),
    ("reward/group_pass_rate", "group pass rate"),
    ("completions/mean_length", "completion length (tokens)"),
    ("completions/clip_rate", "clip rate"),
    ("loss", "loss"),
]


def read_metrics(path: Path) -> list[dict]:
    """One dict per line of ``train.jsonl``; unreadable lines are skipped with a warning on stderr."""
    rows = []
    if not path.exists():
        return rows
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"report: {path}:{i} is not JSON, skipped", file=sys.stderr)
    return rows


def dedupe_steps(rows: list[dict]) -> list[dict]:
    """One row per step, the last one written (a step re-run after a crash appears twice), by step."""
    by_step = {r.get("step"): r for r in rows if isinstance(r.get("step"), int)}
    return [by_step[k] for k in sorted(by_step)]


def training_seconds(rows: list[dict]) -> float | None:
    """Training wall time over every process of the run, seconds: from the start of each process's first logged
    step to the end of its last (saves between steps included; model loading, stage one and set-up not).

    ``wall_s`` counts from the clock's start (run.sh's ``OPD_RUN_START``, else the process's), which a
    resumed run may restart: rows are grouped by that start (``time - wall_s``), and each group spans from
    its first row's ``wall_s - time/step`` to its last ``wall_s``.
    """
    segments: list[list[float]] = []  # [clock start, first step's start, last wall_s]
    for r in rows:
        w = r.get("wall_s")
        if not isinstance(w, (int, float)):
            continue
        start = r["time"] - w if isinstance(r.get("time"), (int, float)) else 0.0
        began = w - float(r.get("time/step") or 0.0)
        seg = next((x for x in segments if abs(x[0] - start) < 1.0), None)
        if seg is None:
            segments.append([start, began, w])
        else:
            seg[1], seg[2] = min(seg[1], began), max(seg[2], w)
    return round(sum(end - b for _, b, end in segments), 1) if segments else None


def training_outcome(run: Path) -> dict | None:
    """What training did, from ``train_summary.json``: ``{"steps", "stop_reason", "start_model_only"}``; None when
    training wrote no summary. ``start_model_only``: it ran no step, so its one export (``checkpoint-0``) is the start
    model."""
    try:
        s = json.loads((run / "train_summary.json").read_text())
    except (OSError, ValueError):
        return None
    steps = int(s.get("global_step") or 0)
    return {"steps": steps, "stop_reason": s.get("stop_reason") or "unknown", "start_model_only": steps == 0}


def outcome_line(o: dict) -> str:
    """One line for a run that trained nothing (run.sh's last line and the report say it)."""
    return f"trained 0 steps ({o['stop_reason']}): checkpoint-0 is the start model, not a trained one"


def plot_training(metrics: list[dict], dest: Path) -> Path | None:
    """Write a grid of per-step curves to ``dest`` (PNG); None when there is nothing to plot or matplotlib (optional,
    not on the design card) is not installed, which is said in one line on stderr."""
    if not metrics:
        return None
    try:
        import matplotlib  # optional: without it the report has no plot
    except ImportError:
        print(f"report: matplotlib is not installed: {dest.name} not drawn (the tables and report.md are written; "
              "pip install matplotlib for the plot)", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(m.get("step"), m.get(key)) for m in metrics
               if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", ms=3, lw=1.2)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"training dynamics ({len(metrics)} steps)")
    fig.tight_layout()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.report")
    ap.add_argument("--run", default=None, help="run directory (default: $OUTPUT_DIR or the default run)")
    ap.add_argument("--ckpt_dir", default=None, help="checkpoint root (default: $CKPT_DIR, else /out/checkpoints for a run under "
                                                          "the formal /out, else <run>/checkpoints)")
    ap.add_argument("--outcome", action="store_true", help="print TRAINED_STEPS=<n> and TRAINED_NOTE=<line, empty unless "
                                                           "training ran 0 steps> for run.sh, and exit")
    args = ap.parse_args(argv)
    run = Path(args.run) if args.run else default_output_dir()
    if args.outcome:
        import shlex

        o = training_outcome(run)
        print(f"TRAINED_STEPS={o['steps'] if o else ''}")
        print(f"TRAINED_NOTE={shlex.quote(outcome_line(o)) if o and o['start_model_only'] else ''}")
        return 0
    if not run.exists():
        print(f"report: run directory {run} does not exist", file=sys.stderr)
        return 1
    out = run / "report"
    raw = read_metrics(run / "metrics" / "train.jsonl")
    metrics = dedupe_steps(raw)
    png = plot_training(metrics, out / "training.png")
    evals = []
    for f in sorted((run / "eval").glob("*/summary.json")):
        s = json.loads(f.read_text())
        evals.append({k: s.get(k) for k in ("label", "protocol", "declared_protocol", "model", "checkpoint_step",
                                            "pass_at_1", "pass_at_1_stderr", "clip_rate", "n_problems", "n_samples")})
    last = metrics[-1] if metrics else {}
    ckpt_root = Path(args.ckpt_dir) if args.ckpt_dir else default_ckpt_dir(run)
    ckpts = sorted((p for p in ckpt_root.glob("checkpoint-*") if p.name.split("-")[1].isdigit()),
                   key=lambda p: int(p.name.split("-")[1]))
    wall = training_seconds(raw)
    report = {"run": str(run), "steps": len(metrics), "train_wall_s": wall,
              "final_metrics": {k: last.get(k) for k, _ in PANELS if k in last}, "eval": evals,
              "plots": [str(png)] if png else [], "checkpoints": [str(c) for c in ckpts]}
    lines = [f"# opd run report: {run}", ""]
    manifest = run / "curate" / "manifest.json"
    unfiltered = False  # stage one under filter none: no pass rates, one bucket
    if manifest.exists():  # how much stage one gave training: a short clock can leave a tiny curriculum
        man = json.loads(manifest.read_text())
        c = man.get("counts", {})
        unfiltered = (man.get("config") or {}).get("filter") == "none" or bool(c.get("filter_fallback"))
        report["curriculum_rows"] = c.get("curriculum")
        if unfiltered:  # every problem a row; the teacher's solutions from those measured
            why = "the pass-rate band kept none" if c.get("filter_fallback") else "filter none"
            lines.append(f"stage one: {c.get('curriculum')} curriculum rows ({why}: every problem), "
                         f"{c.get('teacher_solutions')} with a verified teacher solution from {c.get('problems_measured')} "
                         f"problems measured of {c.get('problems')}")
        else:
            lines.append(f"stage one: {c.get('curriculum')} curriculum rows from {c.get('problems_measured')} problems "
                         f"measured of {c.get('problems')}")
    outcome = training_outcome(run)
    if outcome is not None:
        report["training"] = outcome
    if outcome is not None and outcome["start_model_only"]:  # said first: every number below is the start model's
        lines.append(f"training: {outcome_line(outcome)}")
        lines[2:2] = [f"**This run trained nothing**: {outcome_line(outcome)}.", ""]
    else:
        lines.append(f"training: {len(metrics)} steps" + (f", {wall:.0f} s" if wall else ""))
    if evals:
        lines += ["", "| eval | protocol | pass@1 | stderr | clip rate | problems x samples |", "|---|---|---|---|---|---|"]
        for e in evals:
            tag = "" if e["declared_protocol"] else " (not the declared protocol)"
            lines.append(f"| {e['label']} | {e['protocol']}{tag} | {e['pass_at_1']:.4f} | {e['pass_at_1_stderr']:.4f} | "
                         f"{e['clip_rate']:.4f} | {e['n_problems']} x {e['n_samples'] // max(e['n_problems'], 1)} |")
        by = {e["label"].split("__")[0]: e for e in evals}
        if "start" in by and "final" in by:
            d = by["final"]["pass_at_1"] - by["start"]["pass_at_1"]
            se = math.hypot(by["final"]["pass_at_1_stderr"], by["start"]["pass_at_1_stderr"])
            lines += ["", f"change in pass@1: {d:+.4f} ({d / se:+.1f} combined standard errors)" if se else
                      f"change in pass@1: {d:+.4f}"]
    lines += ["", "where things are:",
              f"- tables (duckdb views: `make query` with no SQL lists them): {run}/curate, {run}/rollouts, {run}/eval",
              f"- metrics: {run}/metrics/train.jsonl",
              f"- checkpoints: {', '.join(c.name for c in ckpts) or 'none'} in {ckpt_root}",
              f"- plots: {png or ('none (no metrics)' if not metrics else 'none (matplotlib is not installed)')}",
              "", "try:",
              f'  OUTPUT_DIR={run} make query SQL="SELECT level, role, round(avg(correct::INT),3) AS acc, count(*) AS n FROM rollouts JOIN problems USING (problem_id) GROUP BY ALL ORDER BY ALL"']
    if any((run / "rollouts").glob("step-*.parquet")):  # on-policy steps ran: their metrics and rollout table exist
        lines += [f'  OUTPUT_DIR={run} make query SQL="SELECT step, round(\\"kl/sampled_mean\\",4) AS kl, \\"reward/mean\\" AS reward, \\"completions/clip_rate\\" AS clip FROM metrics ORDER BY step"',
                  # stage one's difficulty against training's reward; under filter none there is no pass rate (null)
                  # and one bucket: the teacher's solutions instead
                  (f'  OUTPUT_DIR={run} make query SQL="SELECT c.teacher_solution IS NOT NULL AS solved_by_teacher, count(DISTINCT problem_id) AS problems, round(avg(t.reward),3) AS train_reward FROM curriculum c JOIN train_rollouts t USING (problem_id) GROUP BY ALL ORDER BY 1"'
                   if unfiltered else
                   f'  OUTPUT_DIR={run} make query SQL="SELECT c.bucket, round(avg(c.pass_rate),3) AS curate_p, round(avg(t.reward),3) AS train_reward FROM curriculum c JOIN train_rollouts t USING (problem_id) GROUP BY ALL ORDER BY 1"')]
    elif metrics and "loss/sft" in metrics[-1]:  # every step so far was off-policy SFT (the recipe's first phase): no rollouts, no reward
        lines += [f'  OUTPUT_DIR={run} make query SQL="SELECT step, round(\\"loss/sft\\",4) AS sft_loss, round(\\"sft/epoch\\",2) AS passes FROM metrics ORDER BY step"']
    write_json(report, out / "report.json")
    text = "\n".join(lines) + "\n"
    tmp = out / ".report.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / "report.md")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
