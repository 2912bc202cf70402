"""Run report: plots from metrics, eval table with the before/after change, checkpoint listing."""

import importlib.util
import json

from stages.report import main


def test_report_from_metrics_and_evals(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CKPT_DIR", raising=False)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").write_text(
        "".join(json.dumps({"step": s, "wall_s": 10.0 * s, "loss": 1.0 / s, "kl/sampled_mean": 0.1 * s,
                            "reward/mean": 0.2}) + "\n" for s in (1, 2, 3)) + "not json\n")
    for label, p, se in (("start__synth", 0.10, 0.03), ("final__synth", 0.16, 0.04)):
        d = tmp_path / "eval" / label
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({
            "label": label, "protocol": "synth", "declared_protocol": True, "model": "m", "checkpoint_step": None,
            "pass_at_1": p, "pass_at_1_stderr": se, "clip_rate": 0.1, "n_problems": 10, "n_samples": 40}))
    for step in (2, 10):
        (tmp_path / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
    (tmp_path / "curate").mkdir()
    (tmp_path / "curate" / "manifest.json").write_text(json.dumps(
        {"counts": {"curriculum": 3, "problems_measured": 10, "problems": 120}}))
    assert main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stage one: 3 curriculum rows from 10 problems measured of 120" in out
    assert "change in pass@1: +0.0600 (+1.2 combined standard errors)" in out
    assert "checkpoint-2, checkpoint-10" in out
    assert "train_rollouts" not in out and "reward/mean" not in out  # no rollout table written: no query that needs it
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step-000001.parquet").write_bytes(b"")
    assert main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FROM curriculum c JOIN train_rollouts t" in out and '\\"reward/mean\\" AS reward' in out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["steps"] == 3 and report["final_metrics"]["loss"] == 1.0 / 3 and report["curriculum_rows"] == 3
    png = tmp_path / "report" / "training.png"
    if importlib.util.find_spec("matplotlib"):  # optional: without it the report writes its tables only
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()
    # stage one without its filter: every problem is a row; what training's SFT phase has is the solutions
    (tmp_path / "curate" / "manifest.json").write_text(json.dumps(
        {"config": {"filter": "none"}, "counts": {"curriculum": 120, "teacher_solutions": 7, "problems_measured": 10,
                                                  "problems": 120}}))
    assert main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("stage one: 120 curriculum rows (filter none: every problem), 7 with a verified teacher solution from 10 "
            "problems measured of 120") in out
    # no pass rate to group by (null, one bucket): the query offered groups by the teacher's solutions
    assert "c.teacher_solution IS NOT NULL AS solved_by_teacher" in out and "avg(c.pass_rate)" not in out
    # the band filter's fallback (it kept none): the same rows, said as such
    (tmp_path / "curate" / "manifest.json").write_text(json.dumps(
        {"config": {"filter": "pass_rate"}, "counts": {"curriculum": 120, "teacher_solutions": 0, "problems_measured": 10,
                                                       "problems": 120, "filter_fallback": True}}))
    assert main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stage one: 120 curriculum rows (the pass-rate band kept none: every problem), 0 with a verified" in out
    assert "c.teacher_solution IS NOT NULL AS solved_by_teacher" in out


def test_report_of_a_run_still_in_its_sft_phase_offers_its_sft_query(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CKPT_DIR", raising=False)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").write_text(
        "".join(json.dumps({"step": s, "wall_s": 2.0 * s, "loss": 0.5, "loss/sft": 0.5, "sft/epoch": 0.25 * s}) + "\n"
                for s in (1, 2)))
    assert main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert '\\"loss/sft\\",4) AS sft_loss' in out and "train_rollouts" not in out and "reward/mean" not in out


def test_training_seconds_counts_steps_not_stage_one():
    """wall_s counts from run.sh's start, so stage one's 230 s before the first step are not training; a resumed run
    (a new clock start) adds its own span: (300 - (260 - 30)) + (150 - (100 - 20)) = 70 + 70."""
    from stages.report import training_seconds

    rows = [{"time": 1000 + w, "wall_s": w, "time/step": s} for w, s in ((260, 30), (300, 40))]
    rows += [{"time": 5000 + w, "wall_s": w, "time/step": s} for w, s in ((100, 20), (150, 50))]
    assert training_seconds(rows) == 140.0
    assert training_seconds([]) is None


def test_a_run_that_trained_nothing_says_so(tmp_path, capsys, monkeypatch):
    """0 steps: the start model was exported as checkpoint-0; the report says so first, with training's reason, and
    ``--outcome`` gives run.sh the line it ends with (and the cue to evaluate the start model alone)."""
    import shlex

    monkeypatch.delenv("CKPT_DIR", raising=False)
    (tmp_path / "checkpoints" / "checkpoint-0").mkdir(parents=True)
    why = "no training time left at start: training began at 412s on the run's clock, past its horizon at 390s"
    (tmp_path / "train_summary.json").write_text(json.dumps({"global_step": 0, "stop_reason": why,
                                                             "start_model_only": True}))
    assert main(["--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    note = f"trained 0 steps ({why}): checkpoint-0 is the start model, not a trained one"
    assert out.splitlines()[2] == f"**This run trained nothing**: {note}."
    assert f"training: {note}" in out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["training"] == {"steps": 0, "stop_reason": why, "start_model_only": True}
    assert main(["--run", str(tmp_path), "--outcome"]) == 0
    assert capsys.readouterr().out.splitlines() == ["TRAINED_STEPS=0", f"TRAINED_NOTE={shlex.quote(note)}"]
    (tmp_path / "train_summary.json").write_text(json.dumps({"global_step": 7, "stop_reason": "deadline"}))
    assert main(["--run", str(tmp_path), "--outcome"]) == 0
    assert capsys.readouterr().out.splitlines() == ["TRAINED_STEPS=7", "TRAINED_NOTE="]
