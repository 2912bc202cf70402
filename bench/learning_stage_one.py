"""Stage one of bench/learning.py's off-policy arms (d, f, h, i, j): the teacher's samples of the arms' problems
through ``stages.curate`` (once a run), the seconds each arm is charged for them, and the curriculum each arm reads.

Under ``stage_one_filter formal`` stage one is the pass-rate-filtered one
(``configs/curate_r1_distill_1p5b_filtered.yaml``'s filter and order): an off-policy arm trains on its kept rows, in
its order, and is charged the start's pass-rate sampling too; a run's ``+all`` (run 4's arm N) trains on every arm
problem instead (``bench/learning/run-4-plan.md``).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.learning_clock import _free
from bench.learning_config import ARM_SPECS, LearningConfig
from bench.learning_data import _yaml, read_rows, start_path

ROOT = Path(__file__).resolve().parents[1]


class NothingToTrain(RuntimeError):
    """An off-policy arm with no data from stage one: no verified solution, or no problem its filter kept."""


def stage_one_meta(cfg: LearningConfig) -> dict | None:
    """``data/stage_one.json`` (stage one's seconds, its filter and kept rows), or None before stage one ran."""
    meta = cfg.dir / "data" / "stage_one.json"
    return json.loads(meta.read_text()) if meta.exists() else None


def stage_one_filtered(cfg: LearningConfig, name: str) -> bool:
    """Whether arm run ``name`` trains on stage one's kept rows in their order (``stage_one_filter formal``, an
    off-policy arm, no ``+all``) rather than on every arm problem."""
    arm = cfg.parse_run(name)[0]
    return (cfg.stage_one_filter == "formal" and bool(ARM_SPECS[arm].off_policy)
            and not cfg.run_options(name).get("every_problem"))


def stage_one_seconds(cfg: LearningConfig, name: str) -> float:
    """Stage one's seconds on arm run ``name``'s clock (0 before stage one ran, and for arms without it): the
    teacher's sampling and grading, plus the start's pass-rate sampling where the run uses the filter those pass
    rates feed (``stage_one_filtered``). One stage one serves every off-policy arm (``data/stage_one.json``)."""
    m = stage_one_meta(cfg)
    if not ARM_SPECS[cfg.parse_run(name)[0]].off_policy or m is None:
        return 0.0
    return float(m["seconds"]) + (float(m.get("student_seconds") or 0.0) if stage_one_filtered(cfg, name) else 0.0)


def arm_curriculum(cfg: LearningConfig, arm: str, name: str, verified: list[dict] | None) -> Path:
    """The curriculum table an arm reads (stage one's schema, ``stages.curate.CURRICULUM_SCHEMA``).

    Arms without off-policy data or a stated answer (a-c, e): ``data/curriculum.parquet``. Off-policy arms (d, f,
    h, i, j): the same with ``teacher_solution`` = the shortest verified teacher sample of each problem from stage
    one (None where the teacher verified none), as stages.curate writes it; under ``stage_one_filter formal`` only
    stage one's kept rows, in its order (``stage_one_filtered``). Stated-answer arms (g, i):
    ``reference`` = the reference solution followed by the verified final answer stated explicitly.
    """
    from data_tools.runio import write_parquet

    spec = ARM_SPECS[arm]
    base = cfg.dir / "data" / "curriculum.parquet"
    if not (spec.off_policy or spec.stated_answer):
        return base
    rows = read_rows(base)
    if stage_one_filtered(cfg, name):  # the pass-rate-filtered stage one: its kept rows, in its order
        meta = stage_one_meta(cfg) or {}
        by_id = {r["problem_id"]: r for r in rows}
        rows = [{**by_id[pid], "curriculum_index": i} for i, pid in enumerate(meta.get("kept") or []) if pid in by_id]
        if not rows:
            raise NothingToTrain(f"stage one's filter (stage_one_filter formal) kept none of its {meta.get('measured', '?')} "
                                 "problems: it keeps only problems the teacher solved at least once (configs/"
                                 "curate_r1_distill_1p5b_filtered.yaml); a teacher that solves some, or '+all' / "
                                 "--stage_one_filter none")
    if spec.off_policy:
        best: dict[str, str] = {}
        for r in verified or []:
            if r["problem_id"] not in best or len(r["completion"]) < len(best[r["problem_id"]]):
                best[r["problem_id"]] = r["completion"]
        for r in rows:
            r["teacher_solution"] = best.get(r["problem_id"])
    if spec.stated_answer:
        for r in rows:
            r["reference"] = f"{r['reference']}\nThe final answer is {r['answer']}."
    return write_parquet(rows, cfg.dir / "arms" / name / "curriculum.parquet")


def stage_one_cached(cfg: LearningConfig) -> list[dict]:
    """Stage one of the off-policy arms through ``stages.curate``, once per run, its teacher rows
    (``stage_one/curate.yaml`` -> ``stage_one/curate/``; teacher rows -> ``data/stage_one.{parquet,json}``).

    The teacher (``<out>/teacher``) samples the first ``stage_one_problems`` training problems
    ``stage_one_samples`` times; the grader marks each. A sample is kept (``correct``) when graded correct,
    finished and not a repeat of an earlier one. The seconds charged to each off-policy arm's clock are the
    teacher's generation and grading (curate's ``timings.teacher_s``), and under ``stage_one_filter formal`` the
    start's pass-rate sampling too for the arms that use its filter (``stage_one_seconds``); with the filter off
    curate samples the start once per problem, unused and not charged. Samples are seeded by the run's ``seed``
    setting, not the arm's: one stage one feeds every off-policy arm.
    """
    import shutil

    import pyarrow.parquet as pq

    from data_tools.config import parse_config
    from data_tools.runio import write_json, write_parquet
    from stages.curate import CurateConfig, curate

    p, meta = cfg.dir / "data" / "stage_one.parquet", cfg.dir / "data" / "stage_one.json"
    if p.exists() and meta.exists():
        return read_rows(p)
    settings = json.loads((cfg.dir / "settings.json").read_text())
    work = cfg.dir / "stage_one"
    shutil.rmtree(work, ignore_errors=True)  # a stage one cut short is measured again, whole
    k = cfg.stage_one_samples
    # the filter: the formal recipe's own settings (one pipeline), or none (every problem kept, one student sample)
    filt = formal_stage_one_filter() if cfg.stage_one_filter == "formal" else dict(student_samples=1, zero_pass_share=1.0)
    recipe = _yaml(dict(train_data=str(cfg.dir / "data" / "train.parquet"), limit=cfg.stage_one_problems,
                        student_model=start_path(cfg), teacher_model=str(cfg.dir / "teacher"),
                        teacher_context="teacher", prompt_style=cfg.prompt_style, teacher_samples=k,
                        max_tokens=cfg.max_completion_length, temperature=cfg.eval_temperature, top_p=1.0,
                        answer_filter=cfg.answer_filter, **({"grader_profile": cfg.grader_profile} if cfg.grader_profile else {}),
                        seed=settings["seed"] + 104729, engine=cfg.engine, dtype="float32", max_model_len=1024,
                        chunk_size=max(1, cfg.eval_batch // k), output_dir=str(work)) | filt, work / "curate.yaml")
    (ccfg,) = parse_config([CurateConfig], ["--config", str(recipe)], env={})
    manifest = curate(ccfg)
    _free()
    rollouts = pq.read_table(manifest["tables"]["rollouts"]).to_pylist()
    out, seen = [], set()
    for r in sorted((r for r in rollouts if r["role"] == "teacher"), key=lambda r: (r["chunk"], r["sample_index"])):
        dup = (r["problem_id"], r["completion"]) in seen
        seen.add((r["problem_id"], r["completion"]))
        out.append(dict(problem_id=r["problem_id"], sample_index=r["sample_index"], prompt=r["prompt"],
                        completion=r["completion"], correct=bool(r["correct"]) and r["finish_reason"] == "stop" and not dup,
                        graded_correct=bool(r["correct"]), duplicate=dup, n_tokens=r["n_tokens"],
                        finish_reason=r["finish_reason"]))
    seconds = float(manifest["timings"]["teacher_s"])
    kept = None
    if cfg.stage_one_filter == "formal":
        cur = sorted(pq.read_table(manifest["tables"]["curriculum"]).to_pylist(), key=lambda r: r["curriculum_index"])
        kept = [r["problem_id"] for r in cur]
    write_parquet(out, p)
    write_json({"seconds": seconds, "student_seconds": float(manifest["timings"].get("student_s") or 0.0),
                "filter": cfg.stage_one_filter, "kept": kept, "measured": len({r["problem_id"] for r in out}), "engine": manifest["engine"],
                "curate_manifest": str(work / "curate" / "manifest.json")}, meta)
    return out


def formal_stage_one_filter() -> dict:
    """The pass-rate filter of ``configs/curate_r1_distill_1p5b_filtered.yaml``: the start's samples per problem for its
    pass rate, the pass-rate band, the share of teacher-solved problems the start never solves kept anyway,
    the order, and the sampling temperature the pass rates are measured at."""
    import yaml

    recipe = yaml.safe_load((ROOT / "configs" / "curate_r1_distill_1p5b_filtered.yaml").read_text())
    return {k: recipe[k] for k in ("student_samples", "band_low", "band_high", "zero_pass_share", "order", "temperature")}
