"""bench/learning.py: the arm clock, paired standard errors, settings checks, the report, and (slow) a CPU run."""

from __future__ import annotations

import importlib.util

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from bench.learning import ARMS, LearningConfig, merge_settings
from bench.learning_clock import MarkClock, clock_fraction
from bench.learning_report import legend_label, paired_difference, report
from data_tools.runio import write_parquet

ROOT = Path(__file__).resolve().parents[1]


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_mark_clock_pauses_for_evaluation_and_stops_after_last_mark():
    now = FakeTime()
    seen = []

    def eval_fn(model, mark, t, step):
        seen.append((mark, t, step))
        now.t += 50.0  # a long evaluation must not count as training time

    clock = MarkClock([10, 20, 30], eval_fn, clock=now, sync=lambda: None)
    clock.start()
    stops = []
    for step in range(1, 100):
        now.t += 4.0  # one optimizer step = 4 training seconds
        stops.append(clock.check("model", step))
        if stops[-1]:
            break
    # marks are evaluated at the first step end at or past them: 12 s (step 3), 20 s (step 5), 32 s (step 8)
    assert seen == [(10, 12.0, 3), (20, 20.0, 5), (30, 32.0, 8)]
    assert stops == [False] * 7 + [True]
    assert clock.elapsed() == pytest.approx(32.0)

    # an offset (arm d's stage-one sampling) counts toward the marks; several marks can pass in one step
    now2, seen2 = FakeTime(), []
    c2 = MarkClock([5, 10, 15], lambda m, mark, t, s: seen2.append(mark), clock=now2, sync=lambda: None)
    c2.start(offset_s=11.0)
    assert c2.check(None, 0) is False and seen2 == [5, 10]
    now2.t += 4.0
    assert c2.check(None, 1) is True and seen2 == [5, 10, 15]


def test_clock_fraction_follows_the_arm_clock_and_is_none_without_a_span():
    now = FakeTime()
    clock = MarkClock([100], lambda *a: None, clock=now, sync=lambda: None)
    clock.start(offset_s=10.0)
    frac = clock_fraction(clock, 40.0)
    assert frac() == pytest.approx(0.25)  # the offset (stage one's seconds) counts
    now.t += 20.0
    assert frac() == pytest.approx(0.75)
    now.t += 100.0
    assert frac() == 1.0  # clamped
    # a start / teacher built by step count passes seconds=0 as its only mark: no span, no fraction (it once
    # divided by zero in the GPU setup command)
    assert clock_fraction(clock, 0.0) is None


def _rows(name, rates: dict[str, list[bool]], mark=0.0, step=0):
    return [dict(name=name, mark_s=mark, train_s=mark, step=step, problem_id=p, level="1", sample_index=i,
                 completion="", correct=bool(c), correct_numeric=bool(c), correct_math=bool(c) or i == 3, extracted=None,
                 n_tokens=10 + i, finish_reason="length" if i == 0 else "stop")
            for p, cs in rates.items() for i, c in enumerate(cs)]


def test_paired_difference_matches_plain_formula():
    x = _rows("x", {"p1": [1, 1, 0, 0], "p2": [1, 1, 1, 1], "p3": [0, 0, 0, 1], "p4": [1, 0, 0, 0]})
    y = _rows("y", {"p1": [0, 0, 0, 0], "p2": [1, 1, 0, 0], "p3": [0, 0, 0, 1], "p4": [1, 1, 1, 0], "p5": [1] * 4})
    d, se, n = paired_difference(x, y)
    diffs = [0.5, 0.5, 0.0, -0.5]  # p5 is not in x: left out
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in diffs) / 3)
    assert n == 4 and d == pytest.approx(mean) and se == pytest.approx(sd / 2)
    with pytest.raises(ValueError, match="share no problem"):
        paired_difference(x, _rows("z", {"q": [1]}))


@pytest.mark.parametrize("kw,match", [
    (dict(arms="a,z"), "arms"), (dict(marks="30,20"), "marks"), (dict(marks="10,200", budget_s=180), "marks"),
    (dict(task="math"), "task"), (dict(per_device_train_batch_size=100, num_generations=8), "multiple"),
    (dict(sft_filter="some"), "sft_filter"), (dict(out=""), "--out"), (dict(preset="gpu"), "preset"),
    (dict(eval_temperature=0.0), "temperature"), (dict(n_test=0), "n_test"), (dict(answer_filter="x"), "answer_filter"),
    (dict(report_filter="exact"), "report_filter"), (dict(late_marks=-1), "late_marks"),
    (dict(sft_max_epochs=0), "sft_max_epochs"), (dict(sft_max_epochs=float("nan")), "sft_max_epochs"),
    (dict(sft_max_epochs=float("inf")), "sft_max_epochs"), (dict(sft_learning_rate=-1.0), "sft_learning_rate"),
    (dict(sft_handover_reset=-1), "sft_handover_reset"),
    (dict(n_train=100, teacher_n_train=50), "teacher_n_train"),
    (dict(teacher_n_train=9000, teacher_model="/m"), "teacher_n_train"),
    (dict(n_train=100, teacher_n_train=199, start_sft_steps=1, fresh_arm_problems=True),
     r"teacher_n_train >= 200 \(got 199\)"),
    (dict(n_train=100, teacher_model="/m", start_sft_steps=1, fresh_arm_problems=True), "given teacher_model"),
    (dict(n_train=100, teacher_n_train=200, fresh_arm_problems=True), "a start built here"),
    (dict(n_train=100, teacher_n_train=200, start_model="/s", fresh_arm_problems=True), "not a given start_model")])
def test_config_range_checks(tmp_path, kw, match):
    args = dict(out=str(tmp_path / "run"))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        LearningConfig(**args)


def test_given_start_and_teacher_are_checked(tmp_path):
    from bench.learning_config import check_given_models

    model = tmp_path / "m"
    model.mkdir()
    cfg = LearningConfig(out=str(tmp_path / "r"), teacher_model=str(model))  # a report elsewhere may not have it
    with pytest.raises(FileNotFoundError, match=r"teacher_model: .* with weights \(no config.json"):
        check_given_models(cfg)
    (cfg.dir / "teacher").mkdir(parents=True)
    (cfg.dir / "teacher" / "config.json").write_text("{}")
    (cfg.dir / "teacher" / "model.safetensors").write_bytes(b"")
    check_given_models(cfg)  # already copied into the run: the source may be gone
    (model / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="with weights"):  # e.g. a packed, weightless folder
        check_given_models(LearningConfig(out=str(tmp_path / "r2"), start_model=str(model)))
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="teacher_model replaces the teacher's SFT"):
        LearningConfig(out=str(tmp_path / "r"), teacher_model=str(model), teacher_sft_steps=5)
    with pytest.raises(ValueError, match="start_model replaces the start's SFT"):
        LearningConfig(out=str(tmp_path / "r"), start_model=str(model), start_sft_steps=5)
    check_given_models(LearningConfig(out=str(tmp_path / "r2"), start_model=str(model), teacher_model=str(model)))


def test_preset_fills_defaults_but_flags_win(tmp_path):
    cfg = LearningConfig(out=str(tmp_path / "r"), preset="cpu_smoke")
    assert (cfg.budget_s, cfg.marks, cfg.sft_filter, cfg.n_test) == (6.0, "3,6", "none", 6)
    cfg = LearningConfig(out=str(tmp_path / "r"), preset="cpu_smoke", n_test=9, learning_rate=3e-5)
    assert (cfg.n_test, cfg.learning_rate, cfg.budget_s) == (9, 3e-5, 6.0)
    with pytest.raises(ValueError, match="marks"):  # an explicit flag is kept, then checked against the preset's budget
        LearningConfig(out=str(tmp_path / "r"), preset="cpu_smoke", marks="3,60")


def test_merge_settings_resume_rules():
    base = dict(out="/a", arms="a,b", task="ladder", learning_rate=1e-5, fast_generation=True, deadline_s=0.0)
    first = merge_settings(None, base, ["a", "b"])
    assert first["fast_generation_used"] is True
    first["fast_generation_used"] = False  # the pre-flight check fell back on that machine
    # same experiment, other arms / deadline / directory: accepted, arms kept, the fallback decision kept
    again = merge_settings(first, {**base, "arms": "c", "deadline_s": 60.0, "out": "/moved"}, ["c"])
    assert again["arms"] == "a,b,c" and again["fast_generation_used"] is False and again["out"] == "/moved"
    # the runs each command asked for accumulate (other seeds of other arms are no new experiment)
    runs = merge_settings({**first, "runs": ["a", "b"]}, {**base, "runs": ["c-s1"], "seeds": "1"}, ["c"])["runs"]
    assert runs == ["a", "b", "c-s1"]
    with pytest.raises(ValueError, match=r"other settings \(\['learning_rate', 'task'\]\)"):
        merge_settings(first, {**base, "learning_rate": 3e-5, "task": "gsm8k"}, ["a"])
    # a setting added since the old run was recorded: its default is what the old run had
    assert merge_settings(first, {**base, "teacher_model": ""}, ["a"])["teacher_model"] == ""
    with pytest.raises(ValueError, match=r"other settings \(\['teacher_model'\]\)"):
        merge_settings(first, {**base, "teacher_model": "/m"}, ["a"])


def test_settings_under_their_old_names_are_read_and_old_flags_refused(tmp_path, capsys):
    """The bench's settings carry OPDConfig's names; a settings.json recorded under the old ones is read under the new
    (resume, --stage recipe), and a command line with an old flag is refused naming the new one."""
    from bench.learning import main
    from bench.learning_config import RENAMED, upgrade_settings

    old = {"arms": "j", "lr": 3e-5, "seq_sft_epochs": 8, "seq_sft_lr": 1e-4, "seq_handover_reset": 10,
           "completions_per_step": 64, "train_temperature": 0.9, "max_new_tokens": 48}
    new = {"arms": "j", "learning_rate": 3e-5, "sft_max_epochs": 8, "sft_learning_rate": 1e-4, "sft_handover_reset": 10,
           "per_device_train_batch_size": 64, "temperature": 0.9, "max_completion_length": 48}
    assert upgrade_settings(old, "s.json") == new and upgrade_settings(new, "s.json") == new
    import dataclasses

    fields = {f.name for f in dataclasses.fields(LearningConfig)}
    assert set(RENAMED.values()) <= fields and not set(RENAMED) & fields
    assert upgrade_settings({"lr": 1e-5, "learning_rate": 1e-5}, "s.json") == {"learning_rate": 1e-5}
    with pytest.raises(ValueError, match=r"s.json: 'lr' is the old name of 'learning_rate'.*1e-05 and 3e-05"):
        upgrade_settings({"lr": 1e-5, "learning_rate": 3e-5}, "s.json")
    # a resume on a directory recorded under the old names: the same experiment, recorded under the new names
    merged = merge_settings({**old, "out": "/a"}, {**new, "out": "/a"}, ["j"])
    assert merged["learning_rate"] == 3e-5 and not set(RENAMED) & set(merged)
    with pytest.raises(ValueError, match=r"other settings \(\['sft_max_epochs'\]\)"):
        merge_settings({**old, "out": "/a"}, {**new, "out": "/a", "sft_max_epochs": 2}, ["j"])
    # --stage recipe reads an old settings.json: arm j's recipe has its recorded values
    out = tmp_path / "run"
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({**old, "start_path": str(tmp_path / "start"), "out": str(out)}))
    assert main(["--out", str(out), "--stage", "recipe", "--arm", "j"]) == 0
    recipe = yaml.safe_load(capsys.readouterr().out)
    assert (recipe["learning_rate"], recipe["sft_max_epochs"], recipe["sft_learning_rate"], recipe["sft_handover_reset"],
            recipe["per_device_train_batch_size"], recipe["temperature"], recipe["max_completion_length"]) == (
        3e-5, 8, 1e-4, 10, 64, 0.9, 48)
    (out / "settings.json").write_text(json.dumps({"seq_sft_epochs": 8, "sft_max_epochs": 2, "start_path": "/s"}))
    assert main(["--out", str(out), "--stage", "recipe", "--arm", "j"]) == 2
    assert "'seq_sft_epochs' is the old name of 'sft_max_epochs'" in capsys.readouterr().err
    for flag in ("--seq_sft_epochs", "--lr=3e-5"):
        assert main(["--out", str(out), flag, "2"]) == 2
        name = flag[2:].split("=")[0]
        assert f"--{name} is now --{RENAMED[name]}" in capsys.readouterr().err


def test_report_tables_and_comparisons(tmp_path):
    cfg = LearningConfig(out=str(tmp_path / "run"), arms="a,c,d", marks="10,20", budget_s=20, n_test=4, eval_samples=4)
    ev = cfg.dir / "evals"
    probs = ["p1", "p2", "p3", "p4"]
    write_parquet(_rows("student", {p: [0, 0, 0, 0] for p in probs}), ev / "student.parquet")
    write_parquet(_rows("teacher", {p: [1, 1, 1, 0] for p in probs}, mark=120), ev / "teacher.parquet")
    a = _rows("a", {p: [0, 0, 0, 1] for p in probs}, 10, 5) + _rows("a", {p: [0, 0, 1, 1] for p in probs}, 20, 11)
    c = (_rows("c", {p: [0, 1, 1, 1] for p in probs}, 10, 4)
         + _rows("c", {"p1": [1] * 4, "p2": [1, 1, 1, 0], "p3": [1, 1, 0, 0], "p4": [1, 1, 1, 1]}, 20, 9))
    write_parquet(a, ev / "a.parquet")
    write_parquet(c, ev / "c.parquet")
    res = report(cfg)
    assert res["student"]["avg_at_k"] == 0.0 and res["teacher"]["avg_at_k"] == 0.75
    assert res["arms"]["a"]["marks"]["20.0"]["avg_at_k"] == 0.5
    assert res["arms"]["c"]["marks"]["20.0"]["avg_at_k"] == pytest.approx(13 / 16)
    assert res["arms"]["c"]["marks"]["20.0"]["step"] == 9
    assert res["arms"]["a"]["marks"]["10.0"]["clip_rate"] == 0.25  # sample 0 of each problem hit the cap
    assert res["best_arm"] == "c" and "d" in res["skipped"]
    # with the requested runs recorded, only those are "not run" (here d's seed 1, not the arms x last seeds)
    (cfg.dir / "settings.json").write_text(json.dumps({"runs": ["a", "c", "d-s1"]}))
    assert set(report(cfg)["skipped"]) == {"d-s1"}
    (cfg.dir / "settings.json").unlink()
    res = report(cfg)
    cmp = res["comparisons_at_last_mark"]["a"]
    diffs = [0.5, 0.25, 0.0, 0.5]  # c - a per problem
    m = sum(diffs) / 4
    se = math.sqrt(sum((v - m) ** 2 for v in diffs) / 3) / 2
    assert cmp["best_minus_arm"] == pytest.approx(m) and cmp["stderr"] == pytest.approx(se)
    assert cmp["n_sigma"] == pytest.approx(m / se)
    # the other filter: sample 3 of every problem counts as right under "math" in these rows
    o = res["other_filter"]
    assert o["answer_filter"] == "math" and o["student"]["avg_at_k"] == 0.25
    assert o["arms"]["a"]["marks"]["20.0"]["avg_at_k"] == 0.5 and o["teacher"]["avg_at_k"] == 1.0
    md = (cfg.dir / "results.md").read_text()
    assert "| c: OPD + reward |" in md and "c − a: +0.312" in md and "arm d skipped" in md
    assert "answer filter `numeric`" in md and "answer filter `math`" in md
    assert json.loads((cfg.dir / "results.json").read_text())["best_arm"] == "c"
    if importlib.util.find_spec("matplotlib"):  # optional: without it the report writes its tables only
        assert (cfg.dir / "learning.png").stat().st_size > 10_000
    else:
        assert not (cfg.dir / "learning.png").exists()
    # the late mean: per problem, every sample of the last marks (here both) pooled, then paired
    late = res["late_mean"]
    assert late["marks"] == [10.0, 20.0] and late["best_arm"] == "c"
    assert late["comparisons"]["c"]["late_mean"] == pytest.approx(25 / 32)
    diffs = [7 / 8 - 3 / 8, 6 / 8 - 3 / 8, 5 / 8 - 3 / 8, 7 / 8 - 3 / 8]
    m = sum(diffs) / 4
    se = math.sqrt(sum((v - m) ** 2 for v in diffs) / 3) / 2
    assert late["comparisons"]["a"]["best_minus_arm"] == pytest.approx(m)
    assert late["comparisons"]["a"]["stderr"] == pytest.approx(se)
    assert late["comparisons"]["a"]["gain_over_start"] == pytest.approx(3 / 8)
    assert "Late mean (each problem's pass rate pooled over the marks at 10, 20 s" in md and "c − a: +0.406" in md
    one = report(LearningConfig(out=cfg.out, arms="a,c", marks="10,20", budget_s=20, n_test=4, eval_samples=4,
                                late_marks=1))  # the last mark only: the same numbers as the last-mark comparison
    assert one["late_mean"]["comparisons"]["a"]["best_minus_arm"] == pytest.approx(0.3125)
    tie = tmp_path / "tie"  # every arm level: no "best" named
    for name, rows in (("student", _rows("student", {"p1": [0, 1]})), ("a", _rows("a", {"p1": [1, 0]}, 10, 1)),
                       ("c", _rows("c", {"p1": [0, 1]}, 10, 1))):
        write_parquet(rows, tie / "evals" / f"{name}.parquet")
    report(LearningConfig(out=str(tie), arms="a,c", marks="10", budget_s=10, n_test=1, eval_samples=2))
    assert "no arm ahead, all at 0.500" in (tie / "results.md").read_text()
    assert "late_mean" not in report(LearningConfig(out=cfg.out, arms="a", marks="10,20", budget_s=20, n_test=4,
                                                    eval_samples=4, late_marks=0))
    # a report asked for a subset of arms still shows every arm with results in the directory
    sub = report(LearningConfig(out=cfg.out, arms="a", marks="10,20", budget_s=20, n_test=4, eval_samples=4))
    assert set(sub["arms"]) == {"a", "c"} and not sub["skipped"]


@pytest.mark.slow
def test_cpu_smoke_run_all_arms_and_resume(tmp_path):
    """The whole experiment at toy size on the embedded SmolLM2 (CPU): every table written, then a re-run resumes."""
    out = tmp_path / "learn"
    # the start and the teacher built by step count, as the GPU commands of bench/LEARNING.md do
    cmd = [sys.executable, "-m", "bench.learning", "--out", str(out), "--preset", "cpu_smoke", "--start_sft_steps", "2",
           "--teacher_sft_steps", "3", "--keep_final", "--arms", "a,c,d,f"]  # the arms last: p2b replaces them
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "start: SFT" in p.stdout and "(step 2)" in p.stdout and "(step 3)" in p.stdout
    settings = json.loads((out / "settings.json").read_text())
    assert settings["runs"] == ["a", "c", "d", "f"] and settings["start_path"] == str(out / "start")
    cfg = LearningConfig(out=str(out), preset="cpu_smoke", start_sft_steps=2, teacher_sft_steps=3)
    per_mark = cfg.n_test * cfg.eval_samples
    from transformers import AutoModelForCausalLM

    from bench.learning import arm_recipe

    for arm in ("a", "c", "d", "f"):
        t = pq.read_table(out / "evals" / f"{arm}.parquet").to_pylist()
        assert len(t) == per_mark * len(cfg.mark_list), arm
        assert sorted({r["mark_s"] for r in t}) == cfg.mark_list
        assert all(r["train_s"] >= r["mark_s"] for r in t)
        assert all(r["correct_numeric"] is not None and r["correct_math"] is not None for r in t)
        # the arm ran the recipe it saved, through stages.train and stages.evaluate
        saved = yaml.safe_load((out / "arms" / arm / "train.yaml").read_text())
        assert saved == arm_recipe(cfg, arm) and saved["output_dir"] == str(out / "arms" / arm)
        trained = (out / "arms" / arm / "metrics" / "train.jsonl").read_text() != ""  # stage one may use d's, f's budget
        assert (out / "arms" / arm / "train_summary.json").exists() == trained
        steps = {r["step"]: r["mark_s"] for r in sorted(t, key=lambda r: -r["mark_s"])}  # first mark of each export
        assert sorted(p.name for p in (out / "arms" / arm / "eval").iterdir()) == sorted(
            f"{arm}-{m:g}" for m in steps.values())  # one stages.evaluate run per export
        assert not (out / "arms" / arm / "marks").exists()  # mark exports are deleted once evaluated ...
    assert AutoModelForCausalLM.from_pretrained(out / "arms" / "c" / "final").num_parameters() > 100_000_000  # ... but c's last
    manifest = json.loads((out / "stage_one" / "curate" / "manifest.json").read_text())
    assert manifest["engine"]["name"] == "hf-cpu" and manifest["config"]["teacher_samples"] == cfg.stage_one_samples
    assert pq.read_table(out / "evals" / "student.parquet").num_rows == per_mark
    assert pq.read_table(out / "data" / "stage_one.parquet").num_rows == cfg.stage_one_problems
    assert (out / "arms" / "a" / "metrics" / "train.jsonl").exists()
    rec = json.loads((out / "arms" / "c" / "metrics" / "train.jsonl").read_text().splitlines()[0])
    assert rec["kl/sampled_mean"] != 0  # c reads the fine-tuned teacher
    rec_a = json.loads((out / "arms" / "a" / "metrics" / "train.jsonl").read_text().splitlines()[0])
    assert rec_a["kl/sampled_mean"] == 0  # a never runs the teacher
    s1_seconds = json.loads((out / "data" / "stage_one.json").read_text())["seconds"]
    if s1_seconds < cfg.budget_s * 0.5:  # f trained (under heavy load stage one can use f's whole budget, as for d)
        recs_f = [json.loads(x) for x in (out / "arms" / "f" / "metrics" / "train.jsonl").read_text().splitlines()]
        assert recs_f[0]["sft/off_policy_step"] == 1.0 and recs_f[0]["loss/sft"] > 0  # share ~0.8 at the start
    sols = pq.read_table(out / "arms" / "f" / "curriculum.parquet").column("teacher_solution").to_pylist()
    assert len(sols) == cfg.n_train and sum(x is not None for x in sols) == cfg.stage_one_problems  # sft_filter none
    res = json.loads((out / "results.json").read_text())
    assert set(res["arms"]) == {"a", "c", "d", "f"} and res["best_arm"] in ARMS

    assert AutoModelForCausalLM.from_pretrained(out / "teacher").num_parameters() > 100_000_000
    recs_d = [json.loads(x) for x in (out / "arms" / "d" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert all(r["sft/off_policy_step"] == 1.0 for r in recs_d)  # SFT: every step off-policy
    # a re-run with the same settings skips every finished piece; one asking for fewer arms keeps the others
    p2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0 and p2.stdout.count("already done") == 4, p2.stdout[-2000:]
    p2b = subprocess.run(cmd[:-1] + ["a"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p2b.returncode == 0 and set(json.loads((out / "results.json").read_text())["arms"]) == {"a", "c", "d", "f"}
    # other settings in the same directory are refused (exit 2), nothing overwritten
    p3 = subprocess.run(cmd + ["--learning_rate", "3e-5"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p3.returncode == 2 and "other settings" in p3.stderr
    # a second experiment on this one's start and teacher (regime (ii)'s teacher from an earlier run): copied, and
    # scored exactly as they were (same weights, same seeded evaluation)
    out2 = tmp_path / "learn2"
    p4 = subprocess.run([sys.executable, "-m", "bench.learning", "--out", str(out2), "--preset", "cpu_smoke",
                         "--start_model", str(out / "start"), "--teacher_model", str(out / "teacher"), "--stage", "setup"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p4.returncode == 0, p4.stdout[-2000:] + p4.stderr[-2000:]
    assert "SFT" not in p4.stdout  # nothing trained
    for name in ("student", "teacher"):
        key = lambda r: (r["problem_id"], r["sample_index"])  # noqa: E731
        a = sorted(pq.read_table(out / "evals" / f"{name}.parquet").to_pylist(), key=key)
        b = sorted(pq.read_table(out2 / "evals" / f"{name}.parquet").to_pylist(), key=key)
        assert [r["completion"] for r in a] == [r["completion"] for r in b], name
    assert (out2 / "teacher" / "config.json").exists() and not (out2 / ".teacher.tmp").exists()


@pytest.mark.slow
def test_cpu_sequential_arm_is_evaluated_at_its_hand_over(tmp_path):
    """Arm j at toy size (CPU): besides its marks, the model after its last off-policy step is exported off the clock
    and evaluated as mark HANDOVER_MARK, and the report measures the on-policy steps from it."""
    from bench.learning_config import HANDOVER_MARK

    out = tmp_path / "learn"
    cmd = [sys.executable, "-m", "bench.learning", "--out", str(out), "--preset", "cpu_smoke", "--start_sft_steps", "2",
           "--teacher_sft_steps", "3", "--arms", "j", "--sft_max_epochs", "1", "--budget_s", "60", "--marks", "30,60"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cfg = LearningConfig(out=str(out), preset="cpu_smoke")
    recs = [json.loads(x) for x in (out / "arms" / "j" / "metrics" / "train.jsonl").read_text().splitlines()]
    kinds = [r["sft/off_policy_step"] for r in recs]
    # 1 pass over stage one's 16 solutions (sft_filter none), 8 a step: 2 off-policy steps, then on-policy
    assert kinds[:3] == [1.0, 1.0, 0.0], kinds
    rows = pq.read_table(out / "evals" / "j.parquet").to_pylist()
    ho = [r for r in rows if r["mark_s"] == HANDOVER_MARK]
    assert len(ho) == cfg.n_test * cfg.eval_samples and {r["step"] for r in ho} == {2}
    later = [r for r in rows if r["mark_s"] == 60.0]
    assert max(r["train_s"] for r in ho) < min(r["train_s"] for r in later) and later[0]["step"] > 2
    assert (out / "arms" / "j" / "eval" / "j-handover").is_dir() or any(  # its own evaluation, or a mark's export
        r["step"] == 2 for r in rows if r["mark_s"] == 30.0)
    h = json.loads((out / "results.json").read_text())["handover"]["j"]
    assert h["step"] == 2 and h["last_step"] == later[0]["step"] and "last_minus_handover" in h
    assert "- j: hand-over at" in (out / "results.md").read_text()


def test_arm_runs_rates_and_seeds(tmp_path):
    cfg = LearningConfig(out=str(tmp_path / "r"), arms="d,f@3e-5,c", arm_lr="d=5e-5", seeds="0,2")
    assert cfg.instances == ["d@5e-05", "d@5e-05-s2", "f@3e-05", "f@3e-05-s2", "c", "c-s2"]
    assert cfg.parse_run("f@3e-05-s2") == ("f", 3e-5, 2) and cfg.parse_run("c") == ("c", 1e-5, 0)
    assert cfg.label("d@5e-05") == ARMS["d"] + ", lr 5e-05"
    for bad in (dict(arms="f@x"), dict(arm_lr="z=1e-5"), dict(arm_lr="d=0"), dict(seeds="a"), dict(arms="c-s1")):
        with pytest.raises(ValueError):
            LearningConfig(out=str(tmp_path / "r"), **bad)
    with pytest.raises(ValueError, match="not an arm run"):
        cfg.parse_run("teacher")


def test_arm_curriculum_carries_verified_solutions_and_stated_answer(tmp_path):
    from bench.learning import arm_curriculum

    cfg = LearningConfig(out=str(tmp_path / "r"))
    base = [dict(problem_id=p, problem=f"q{p}", answer=a, reference=f"ref {p}", bucket=0, curriculum_index=i,
                 prompt_style="reasoning", source="synth") for i, (p, a) in enumerate([("p1", "3"), ("p2", "7")])]
    write_parquet(base, cfg.dir / "data" / "curriculum.parquet")
    verified = [dict(problem_id="p1", completion="a longer solution, 3"), dict(problem_id="p1", completion="3")]
    f = pq.read_table(arm_curriculum(cfg, "f", "f", verified)).to_pylist()
    assert [r["teacher_solution"] for r in f] == ["3", None]  # shortest verified; p2 has none
    g = pq.read_table(arm_curriculum(cfg, "g", "g-s1", None)).to_pylist()
    assert g[1]["reference"] == "ref p2\nThe final answer is 7."
    assert "teacher_solution" not in g[0] or g[0]["teacher_solution"] is None
    # i: both -- f's verified solutions and g's stated answer
    i = pq.read_table(arm_curriculum(cfg, "i", "i", verified)).to_pylist()
    assert [r["teacher_solution"] for r in i] == ["3", None] and i[0]["reference"] == "ref p1\nThe final answer is 3."
    assert f[0]["reference"] == "ref p1"  # f's reference stays as it is
    assert arm_curriculum(cfg, "c", "c", None) == cfg.dir / "data" / "curriculum.parquet"


def test_stage_one_filter_formal_keeps_its_rows_in_order_and_charges_the_students_seconds(tmp_path):
    """stage_one_filter formal (run 4's arm F): an off-policy arm trains on stage one's kept rows in stage one's
    order (curriculum: ordered) and its clock carries the start's pass-rate sampling too; '+all' (arm N) trains on
    every arm problem, shuffled, charged the teacher's seconds only; arms without stage one are untouched."""
    from bench.learning import (NothingToTrain, arm_curriculum, arm_recipe, formal_stage_one_filter,
                                stage_one_filtered, stage_one_seconds)

    cfg = LearningConfig(out=str(tmp_path / "r"), stage_one_filter="formal", arms="j,j+all,d,d+all,c")
    base = [dict(problem_id=f"p{i}", problem=f"q{i}", answer=str(i), reference=f"ref {i}", bucket=0, curriculum_index=i,
                 prompt_style="reasoning", source="synth") for i in range(5)]
    write_parquet(base, cfg.dir / "data" / "curriculum.parquet")
    (cfg.dir / "data" / "stage_one.json").write_text(json.dumps(
        {"seconds": 12.5, "student_seconds": 7.5, "filter": "formal", "kept": ["p3", "p0", "p4"]}))
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    verified = [dict(problem_id="p3", completion="3"), dict(problem_id="p1", completion="1")]
    j = pq.read_table(arm_curriculum(cfg, "j", "j", verified)).to_pylist()
    assert [r["problem_id"] for r in j] == ["p3", "p0", "p4"] and [r["curriculum_index"] for r in j] == [0, 1, 2]
    assert [r["teacher_solution"] for r in j] == ["3", None, None]
    n = pq.read_table(arm_curriculum(cfg, "j", "j+all", verified)).to_pylist()
    assert [r["problem_id"] for r in n] == [f"p{i}" for i in range(5)] and n[1]["teacher_solution"] == "1"
    assert stage_one_seconds(cfg, "j") == 20.0 and stage_one_seconds(cfg, "d") == 20.0  # teacher + start
    assert stage_one_seconds(cfg, "j+all") == 12.5 and stage_one_seconds(cfg, "c") == 0.0  # teacher only; none
    assert stage_one_filtered(cfg, "d") and not stage_one_filtered(cfg, "d+all") and not stage_one_filtered(cfg, "c")
    assert arm_recipe(cfg, "j")["curriculum"] == "ordered" and arm_recipe(cfg, "j+all")["curriculum"] == "shuffled"
    assert cfg.label("j+all").endswith("every arm problem (no stage-one filter)")
    # configs/curate_r1_distill_1p5b_filtered.yaml's
    assert formal_stage_one_filter() == dict(student_samples=8, band_low=0.0, band_high=1.0, zero_pass_share=0.25,
                                             order="easy_to_hard", temperature=1.0)
    (cfg.dir / "data" / "stage_one.json").write_text(json.dumps(
        {"seconds": 1.0, "student_seconds": 1.0, "filter": "formal", "kept": [], "measured": 5}))
    with pytest.raises(NothingToTrain, match="kept none of its 5 problems: it keeps only problems the teacher solved"):
        arm_curriculum(cfg, "j", "j", verified)
    assert len(pq.read_table(arm_curriculum(cfg, "j", "j+all", verified))) == 5  # N needs no kept row
    with pytest.raises(ValueError, match=r"\+all .* stage_one_filter formal"):
        LearningConfig(out=str(tmp_path / "n"), arms="j+all")  # the filter off: +all would be the arm itself
    with pytest.raises(ValueError, match=r"\+all"):
        LearningConfig(out=str(tmp_path / "n2"), stage_one_filter="formal", arms="c+all")  # no stage one
    # 'filtered' names the same stage one (the formal stage one no longer filters); 'formal' stays for logged commands
    assert LearningConfig(out=str(tmp_path / "f2"), stage_one_filter="filtered", arms="j").stage_one_filter == "formal"
    with pytest.raises(ValueError, match="stage_one_filter must be"):
        LearningConfig(out=str(tmp_path / "n3"), stage_one_filter="band")


def test_report_pools_seeds_of_one_arm(tmp_path):
    cfg = LearningConfig(out=str(tmp_path / "run"), arms="c", seeds="0,1", marks="10", budget_s=10, n_test=2,
                         eval_samples=2)
    ev = cfg.dir / "evals"
    write_parquet(_rows("student", {"p1": [0, 0], "p2": [0, 0]}), ev / "student.parquet")
    write_parquet(_rows("c", {"p1": [1, 1], "p2": [0, 0]}, 10, 3), ev / "c.parquet")
    write_parquet(_rows("c-s1", {"p1": [1, 0], "p2": [1, 0]}, 10, 4), ev / "c-s1.parquet")
    res = report(cfg)
    assert set(res["arms"]) == {"c"} and res["arms"]["c"]["runs"] == ["c", "c-s1"]
    assert (res["arms"]["c"]["marks"]["10.0"]["step_min"], res["arms"]["c"]["marks"]["10.0"]["step"]) == (3, 4)
    assert "| 3–4 |" in (cfg.dir / "results.md").read_text()  # the seeds' step counts as a range
    assert legend_label("c", res["arms"]["c"]) == "c: OPD + reward (2 seeds pooled)"
    assert res["arms"]["c"]["marks"]["10.0"]["avg_at_k"] == pytest.approx(0.5)
    assert res["arms"]["c"]["last_mark_by_run"] == {"c": 0.5, "c-s1": 0.5}
    assert res["comparisons_at_last_mark"]["c"]["gain_over_start"] == pytest.approx(0.5)


def test_report_measures_the_on_policy_phase_from_the_hand_over(tmp_path):
    """A sequential arm's evaluation at its hand-over (mark_s = HANDOVER_MARK) stays out of the per-mark tables and
    the late mean; the report gives last mark − hand-over, paired over problems, per run."""
    from bench.learning_config import HANDOVER_MARK

    cfg = LearningConfig(out=str(tmp_path / "run"), arms="j,d", marks="10,20", budget_s=20, n_test=4, eval_samples=4)
    ev = cfg.dir / "evals"
    probs = ["p1", "p2", "p3", "p4"]
    write_parquet(_rows("student", {p: [0, 0, 0, 0] for p in probs}), ev / "student.parquet")
    ho = {"p1": [1, 1, 1, 1], "p2": [1, 1, 0, 0], "p3": [1, 0, 0, 0], "p4": [0, 0, 0, 0]}
    end = {"p1": [1, 1, 0, 0], "p2": [1, 1, 0, 0], "p3": [0, 0, 0, 0], "p4": [0, 0, 0, 1]}
    ho_rows = [{**r, "train_s": 13.4} for r in _rows("j", ho, HANDOVER_MARK, 7)]  # after step 7, 13.4 s in
    j = _rows("j", {p: [0, 0, 1, 1] for p in probs}, 10, 5) + ho_rows + _rows("j", end, 20, 12)
    write_parquet(j, ev / "j.parquet")
    write_parquet(_rows("d", {p: [0, 1, 1, 1] for p in probs}, 10, 5) + _rows("d", end, 20, 12), ev / "d.parquet")
    res = report(cfg)
    assert set(res["arms"]["j"]["marks"]) == {"10.0", "20.0"}  # the hand-over is no mark of the table
    assert res["late_mean"]["comparisons"]["j"]["late_mean"] == pytest.approx(0.40625)  # marks 10 and 20 only
    h = res["handover"]["j"]
    assert (h["step"], h["avg_at_k"], h["last_step"], h["last_avg_at_k"]) == (7, pytest.approx(0.4375), 12, 0.3125)
    diffs = [-0.5, 0.0, -0.25, 0.25]  # end - hand-over per problem
    m = sum(diffs) / 4
    assert h["last_minus_handover"] == pytest.approx(m)
    assert h["last_minus_handover_stderr"] == pytest.approx(math.sqrt(sum((v - m) ** 2 for v in diffs) / 3) / 2)
    rates = [1.0, 0.5, 0.25, 0.0]  # the hand-over's own avg@k and its standard error over problems
    mr = sum(rates) / 4
    assert h["stderr"] == pytest.approx(math.sqrt(sum((v - mr) ** 2 for v in rates) / 3) / 2)
    assert "d" not in res["handover"]
    md = (cfg.dir / "results.md").read_text()
    assert "- j: hand-over at 13 s (step 7) 0.438 ± 0.213; at 20 s (step 12) 0.312, on-policy steps' effect -0.125 ± 0.161" in md
    # the plot marks the hand-over in both panels, at its own clock time and score
    from bench.learning_report import plot

    pytest.importorskip("matplotlib")
    drawn = plot(res, cfg, tmp_path / "p.png")
    assert [(f, n) for f, n, _, _ in drawn] == [("numeric", "j"), ("math", "j")]
    assert drawn[0][2] == pytest.approx(13.4 / 60) and drawn[0][3] == pytest.approx(0.4375)
    # a sequential run whose clock ended in its SFT passes is named as such
    write_parquet(_rows("j-s1", {p: [0, 0, 1, 1] for p in probs}, 10, 5) + _rows("j-s1", end, 20, 12),
                  ev / "j-s1.parquet")
    res = report(cfg)
    assert res["handover"]["j-s1"] == {"reached": False, "last_step": 12} and res["handover"]["j"]["reached"]
    assert "- j-s1: hand-over not reached: every step to 20 s (step 12) was off-policy" in (cfg.dir / "results.md").read_text()


def _plain_rate_difference(x_rows, y_rows):
    """Reference for the shared hand-over test: per problem, the pass rate over every row of x minus that of y;
    mean over problems and its standard error (sample sd / sqrt(n)), written out without the bench's helpers."""
    probs = sorted({r["problem_id"] for r in x_rows})
    diffs = []
    for p in probs:
        xs = [r["correct_numeric"] for r in x_rows if r["problem_id"] == p]
        ys = [r["correct_numeric"] for r in y_rows if r["problem_id"] == p]
        diffs.append(sum(xs) / len(xs) - sum(ys) / len(ys))
    m = sum(diffs) / len(diffs)
    return m, math.sqrt(sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))


def test_report_compares_runs_that_handed_over_one_model(tmp_path):
    """Runs whose hand-over evaluations are the same step and the same completions (one seed's SFT passes) are
    compared from it, per pair and pooled over the pairs of the same two arms (LEARNING.md command 17b), only at
    marks where both had stepped past the hand-over; a run whose hand-over differs in one completion, in its step or
    in its seed is paired with none."""
    from bench.learning_config import HANDOVER_MARK

    cfg = LearningConfig(out=str(tmp_path / "run"), arms="j,l", marks="10,20", budget_s=20, n_test=4, eval_samples=4)
    ev = cfg.dir / "evals"
    probs = ["p1", "p2", "p3", "p4"]
    write_parquet(_rows("student", {p: [0, 0, 0, 0] for p in probs}), ev / "student.parquet")

    def run(name, m10, m20, handover_text, step=7):  # mark 10 at step 9, mark 20 at step 12; m20=None: no mark 20
        ho = [{**r, "completion": f"{handover_text} {r['problem_id']} {r['sample_index']}"}
              for r in _rows(name, {p: [1, 0, 0, 0] for p in probs}, HANDOVER_MARK, step)]
        rows = _rows(name, dict(zip(probs, m10)), 10, 9) + ho
        rows += _rows(name, dict(zip(probs, m20)), 20, 12) if m20 else []
        write_parquet(rows, ev / f"{name}.parquet")
        return rows

    one, none_, half = [1] * 4, [0] * 4, [1, 1, 0, 0]
    r = {
        "j": run("j", [[1, 0, 0, 0], half, none_, one], [half, half, none_, [1, 1, 1, 0]], "A"),
        "l": run("l", [half, [1, 1, 1, 0], [1, 0, 0, 0], one], [[1, 1, 1, 0], one, [1, 0, 0, 0], one], "A"),
        "j-s1": run("j-s1", [none_, [1, 0, 0, 0], one, half], [[1, 0, 0, 0], [1, 0, 0, 0], one, none_], "B"),
        "l-s1": run("l-s1", [[1, 0, 0, 0], one, [1, 1, 1, 0], none_], [none_, half, one, [1, 1, 1, 0]], "B"),
        "j-s2": run("j-s2", [one] * 4, [one] * 4, "C"),
        "l-s2": run("l-s2", [none_] * 4, [none_] * 4, "C"),  # one completion changed below
        "j@3e-06-s1": run("j@3e-06-s1", [none_] * 4, [one] * 4, "B", step=8),  # l-s1's texts, another step
        "l-s3": run("l-s3", [none_] * 4, [one] * 4, "A"),  # seed 0's texts and step, another seed
        "j-s4": run("j-s4", [half, one, none_, one], [one, one, half, none_], "D"),
        "l-s4": run("l-s4", [none_, half, half, one], None, "D"),  # never evaluated at 20 s
        "j-s5": run("j-s5", [one] * 4, [half, none_, one, half], "E", step=10),  # mark 10 (step 9) before it
        "l-s5": run("l-s5", [none_] * 4, [one, one, half, none_], "E", step=10),
    }
    rows = r["l-s2"]
    rows[[i for i, x in enumerate(rows) if x["mark_s"] == HANDOVER_MARK][0]]["completion"] = "other"
    write_parquet(rows, ev / "l-s2.parquet")
    res = report(cfg)
    sh = res["shared_handovers"]
    assert [p["runs"] for p in sh["pairs"]] == [["j", "l"], ["j-s1", "l-s1"], ["j-s4", "l-s4"], ["j-s5", "l-s5"]]
    assert [p["late_marks"] for p in sh["pairs"]] == [[10, 20], [10, 20], [10], [20]]

    def at(name, marks):
        return [x for x in r[name] if x["mark_s"] in marks]

    for pr in sh["pairs"]:
        a, b = pr["runs"]
        assert (pr["step"], pr["completions"]) == (10 if a == "j-s5" else 7, 16)
        if a == "j-s4":
            assert pr["last_minus"] is None and pr["last_stderr"] is None
        else:
            assert (pr["last_minus"], pr["last_stderr"]) == pytest.approx(
                _plain_rate_difference(at(a, [20]), at(b, [20])))
        ms = pr["late_marks"]
        assert (pr["late_minus"], pr["late_stderr"]) == pytest.approx(_plain_rate_difference(at(a, ms), at(b, ms)))
    assert sh["pairs"][0]["last_minus"] == pytest.approx(-0.3125) and sh["pairs"][0]["last_stderr"] == pytest.approx(0.0625)
    [pooled] = sh["arms"]
    assert pooled["arms"] == ["j", "l"] and (pooled["last_pairs"], pooled["late_pairs"]) == (3, 4)
    assert (pooled["last_minus"], pooled["last_stderr"]) == pytest.approx(_plain_rate_difference(
        at("j", [20]) + at("j-s1", [20]) + at("j-s5", [20]), at("l", [20]) + at("l-s1", [20]) + at("l-s5", [20])))
    assert (pooled["late_minus"], pooled["late_stderr"]) == pytest.approx(_plain_rate_difference(
        at("j", [10, 20]) + at("j-s1", [10, 20]) + at("j-s4", [10]) + at("j-s5", [20]),
        at("l", [10, 20]) + at("l-s1", [10, 20]) + at("l-s4", [10]) + at("l-s5", [20])))
    own = [p["late_minus"] for p in sh["pairs"]]
    m = sum(own) / 4
    assert pooled["between_pairs_stderr"] == pytest.approx(math.sqrt(sum((v - m) ** 2 for v in own) / 3) / 2)
    md = (cfg.dir / "results.md").read_text()
    assert "- j − l (step 7, 16 completions equal): at 20 s -0.312 ± 0.062; late mean (10, 20 s)" in md
    assert "- j-s4 − l-s4 (step 7, 16 completions equal): no mark at 20 s past the hand-over in both; late mean (10 s)" in md
    assert (f"- j − l, seeds pooled per problem: at 20 s {pooled['last_minus']:+.3f} ± {pooled['last_stderr']:.3f} "
            f"(3 pairs); late mean {pooled['late_minus']:+.3f} ± {pooled['late_stderr']:.3f} (4 pairs; between pairs ± "
            f"{pooled['between_pairs_stderr']:.3f})") in md

def test_seed_stderr_is_welch_over_runs_and_reaches_the_late_mean(tmp_path):
    from bench.learning_report import seed_stderr

    x, y = [0.80, 0.76, 0.78], [0.70, 0.74]
    vx = sum((v - 0.78) ** 2 for v in x) / 2
    vy = sum((v - 0.72) ** 2 for v in y) / 1
    assert seed_stderr(x, y) == pytest.approx(math.sqrt(vx / 3 + vy / 2))
    assert seed_stderr([0.8], y) is None
    # two arms with two seeds each: each run's late mean, and the Welch term beside the paired one
    cfg = LearningConfig(out=str(tmp_path / "run"), arms="c,d", seeds="0,1", marks="10,20", budget_s=20, n_test=2,
                         eval_samples=2)
    ev = cfg.dir / "evals"
    write_parquet(_rows("student", {"p1": [0, 0], "p2": [0, 0]}), ev / "student.parquet")
    runs = {"c": ([1, 1], [1, 0]), "c-s1": ([1, 0], [0, 0]), "d": ([1, 1], [1, 1]), "d-s1": ([1, 1], [1, 0])}
    for name, (p1, p2) in runs.items():
        rows = _rows(name, {"p1": p1, "p2": p2}, 10, 1) + _rows(name, {"p1": p1, "p2": p2}, 20, 2)
        write_parquet(rows, ev / f"{name}.parquet")
    write_parquet(_rows("c-s2", {"p1": [1, 1], "p2": [1, 1]}, 10, 1), ev / "c-s2.parquet")  # no 20 s mark: left out
    late = report(cfg)["late_mean"]
    assert late["best_arm"] == "d"
    c = late["comparisons"]["c"]
    assert c["by_run"] == {"c": 0.75, "c-s1": 0.25} and late["comparisons"]["d"]["by_run"] == {"d": 1.0, "d-s1": 0.75}
    assert c["late_mean"] == pytest.approx(0.5) and c["best_minus_arm"] == pytest.approx(0.375)
    assert c["seed_stderr"] == pytest.approx(seed_stderr([1.0, 0.75], [0.75, 0.25]))
    md = (cfg.dir / "results.md").read_text()
    assert "between runs ± 0.280 from 2 and 2 seeds" in md
    # each run alone: c-s2 has its 10 s mark only, so it is in neither list (no 20 s mark, no late mean)
    sd = math.sqrt(2 * 0.25**2)  # of 0.75 and 0.25
    assert (f"- c, runs c, c-s1, c-s2: at 20 s 0.7500 / 0.2500 (standard deviation {sd:.4f}); late mean 0.7500 / 0.2500 "
            f"(standard deviation {sd:.4f})") in md


def test_arm_recipes_parse_as_stage_two_configs(tmp_path):
    """Every arm's recipe is a stages.train YAML that OPDConfig parses to the arm's objective (bench/learning/arms.md)."""
    from bench.learning import _yaml, arm_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="a", w_sft=0.5, sft_share_start=0.7, sft_share_end=0.1)
    (cfg.dir).mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    teacher = str(cfg.dir / "teacher")
    # arm: (w_kl, w_reward, w_sft, sft_share_start, sft_share_end, teacher_model, teacher_context, kl_mode, own curriculum)
    want = {"a": (0, 1, 0, 0, 0, None, "teacher", "sampled", False), "b": (1, 0, 0, 0, 0, teacher, "teacher", "sampled", False),
            "c": (1, 1, 0, 0, 0, teacher, "teacher", "sampled", False), "d": (0, 0, 0, 1, 1, None, "teacher", "sampled", True),
            "e": (1, 1, 0, 0, 0, None, "privileged", "sampled", False),
            "f": (1, 1, 0.5, 0.7, 0.1, teacher, "teacher", "sampled", True),
            "g": (1, 1, 0, 0, 0, None, "privileged", "sampled", True), "h": (1, 1, 0.5, 0.7, 0.1, teacher, "teacher", "full", True),
            "i": (1, 1, 0.5, 0.7, 0.1, None, "privileged", "sampled", True),
            "j": (1, 1, 0, 1, 1, teacher, "teacher", "sampled", True),
            "k": (1, 0, 0, 1, 1, teacher, "teacher", "sampled", True), "l": (0, 1, 0, 1, 1, None, "teacher", "sampled", True)}
    assert set(want) == set(ARMS)
    from bench.learning_config import ARM_SPECS

    # the trained teacher is built when an arm reads it or its stage one samples it (d, i: not read, sampled)
    assert {k for k, v in ARM_SPECS.items() if v.needs_teacher} == {"b", "c", "d", "f", "h", "i", "j", "k", "l"}
    for arm, w in want.items():
        name = f"{arm}@3e-05-s2"
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, name), tmp_path / f"{arm}.yaml"))], env={})
        got = (args.w_kl, args.w_reward, args.w_sft, args.sft_share_start, args.sft_share_end, args.teacher_model,
               args.teacher_context, args.kl_mode, args.curriculum_path.startswith(str(cfg.dir / "arms" / name)))
        assert got == w, arm
        assert args.sft_max_epochs == (cfg.sft_max_epochs if arm in "jkl" else 0), arm  # j, k, l: SFT, then on-policy
        assert args.sft_learning_rate == 0, arm  # one rate for both phases unless --sft_learning_rate
        assert (args.learning_rate, args.seed, args.student_model) == (3e-5, 2, str(tmp_path / "start"))
        assert (args.output_dir, args.num_generations, args.per_device_train_batch_size) == (
            str(cfg.dir / "arms" / name), cfg.num_generations, cfg.per_device_train_batch_size)
        assert (args.max_completion_length, args.temperature, args.answer_filter) == (
            cfg.max_completion_length, cfg.temperature, cfg.answer_filter)
    # --sft_learning_rate: arm j's SFT passes at their own rate, on-policy at the arm's
    cfg_j = LearningConfig(out=str(tmp_path / "r"), arms="a", sft_learning_rate=1e-4)
    (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg_j, "j@3e-05"), tmp_path / "j2.yaml"))],
                           env={})
    assert (args.sft_learning_rate, args.learning_rate, args.sft_max_epochs) == (1e-4, 3e-5, 2.0)
    assert args.sft_handover_reset == 0  # moments carried unless --sft_handover_reset
    cfg_r = LearningConfig(out=str(tmp_path / "r"), arms="a", sft_handover_reset=10)
    (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg_r, "k"), tmp_path / "k.yaml"))], env={})
    assert (args.sft_handover_reset, args.w_reward) == (10, 0.0)


def test_warmup_steps_reach_every_arm_but_not_the_start(tmp_path):
    """``warmup_steps`` makes each arm's recipe a constant_with_warmup schedule of that many steps, and the
    trainer's scheduler then follows transformers' formula: lr * step / N for the first N steps."""
    from bench.learning import _yaml, arm_recipe, train_recipe
    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), arms="a", warmup_steps=10)
    cfg.dir.mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"start_path": str(tmp_path / "start")}))
    for arm in ("a", "d", "f"):
        (args,) = parse_config([OPDConfig], ["--config", str(_yaml(arm_recipe(cfg, arm), tmp_path / f"{arm}.yaml"))], env={})
        assert (getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type), args.warmup_steps) == (
            "constant_with_warmup", 10), arm
    sft = train_recipe(cfg, "sft", student="s", curriculum=tmp_path / "c.parquet", out_dir=tmp_path / "o",
                       learning_rate=1e-5, seed=0)
    assert sft["lr_scheduler_type"] == "constant" and "warmup_steps" not in sft
    import torch
    from transformers import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-5)
    sched = get_scheduler("constant_with_warmup", opt, num_warmup_steps=10, num_training_steps=100)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and abs(lrs[5] - 1.5e-5) < 1e-12 and lrs[10] == lrs[11] == 3e-5
    with pytest.raises(ValueError, match="warmup_steps"):
        LearningConfig(out=str(tmp_path / "x"), warmup_steps=-1)


def test_teacher_n_train_widens_only_the_teachers_problems(tmp_path):
    """--teacher_n_train: the teacher's SFT table holds the arms' training problems first, then more of the same
    split; the arms' tables and the test split are unchanged, and no test problem is in it."""
    from bench.learning import build_data, read_rows

    plain = build_data(LearningConfig(out=str(tmp_path / "p"), n_train=30, n_test=12))
    wide = build_data(LearningConfig(out=str(tmp_path / "w"), n_train=30, n_test=12, teacher_n_train=90))
    assert "teacher_curriculum" not in plain and set(wide) == {"train", "test", "curriculum", "teacher_curriculum"}
    for k in ("train", "test", "curriculum"):
        assert read_rows(plain[k]) == read_rows(wide[k]), k
    # n_train itself means the arms' own problems: recorded as 0, so a resume accepts either spelling
    assert LearningConfig(out=str(tmp_path / "s"), n_train=30, teacher_n_train=30).teacher_n_train == 0
    assert LearningConfig(out=str(tmp_path / "s"), arms="j", sft_max_epochs=1.5).label("j") == (
        "sequential: SFT on verified solutions for 1.5 passes, then OPD + reward")
    assert LearningConfig(out=str(tmp_path / "s"), arms="k", sft_max_epochs=8).label("k@1e-06") == (
        "sequential: SFT on verified solutions for 8 passes, then OPD only (w_reward=0), lr 1e-06")
    teach = read_rows(wide["teacher_curriculum"])
    ids = [r["problem_id"] for r in teach]
    assert len(teach) == 90 == len(set(ids))
    assert ids[:30] == [r["problem_id"] for r in read_rows(wide["curriculum"])]
    assert not set(ids) & {r["problem_id"] for r in read_rows(wide["test"])}
    assert [r["curriculum_index"] for r in teach] == list(range(90))
    # --fresh_arm_problems: the start keeps the first 30 (the plain run's problems), the arms get the next 30
    fresh = build_data(LearningConfig(out=str(tmp_path / "f"), n_train=30, n_test=12, teacher_n_train=90,
                                      start_sft_steps=2, fresh_arm_problems=True))
    assert set(fresh) == {"train", "test", "curriculum", "teacher_curriculum", "start_curriculum"}
    assert read_rows(fresh["start_curriculum"]) == read_rows(plain["curriculum"])
    arm_ids = [r["problem_id"] for r in read_rows(fresh["curriculum"])]
    assert arm_ids == ids[30:60] == [r["problem_id"] for r in read_rows(fresh["train"])]
    assert read_rows(fresh["test"]) == read_rows(plain["test"])
    assert read_rows(fresh["teacher_curriculum"]) == teach


def test_a_moved_run_directory_takes_its_start_along(tmp_path):
    """Tables copied back from a GPU machine record their old --out: the arms' start follows the directory when
    it was the run's own start/, and a given student path is kept as recorded."""
    from bench.learning import arm_recipe, start_path

    cfg = LearningConfig(out=str(tmp_path / "here"), arms="c")
    cfg.dir.mkdir(parents=True)
    (cfg.dir / "settings.json").write_text(json.dumps({"out": "/tmp/learn_i4", "start_path": "/tmp/learn_i4/start"}))
    assert start_path(cfg) == str(cfg.dir / "start")
    assert arm_recipe(cfg, "c")["student_model"] == str(cfg.dir / "start")
    (cfg.dir / "settings.json").write_text(json.dumps({"out": "/tmp/learn_i4", "start_path": "/models/student"}))
    assert start_path(cfg) == "/models/student"
    # an older record of a relative --out (start_path was always resolved), read from where it was typed
    old = tmp_path / "rel"
    (cfg.dir / "settings.json").write_text(json.dumps({"out": "rel", "start_path": str(old / "start")}))
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert start_path(cfg) == str(cfg.dir / "start")
    finally:
        os.chdir(cwd)


def test_report_names_each_arms_best_rate_and_whether_the_sweep_brackets_it(tmp_path):
    """Arm a at three rates, c at two (one with a second seed), d at one: the sweep lists a and c only, picks the
    best on the late mean (marks 10 and 20 pooled), and says when the best is the sweep's lowest or highest rate."""
    cfg = LearningConfig(out=str(tmp_path / "run"), arms="a", marks="10,20", late_marks=2, budget_s=20, n_test=2,
                         eval_samples=2)  # default lr 1e-5: run "a" is a@1e-05
    ev = cfg.dir / "evals"
    write_parquet(_rows("student", {"p1": [0, 0], "p2": [0, 0]}), ev / "student.parquet")
    runs = {  # name: (10 s marks, 20 s marks), per problem p1, p2
        "a@3e-06": (([0, 0], [0, 0]), ([1, 0], [0, 0])),  # late 0.125
        "a": (([1, 0], [1, 0]), ([1, 1], [1, 0])),  # late 0.625
        "a@3e-05": (([1, 1], [1, 1]), ([0, 0], [0, 0])),  # late 0.5, 0.0 at 20 s
        "c": (([0, 0], [0, 0]), ([1, 0], [0, 0])),  # late 0.125
        "c-s1": (([1, 1], [0, 0]), ([1, 1], [0, 0])),  # late 0.5 -> c pooled 0.3125
        "c@3e-05": (([1, 1], [1, 0]), ([1, 1], [1, 1])),  # late 0.875
        "d@3e-05": (([1, 1], [1, 1]), ([1, 1], [1, 1])),
    }
    for name, (m10, m20) in runs.items():
        rows = _rows(name, dict(zip(("p1", "p2"), m10)), 10, 1) + _rows(name, dict(zip(("p1", "p2"), m20)), 20, 2)
        write_parquet(rows, ev / f"{name}.parquet")
    sw = report(cfg)["rate_sweep"]
    assert set(sw) == {"a", "c"}
    a = sw["a"]
    assert list(a["rates"]) == ["3e-06", "1e-05", "3e-05"] and a["chosen_on"] == "late_mean"
    assert [r["late_mean"] for r in a["rates"].values()] == pytest.approx([0.125, 0.625, 0.5])
    assert [r["last_mark"] for r in a["rates"].values()] == pytest.approx([0.25, 0.75, 0.0])
    assert (a["best_lr"], a["edge"]) == (1e-5, False)
    assert sw["c"]["rates"]["1e-05"]["late_mean"] == pytest.approx(0.3125)
    assert (sw["c"]["best_lr"], sw["c"]["edge"]) == (3e-5, True)
    md = (cfg.dir / "results.md").read_text()
    assert ("- a (reward only (w_kl=0)), at 20 s: 3e-06 0.250 (late 0.125), 1e-05 0.750 (late 0.625), 3e-05 0.000 "
            "(late 0.500); best on the late mean: **1e-05**") in md
    assert "best on the late mean: **3e-05**: the sweep's edge, a rate beyond it is untried" in md


def _pool_dir(root: Path, runs: dict[str, dict[str, list[bool]]], *, student_text="x", **settings) -> Path:
    """A run directory as a lease leaves it: settings.json, the setup's evaluations and some arm runs."""
    from data_tools.runio import write_json

    write_json({"budget_s": 10.0, "marks": "10", "learning_rate": 1e-5, "deadline_s": 540.0, **settings},
               root / "settings.json")
    probs = {"p1": [0, 1], "p2": [0, 0]}
    student = _rows("student", probs)
    for r in student:
        r["completion"] = f"{student_text}-{r['problem_id']}-{r['sample_index']}"
    write_parquet(student, root / "evals" / "student.parquet")
    write_parquet(_rows("teacher", {"p1": [1, 1], "p2": [1, 0]}), root / "evals" / "teacher.parquet")
    for name, rates in runs.items():
        write_parquet(_rows(name, rates, 10, 3), root / "evals" / f"{name}.parquet")
        (root / "arms" / name / "metrics").mkdir(parents=True)
        (root / "arms" / name / "metrics" / "train.jsonl").write_text('{"step": 1}\n')
    return root


def test_pool_joins_a_later_lease_after_checking_its_setup(tmp_path):
    from bench.learning_pool import pool

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}})
    src = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}}, deadline_s=300.0, arms="c", seeds="1")
    rec = pool(dest, src)
    assert rec["copied"] == ["c-s1"] and rec["skipped"] == []
    assert rec["checked"] == ["student (4 completions equal, graded alike)", "teacher (4 completions equal, graded alike)"]
    assert pq.read_table(dest / "evals" / "c-s1.parquet").num_rows == 4
    assert (dest / "arms" / "c-s1" / "metrics" / "train.jsonl").read_text() == '{"step": 1}\n'
    cfg = LearningConfig(out=str(dest), arms="c", seeds="0,1", marks="10", budget_s=10, n_test=2, eval_samples=2)
    assert report(cfg)["arms"]["c"]["runs"] == ["c", "c-s1"]  # the pooled seed is read with the first
    again = pool(dest, src)  # the same runs again: skipped, nothing rewritten, nothing recorded
    assert again["copied"] == [] and again["skipped"] == ["c-s1"]
    shutil.rmtree(dest / "arms" / "c-s1")  # a run here whose arms/ is missing gets it back
    assert pool(dest, src)["copied"] == ["c-s1"] and (dest / "arms" / "c-s1" / "metrics" / "train.jsonl").exists()
    log = json.loads((dest / "pooled.json").read_text())
    assert [r["copied"] for r in log] == [["c-s1"], ["c-s1"]] and log[0]["from"] == str(src.resolve())


def test_pool_refuses_another_setup_a_changed_setting_or_a_clashing_run(tmp_path):
    from bench.learning_pool import pool

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}})
    other_start = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}}, student_text="y")
    with pytest.raises(ValueError, match=r"student's evaluations differ in 4 of 4 completions"):
        pool(dest, other_start)
    other_budget = _pool_dir(tmp_path / "c", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}}, budget_s=20.0)
    with pytest.raises(ValueError, match=r"settings differ: budget_s 10.0 vs 20.0"):
        pool(dest, other_budget)
    clash = _pool_dir(tmp_path / "d", {"c": {"p1": [0, 0], "p2": [0, 0]}, "c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    with pytest.raises(ValueError, match=r"c in two places with different results"):
        pool(dest, clash)
    good = _pool_dir(tmp_path / "e", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    (dest / "arms" / "c-s1").mkdir(parents=True)  # a run that did not finish here: its folder is kept
    with pytest.raises(ValueError, match=r"arms/c-s1 already in .* without evals/"):
        pool(dest, good)
    (dest / "arms" / "c-s1").rmdir()
    bad = _pool_dir(tmp_path / "f", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    data = (bad / "evals" / "c-s1.parquet").read_bytes()
    (bad / "evals" / "c-s1.parquet").write_bytes(data[: len(data) // 2])  # truncated on its way back
    with pytest.raises(ValueError, match=r"c-s1.parquet cannot be read as parquet"):
        pool(dest, bad)
    foreign = _pool_dir(tmp_path / "g", {"c-s1": {"p1": [1, 0], "p9": [1, 0]}})
    with pytest.raises(ValueError, match=r"1 problem\(s\) the start was not evaluated on \(e.g. 'p9'\)"):
        pool(dest, foreign)
    twice = _pool_dir(tmp_path / "h", {})
    rows = pq.read_table(twice / "evals" / "student.parquet").to_pylist()
    write_parquet(rows + rows[:1], twice / "evals" / "student.parquet")
    with pytest.raises(ValueError, match=r"holds problem 'p1' sample 0 twice"):
        pool(dest, twice)
    shutil.rmtree(good / "arms")  # the unfinished run here is refused even when the source has no arms/ for it
    (dest / "arms" / "c-s1").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"arms/c-s1 already in .* without evals/"):
        pool(dest, good)
    (dest / "arms" / "c-s1").rmdir()
    ungraded = _pool_dir(tmp_path / "j", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    t = pq.read_table(ungraded / "evals" / "c-s1.parquet")
    write_parquet(t.drop(["correct_math"]), ungraded / "evals" / "c-s1.parquet")
    with pytest.raises(ValueError, match=r"lacks the evaluation column\(s\) correct_math .*run --stage regrade"):
        pool(dest, ungraded)
    rows = t.to_pylist()
    rows[0]["correct_numeric"] = None
    write_parquet(rows, ungraded / "evals" / "c-s1.parquet")
    with pytest.raises(ValueError, match=r"1 row\(s\) with correct_numeric not true/false"):
        pool(dest, ungraded)
    rows[0]["correct_numeric"] = True
    write_parquet(rows, ungraded / "evals" / "c-s1.parquet")
    with pytest.raises(ValueError, match=r"mark\(s\) 10 s are not the experiment's marks \(-1, 20\)"):
        pool(dest, ungraded, marks={20.0, -1.0})
    odd = _pool_dir(tmp_path / "i", {"zzz": {"p1": [1, 0], "p2": [1, 0]}})
    cfg = LearningConfig(out=str(dest))
    with pytest.raises(ValueError, match=r"not an arm run name: 'zzz'"):  # the report could not read it
        pool(dest, odd, valid_name=cfg.parse_run)
    # nothing was copied by any refused pool, and none was recorded
    assert sorted(p.name for p in (dest / "evals").iterdir()) == ["c.parquet", "student.parquet", "teacher.parquet"]
    assert not (dest / "pooled.json").exists() and not (dest / "arms" / "c-s1").exists()


def test_pool_compares_sources_with_each_other_and_rows_not_bytes(tmp_path):
    import pyarrow.parquet as pq_

    from bench.learning_pool import apply, plan

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}})
    one = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    same = _pool_dir(tmp_path / "c", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    t = pq_.read_table(same / "evals" / "c-s1.parquet")  # the same rows, reordered and compressed otherwise
    pq_.write_table(t.take(list(reversed(range(t.num_rows)))), same / "evals" / "c-s1.parquet", compression="zstd")
    other = _pool_dir(tmp_path / "d", {"c-s1": {"p1": [0, 0], "p2": [1, 0]}})
    first = plan(dest, one)
    with pytest.raises(ValueError, match=r"lists .* twice"):
        plan(dest, one, earlier=[first])
    with pytest.raises(ValueError, match=r"c-s1 in two places with different results"):
        plan(dest, other, earlier=[first])
    second = plan(dest, same, earlier=[first])
    assert first.copy == ["c-s1"] and second.copy == [] and second.skip == ["c-s1"]
    apply(dest, [first, second])
    assert [r["copied"] for r in json.loads((dest / "pooled.json").read_text())] == [["c-s1"]]
    assert plan(dest, same).skip == ["c-s1"]  # against the copy here too: equal rows, other bytes
    # one source brings a run's evals/ without its arms/, a later one the same run with them: both land
    bare = _pool_dir(tmp_path / "e", {"c-s2": {"p1": [1, 1], "p2": [1, 0]}})
    shutil.rmtree(bare / "arms")
    full = _pool_dir(tmp_path / "f", {"c-s2": {"p1": [1, 1], "p2": [1, 0]}})
    a = plan(dest, bare)
    b = plan(dest, full, earlier=[a])
    assert (a.copy, a.arms_only, b.copy, b.arms_only) == (["c-s2"], [], [], ["c-s2"])
    apply(dest, [a, b])
    assert (dest / "evals" / "c-s2.parquet").exists() and (dest / "arms" / "c-s2" / "metrics").is_dir()


def test_pool_reads_a_source_recorded_under_the_old_setting_names(tmp_path):
    """A lease's settings.json written before the settings took OPDConfig's names pools beside one written after;
    the same setting at another value under its old name is still a difference, named by its new name."""
    from bench.learning_pool import plan

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}}, sft_max_epochs=8.0)
    src = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}}, seq_sft_epochs=8.0)
    s = json.loads((src / "settings.json").read_text())
    s["lr"] = s.pop("learning_rate")
    (src / "settings.json").write_text(json.dumps(s))
    assert plan(dest, src).copy == ["c-s1"]
    s["lr"] = 3e-5
    (src / "settings.json").write_text(json.dumps(s))
    with pytest.raises(ValueError, match=r"settings differ: learning_rate 1e-05 vs 3e-05"):
        plan(dest, src)


def test_pool_reads_older_settings_with_the_config_defaults_and_undoes_an_interrupted_copy(tmp_path, monkeypatch):
    import dataclasses

    import bench.learning_pool as lp

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}}, sft_handover_reset=0)
    src = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})  # written before that setting existed
    defaults = {f.name: f.default for f in dataclasses.fields(LearningConfig) if f.default is not dataclasses.MISSING}
    with pytest.raises(ValueError, match=r"sft_handover_reset 0 vs None"):
        lp.plan(dest, src)
    p = lp.plan(dest, src, defaults=defaults)
    real = lp._copy_atomic

    def stop_at_arms(a, b):  # evals/ is copied first; an interrupt while arms/ is copied takes it away again
        if b.parent.name == "arms":
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(lp, "_copy_atomic", stop_at_arms)
    with pytest.raises(KeyboardInterrupt):
        lp.apply(dest, [p])
    assert not (dest / "arms" / "c-s1").exists() and not (dest / "evals" / "c-s1.parquet").exists()
    assert not (dest / "pooled.json").exists()


def test_pool_stage_checks_every_source_before_copying_any(tmp_path):
    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}})
    good = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    cmd = [sys.executable, "-m", "bench.learning", "--out", str(dest), "--stage", "pool", "--pool_from"]
    none, missing, ok = (subprocess.run(cmd + [arg], cwd=ROOT, capture_output=True, text=True)
                         for arg in (" , ", f"{good},{tmp_path / 'nope'}", f" {good} ,"))
    misnamed = _pool_dir(tmp_path / "c", {"c@1e-05-s1": {"p1": [1, 0], "p2": [1, 0]}})  # lr 1e-5 is the default
    r = subprocess.run(cmd + [str(misnamed)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "run 'c@1e-05-s1' is named 'c-s1'" in r.stderr, r.stderr
    elsewhere = subprocess.run(cmd[:-3] + ["--pool_from", str(good)], cwd=ROOT, capture_output=True, text=True)
    assert elsewhere.returncode == 2 and "--pool_from is read by --stage pool only" in elsewhere.stderr
    assert none.returncode == 2 and "needs --pool_from" in none.stderr
    assert missing.returncode == 2 and "nope: no such directory" in missing.stderr
    assert ok.returncode == 0, ok.stderr  # the good source alone: copied, recorded once, reported with its seed
    assert "copying c-s1" in ok.stdout and "runs c, c-s1" in ok.stdout
    assert [r["copied"] for r in json.loads((dest / "pooled.json").read_text())] == [["c-s1"]]


def test_pool_records_each_run_as_it_lands_and_checks_each_marks_evaluations(tmp_path, monkeypatch):
    """A pool stopped after a run's arms/ is in place keeps that run whole and recorded; a copy failing at the second
    run leaves the first recorded; a third source with arms/ is skipped once the second brings them; a run missing a
    (problem, sample) at a mark, or with a NaN, is refused; temporaries of a killed write are cleared."""
    import bench.learning_pool as lp

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}})
    (dest / ".pooled.json.abc.tmp").write_text("[")
    src = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}, "c-s2": {"p1": [0, 0], "p2": [1, 1]}})
    p = lp.plan(dest, src)
    real = lp._copy_atomic
    calls = []

    def fail_second_run(a, b):
        calls.append(b.name)
        if b.name == "c-s2.parquet":
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(lp, "_copy_atomic", fail_second_run)
    with pytest.raises(OSError, match=r"pooling c-s2 from .* failed, nothing of it kept: .*No space left"):
        lp.apply(dest, [p])
    log = json.loads((dest / "pooled.json").read_text())
    assert [r["copied"] for r in log] == [["c-s1"]] and not (dest / ".pooled.json.abc.tmp").exists()
    assert (dest / "arms" / "c-s1").is_dir() and not (dest / "evals" / "c-s2.parquet").exists()

    def stop_after_arms(a, b):  # an interrupt right after arms/ is renamed into place: the run is whole, kept
        real(a, b)
        if b.parent.name == "arms":
            raise KeyboardInterrupt

    monkeypatch.setattr(lp, "_copy_atomic", stop_after_arms)
    with pytest.raises(KeyboardInterrupt):
        lp.apply(dest, [lp.plan(dest, src)])
    assert (dest / "evals" / "c-s2.parquet").exists() and (dest / "arms" / "c-s2").is_dir()
    assert [r["copied"] for r in json.loads((dest / "pooled.json").read_text())] == [["c-s1"], ["c-s2"]]
    monkeypatch.setattr(lp, "_copy_atomic", real)
    assert lp.plan(dest, src).skip == ["c-s1", "c-s2"]  # nothing left to do: no unfinished run refused
    # three sources of one run: the first without arms/, the next two with them: only the second brings arms/
    bare = _pool_dir(tmp_path / "c", {"c-s3": {"p1": [1, 1], "p2": [1, 0]}})
    shutil.rmtree(bare / "arms")
    full = _pool_dir(tmp_path / "d", {"c-s3": {"p1": [1, 1], "p2": [1, 0]}})
    full2 = _pool_dir(tmp_path / "e", {"c-s3": {"p1": [1, 1], "p2": [1, 0]}})
    a = lp.plan(dest, bare)
    b = lp.plan(dest, full, earlier=[a])
    c = lp.plan(dest, full2, earlier=[a, b])
    assert (a.copy, b.arms_only, c.arms_only, c.skip) == (["c-s3"], ["c-s3"], [], ["c-s3"])
    lp.apply(dest, [a, b, c])
    assert (dest / "arms" / "c-s3" / "metrics" / "train.jsonl").exists()
    # a run whose evaluation lacks a sample at a mark, or holds a NaN, would be paired wrongly: refused
    short = _pool_dir(tmp_path / "f", {"c-s4": {"p1": [1, 0], "p2": [1]}})
    with pytest.raises(ValueError, match=r"at mark 10 s it lacks 1 of the start's 4 .* problem 'p2' sample 1"):
        lp.plan(dest, short)
    nan = _pool_dir(tmp_path / "g", {"c-s4": {"p1": [1, 0], "p2": [1, 0]}})
    rows = pq.read_table(nan / "evals" / "c-s4.parquet").to_pylist()
    rows[1]["train_s"] = float("nan")
    write_parquet(rows, nan / "evals" / "c-s4.parquet")
    with pytest.raises(ValueError, match=r"1 row\(s\) with train_s not a finite number"):
        lp.plan(dest, nan)


def test_pool_refuses_a_table_the_report_would_misread(tmp_path, monkeypatch):
    """Extra samples at a mark, a missing mark, a hand-over on a run that has none, a null finish_reason and setup
    evaluations graded otherwise are refused; marks written "10" and "10.0" are one setting; while a run is copied
    pooled.json already names it and its source."""
    import bench.learning_pool as lp

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}}, marks="10,20")
    seq = lambda run: {-1.0} if run.startswith("j") else set()  # noqa: E731 - as bench.learning's pool stage

    def lease(name, runs, edit=None, **settings):
        src = _pool_dir(tmp_path / name, {}, **{"marks": "10,20", **settings})
        for run, (m10, m20) in runs.items():
            rows = _rows(run, m10, 10, 1) + _rows(run, m20, 20, 2)
            write_parquet(edit(rows) if edit else rows, src / "evals" / f"{run}.parquet")
        return src

    ok = {"c-s1": ({"p1": [1, 0], "p2": [0, 0]}, {"p1": [1, 1], "p2": [0, 0]})}
    more = lease("b", ok, lambda rows: rows + [{**rows[0], "sample_index": 2}])
    with pytest.raises(ValueError, match=r"at mark 10 s it holds 1 \(problem, sample\) evaluation\(s\) the start has "
                                         r"not \(e.g. problem 'p1' sample 2\)"):
        lp.plan(dest, more, marks={10.0, 20.0}, optional_marks=seq)
    one_mark = lease("c", ok, lambda rows: [r for r in rows if r["mark_s"] == 10])
    with pytest.raises(ValueError, match=r"no evaluation at mark\(s\) 20 s of the experiment's 10, 20"):
        lp.plan(dest, one_mark, marks={10.0, 20.0}, optional_marks=seq)
    handover = lambda rows: rows + [{**r, "mark_s": -1} for r in rows if r["mark_s"] == 10]  # noqa: E731
    with pytest.raises(ValueError, match=r"mark\(s\) -1 s are not the experiment's marks \(10, 20\)"):
        lp.plan(dest, lease("d", ok, handover), marks={10.0, 20.0}, optional_marks=seq)
    j = {"j-s1": ok["c-s1"]}
    assert lp.plan(dest, lease("e", j, handover), marks={10.0, 20.0}, optional_marks=seq).copy == ["j-s1"]
    null_finish = lease("f", ok, lambda rows: [{**r, "finish_reason": None} for r in rows])
    with pytest.raises(ValueError, match=r"8 row\(s\) with finish_reason not text"):
        lp.plan(dest, null_finish, marks={10.0, 20.0})
    regraded = lease("g", ok)
    rows = pq.read_table(regraded / "evals" / "student.parquet").to_pylist()
    write_parquet([{**r, "correct_math": not r["correct_math"]} for r in rows], regraded / "evals" / "student.parquet")
    with pytest.raises(ValueError, match=r"student's completions are equal but graded differently in 4 of 4 "
                                         r"\(correct_math\).*--stage regrade"):
        lp.plan(dest, regraded)
    spelled = lease("h", ok, marks="10.0,20")
    p = lp.plan(dest, spelled, marks={10.0, 20.0})
    seen = []
    real = lp._copy_atomic

    def look(a, b):  # what a SIGKILL during this copy would leave in pooled.json
        seen.append([(r["from"], r.get("copying"), r["copied"]) for r in json.loads((dest / "pooled.json").read_text())])
        real(a, b)

    monkeypatch.setattr(lp, "_copy_atomic", look)
    lp.apply(dest, [p])
    assert seen[0] == [(str(spelled.resolve()), "c-s1", [])]
    final = json.loads((dest / "pooled.json").read_text())
    assert [(r["copied"], "copying" in r) for r in final] == [(["c-s1"], False)]


def test_pool_settles_the_record_a_killed_pool_left(tmp_path):
    """A pool killed mid-copy leaves its record naming the run it was copying: the next pool books the run to that
    record when the run is here, drops the record when nothing of it landed, and leaves no "copying" key."""
    import bench.learning_pool as lp

    dest = _pool_dir(tmp_path / "a", {"c": {"p1": [1, 1], "p2": [0, 0]}})
    src = _pool_dir(tmp_path / "b", {"c-s1": {"p1": [1, 0], "p2": [1, 0]}})
    shutil.copy2(src / "evals" / "c-s1.parquet", dest / "evals" / "c-s1.parquet")  # killed while arms/ was copied
    killed = [{"from": "/x", "checked": [], "copied": [], "skipped": [], "copying": "c-s1"},
              {"from": "/y", "checked": [], "copied": ["c"], "skipped": [], "copying": "c-s9"},
              {"from": "/z", "checked": [], "copied": [], "skipped": [], "copying": "c-s8"}]
    (dest / "pooled.json").write_text(json.dumps(killed))
    p = lp.plan(dest, src)
    assert (p.copy, p.arms_only) == ([], ["c-s1"])
    lp.apply(dest, [p])
    log = json.loads((dest / "pooled.json").read_text())
    assert [(r["from"], r["copied"], "copying" in r) for r in log] == [
        ("/x", ["c-s1"], False), ("/y", ["c"], False), (str(src.resolve()), ["c-s1"], False)]
    assert (dest / "arms" / "c-s1" / "metrics" / "train.jsonl").exists()
    # marks the config reads alike are one setting ("10,20," is LearningConfig's [10, 20] too)
    assert lp._setting("marks", "10,20,") == lp._setting("marks", " 10.0, 20") == (10.0, 20.0)


def test_plot_axis_starts_at_zero_unless_every_point_is_high():
    """The plot's y-axis floor: 0 for curves that span the range (regime (i): 0.32 -> 0.65), else the lowest error
    bar less 0.02 rounded down to 0.05 (regime (ii): 0.72-0.82, LEARNING.md command 19)."""
    from bench.learning_report import y_floor

    assert y_floor([0.30, 0.60], [0.35, 0.66]) == 0.0  # 0.30 <= half of 0.66
    assert y_floor([0.720, 0.771], [0.766, 0.815]) == pytest.approx(0.70)  # 0.700 -> 0.70 exactly
    assert y_floor([0.7433 - 0.0232, 0.794 - 0.021], [0.794 + 0.021]) == pytest.approx(0.70)  # command 19's f: 0.7001
    assert y_floor([0.69, 0.75], [0.85]) == pytest.approx(0.65)  # 0.67 -> 0.65
    assert y_floor([0.41], [0.80]) == pytest.approx(0.35)  # just above half: 0.39 -> 0.35
    with pytest.raises(ValueError, match="no points"):
        y_floor([], [])


@pytest.mark.parametrize("objective, w_reward, off_policy", [("sft", 0.0, True), ("rl", 1.0, False)])
def test_teacher_objective_sft_or_rl(tmp_path, monkeypatch, objective, w_reward, off_policy):
    """--teacher_objective rl makes the teacher by reward only (arm a's objective) on the same problems; sft by SFT
    on their references. The recipe handed to stages.train says which."""
    import yaml

    import bench.learning as bl
    from bench.learning_config import LearningConfig

    cfg = LearningConfig(out=str(tmp_path / "r"), preset="cpu_smoke", teacher_objective=objective,
                         grader_profile="formal", answer_filter="math", lr_scheduler_type="linear_time",
                         lr_warmup_s=2.0)
    cur = write_parquet([{"problem_id": "p0", "problem": "1+1?", "answer": "2", "reference": "so \\boxed{2}"}],
                        tmp_path / "cur.parquet")
    seen = {}

    def fake_train(cfg_, recipe_path, marks, **kw):
        seen.update(yaml.safe_load(Path(recipe_path).read_text()))
        out = tmp_path / "trained"
        out.mkdir(exist_ok=True)
        return [{"path": str(out), "mark_s": 1.0, "train_s": 1.0, "step": 1}]

    monkeypatch.setattr(bl, "train", fake_train)
    monkeypatch.setattr(bl, "evaluate", lambda *a, **k: [])
    monkeypatch.setattr(bl, "_write_evals", lambda *a, **k: None)
    monkeypatch.setattr(bl, "_line", lambda *a, **k: "")
    bl.fine_tune(cfg, "start", {"curriculum": cur}, dest_name="teacher", eval_name="teacher", seconds=1.0,
                 objective=cfg.teacher_objective)
    assert seen["w_reward"] == w_reward and seen["w_kl"] == 0.0 and seen["grader_profile"] == "formal"
    assert (seen.get("sft_share_start") == 1.0) is off_policy
    # the arms' time schedule is not the teacher's: a constant rate, never a decay to 0 over teacher_sft_s while
    # teacher_sft_steps go on
    assert seen["lr_scheduler_type"] == "constant"
    assert "lr_warmup_time" not in seen and "lr_final_ratio" not in seen
    with pytest.raises(ValueError, match="teacher_objective"):
        LearningConfig(out=str(tmp_path / "r2"), preset="cpu_smoke", teacher_objective="dpo")


def test_teacher_init_continues_an_earlier_teacher(tmp_path):
    """--teacher_init: the teacher's fine-tuning starts from the given model (a longer RL in links), not the start;
    refused beside a given teacher or a cut student, and a path without weights is named before any work."""
    from bench.learning import teacher_source
    from bench.learning_config import LearningConfig, check_given_models

    base = dict(preset="cpu_smoke", teacher_objective="rl", start_sft_steps=4, teacher_sft_steps=4)
    cfg = LearningConfig(out=str(tmp_path / "r"), teacher_init=str(tmp_path / "link1" / "teacher"), **base)
    assert teacher_source(cfg, "raw", str(tmp_path / "r" / "start")) == str(tmp_path / "link1" / "teacher")
    plain = LearningConfig(out=str(tmp_path / "p"), **base)
    assert teacher_source(plain, "raw", "start-dir") == "start-dir"
    assert teacher_source(LearningConfig(out=str(tmp_path / "c"), student_layers=12, **base), "raw", "s") == "raw"
    with pytest.raises(FileNotFoundError, match="teacher_init: .*link1/teacher is not a Hugging Face model folder"):
        check_given_models(cfg)
    with pytest.raises(ValueError, match="teacher_init .* teacher_model"):
        LearningConfig(out=str(tmp_path / "r2"), preset="cpu_smoke", teacher_init="x", teacher_model="y")
    with pytest.raises(ValueError, match="teacher_init .* student_layers"):
        LearningConfig(out=str(tmp_path / "r3"), teacher_init="x", student_layers=12, **base)


def test_a_flag_given_wins_over_the_preset_even_at_its_plain_default():
    """On the command line a preset's values are the flags' defaults: '--gate_lead 0' under --preset run4 is 0
    (the value a user types to run the arms past the gate), not the preset's 0.10, as are other flags set back to
    their plain defaults; what is not given comes from the preset."""
    from bench.learning import _parse

    given = {"--gate_lead": ("gate_lead", 0.0), "--gate_rel_lead": ("gate_rel_lead", 0.0),
             "--stage_one_filter": ("stage_one_filter", "none"), "--teacher_objective": ("teacher_objective", "sft"),
             "--learning_rate": ("learning_rate", 1e-5)}
    for flag, (name, value) in given.items():
        cfg, _ = _parse(["--out", "/nowhere/r", "--preset", "run4", flag, str(value)])
        assert getattr(cfg, name) == value, flag
        assert (cfg.task, cfg.teacher_sft_steps) == ("ladder", 400)  # the rest is the preset's
    cfg, _ = _parse(["--out", "/nowhere/r", "--preset=run4", "--unseen_arm_problems", "false"])
    assert cfg.unseen_arm_problems is False and cfg.gate_lead == 0.10
    for bad, msg in ((["--preset", "run5"], "preset must be one of"), (["--preset"], "--preset needs a name")):
        with pytest.raises(ValueError, match=msg):
            _parse(["--out", "/nowhere/r", *bad])


def test_gate_absolute_and_relative(tmp_path):
    """Run 4's gate: the teacher's lead >= gate_lead and >= gate_rel_lead x the start's score; the preset sets both."""
    from bench.learning import gate_passes

    assert gate_passes(0.205, 0.252, 0.10, 0.30)          # JustRL over its student: +0.205, +81%
    assert not gate_passes(0.12, 0.50, 0.10, 0.30)        # +0.12 but only +24% of 0.50
    assert not gate_passes(0.08, 0.10, 0.10, 0.30)        # +80% but under +0.10
    assert gate_passes(0.15, 0.0, 0.10, 0.30)             # a start at 0: the absolute gate decides
    cfg = LearningConfig(out=str(tmp_path / "r"), preset="run4")
    assert (cfg.gate_lead, cfg.gate_rel_lead, cfg.teacher_objective, cfg.grader_profile, cfg.prompt_style,
            cfg.n_test, cfg.answer_filter, cfg.task, cfg.teacher_sft_steps) == (0.10, 0.30, "rl", "formal", "formal",
                                                                                1500, "math", "ladder", 400)
    with pytest.raises(ValueError, match="answer_filter 'numeric' does not apply under grader_profile formal"):
        LearningConfig(out=str(tmp_path / "r3"), grader_profile="formal")  # refused before any setup, not in an arm
    with pytest.raises(ValueError, match="gate_rel_lead"):
        LearningConfig(out=str(tmp_path / "r2"), gate_rel_lead=-1.0)
