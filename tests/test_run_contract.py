"""The run contract's clock: run.sh's recipe choice and --plan, the split of MAX_WALL_TIME_SECONDS between
stages, stage one's time budget, export spacing over the end of the training window, and (slow) the whole
``bash run.sh`` under a short clock, Ctrl-C during training, and vLLM loading the final export."""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import version
import signal
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import fields
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from data_tools import clock
from tests.faultkit import default_sigint

REPO = Path(__file__).resolve().parents[1]


def _run_sh(*args, env=None, timeout=240):  # --plan parses the training config too (~15 s of imports)
    e = {k: v for k, v in os.environ.items() if k not in ("STUDENT_MODEL", "MAX_WALL_TIME_SECONDS", "DEADLINE_RESERVE_SECONDS")}
    e.update(env or {})
    return subprocess.run(["bash", str(REPO / "run.sh"), *args], capture_output=True, text=True, env=e, timeout=timeout)


# ------------------------------------------------------------------------------------------- clock

def test_run_start_time_reads_opd_run_start_and_rejects_bad_values():
    assert clock.run_start_time({"OPD_RUN_START": "1700000000.5"}) == 1700000000.5
    assert abs(clock.run_start_time({}) - time.time()) < 3600  # this process's start: within the test session
    with pytest.raises(ValueError, match="not a Unix time"):
        clock.run_start_time({"OPD_RUN_START": "yesterday"})
    with pytest.raises(ValueError, match="future"):
        clock.run_start_time({"OPD_RUN_START": str(time.time() + 3600)})


def test_process_start_time_of_the_trainer_is_the_run_start(monkeypatch):
    from trainers.callbacks import process_start_time

    monkeypatch.setenv("OPD_RUN_START", "1700000123")
    assert process_start_time() == 1700000123.0


def test_split_formal_recipe():
    s = clock.split(43200, 900, 0, 0.2)
    assert s["curate_end_s"] == pytest.approx(0.2 * 42300) and s["train_end_s"] == 42300
    assert s["train_budget_s"] == pytest.approx(0.8 * 42300) and s["export_end_s"] == 43200
    d = clock.split(600, 60, 240, 0.3)  # the demo keeps its evaluation inside the clock
    assert (d["train_end_s"], d["export_end_s"], d["curate_end_s"]) == (300, 360, pytest.approx(90))
    with pytest.raises(ValueError, match="leaves nothing"):
        clock.split(300, 60, 240, 0.3)
    with pytest.raises(ValueError, match="time_share"):
        clock.split(600, 60, 0, 0.0)


def test_resolve_clock_env_wins_over_yaml(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("max_wall_time_seconds: 900\ndeadline_reserve_seconds: 60\n")
    assert clock.resolve_clock(y, {}) == (900.0, 60.0)
    assert clock.resolve_clock(y, {"MAX_WALL_TIME_SECONDS": "600", "DEADLINE_RESERVE_SECONDS": "30"}) == (600.0, 30.0)
    with pytest.raises(ValueError, match="MAX_WALL_TIME_SECONDS > DEADLINE_RESERVE_SECONDS"):
        clock.resolve_clock(y, {"MAX_WALL_TIME_SECONDS": "50"})
    with pytest.raises(ValueError, match="number"):
        clock.resolve_clock(y, {"MAX_WALL_TIME_SECONDS": "ten"})


def test_clock_defaults_have_one_owner(tmp_path):
    """Training, stage one and run.sh read the clock's defaults from data_tools.clock: 12 h and 600 s for training
    (and for run.sh when the recipe sets none), no clock for stage one."""
    import stages.curate as C
    from trainers.opd_config import OPDConfig

    defaults = lambda cls: {f.name: f.default for f in fields(cls)}  # noqa: E731
    t, c = defaults(OPDConfig), defaults(C.CurateConfig)
    assert (t["max_wall_time_seconds"], t["deadline_reserve_seconds"]) == (43200.0, 600.0)
    assert (c["max_wall_time_seconds"], c["deadline_reserve_seconds"], c["time_share"]) == (0.0, 0.0, 0.2)
    (tmp_path / "t.yaml").write_text("learning_rate: 1.0e-6\n")
    assert clock.resolve_clock(tmp_path / "t.yaml", {}) == (43200.0, 600.0)
    # each config's default is data_tools.clock's name, not a copy of its value
    import ast

    for path, cls, want in (("trainers/opd_config.py", "OPDConfig", ("DEFAULT_MAX_WALL_S", "DEFAULT_RESERVE_S")),
                            ("stages/curate_config.py", "CurateConfig", ("NO_CLOCK", "NO_CLOCK"))):
        body = next(n for n in ast.parse((REPO / path).read_text()).body if getattr(n, "name", "") == cls).body
        got = {n.target.id: kw.value.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.value, ast.Call)
               for kw in n.value.keywords if kw.arg == "default" and isinstance(kw.value, ast.Name)}
        assert (got.get("max_wall_time_seconds"), got.get("deadline_reserve_seconds")) == want, path


@pytest.mark.parametrize("all_s,final_s,left_s,kept", [
    (850, 425, 348, 0),      # not even the final export's evaluation fits: training takes it all (the demo on a slow CPU)
    (400, 200, 1000, 400),   # everything fits in half of what is left
    (900, 450, 1000, 450),   # both need more than half: the final export's alone, training keeps the rest
    (254, 127, 298, 127),    # a 420 s demo on a loaded CPU: both would leave training 44 s (0 steps), one 171 s
    (1200, 600, 1000, 600),  # both do not fit in what is left: the final export's alone
    (300, 100, -20, 0),      # nothing left at all
])
def test_an_evaluation_reserve_that_no_evaluation_fits_goes_to_training(all_s, final_s, left_s, kept):
    s, why = clock.eval_reserve(all_s, final_s, left_s)
    assert s == kept
    assert ("training takes the time" in why) == (final_s > max(left_s, 0))
    r = subprocess.run([sys.executable, "-m", "data_tools.clock", "eval-reserve", "--all", str(all_s), "--final",
                        str(final_s), "--left", str(left_s)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines() == [str(kept), why]


def test_eval_estimate_from_measured_rates():
    size = clock.protocol_size("synth_heldout", REPO)
    assert size == {"n_problems": 48, "n_samples": 4, "max_tokens": 24}
    manifest = {"budget": {"completion_tokens_per_s": 80.0, "engine_startup_s": 50.0, "mean_completion_tokens": 10.0}}
    per_model = 50.0 + 48 * 4 * min(24, 15.0) / 80.0
    assert clock.eval_estimate(manifest, size, 2) == pytest.approx(clock.EVAL_SAFETY * 2 * per_model + clock.REPORT_S)
    with pytest.raises(ValueError, match="no measured"):
        clock.eval_estimate({"budget": {}}, size, 1)
    assert clock.protocol_size("math500_pass_at_1", REPO)["n_problems"] == 500


# --------------------------------------------------------------------------------- run.sh --plan

def _model_dir(path: Path) -> Path:
    """A directory the preflight takes for a model (config.json, tokenizer, weights files; never loaded here)."""
    path.mkdir(parents=True, exist_ok=True)
    for f, text in (("config.json", "{}"), ("tokenizer.json", "{}"), ("model.safetensors", "")):
        (path / f).write_text(text)
    return path


def test_plan_formal_recipe_prints_every_config_and_budget(tmp_path):
    env = {"MAX_WALL_TIME_SECONDS": "43200", "DEADLINE_RESERVE_SECONDS": "900", "TRAIN_DATA": "synth:train:10"}
    # naming the formal recipe requires its models: never the embedded demo student with a self-teacher
    for missing in ({}, {"STUDENT_MODEL": str(_model_dir(tmp_path / "s"))}):
        r = _run_sh("--plan", "r1_distill_1p5b", env={**env, **missing})
        assert r.returncode == 2 and "run.sh: recipe r1_distill_1p5b needs STUDENT_MODEL and TEACHER_MODEL" in r.stderr
        assert ("unset: TEACHER_MODEL)" if missing else "unset: STUDENT_MODEL TEACHER_MODEL)") in r.stderr, r.stderr
    s = str(_model_dir(tmp_path / "s"))  # one directory for both: nothing to compare, no tokenizer loaded
    r = _run_sh("--plan", "r1_distill_1p5b", env={**env, "STUDENT_MODEL": s, "TEACHER_MODEL": s})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for f in ("configs/curate_r1_distill_1p5b.yaml", "configs/opd_r1_distill_1p5b.yaml",
              "configs/eval/math500_pass_at_1.yaml", "configs/eval/aime24_25_at32.yaml"):
        assert f in out
    # the formal stage one is unfiltered: the teacher alone samples, on a third of the filtered one's seconds
    assert "set-up + stage one     2961 s  (share 0.07" in out and "training              39339 s" in out
    assert "final export            900 s" in out and "only if the time left covers" in out
    assert "configs/curate_r1_distill_1p5b.yaml  (filter none: the teacher alone samples, every problem a row)" in out
    # the filtered stage one: its filter and its share in the plan
    r = _run_sh("--plan", "r1_distill_1p5b", env={**env, "STUDENT_MODEL": s, "TEACHER_MODEL": s,
                                                  "CURATE_CONFIG": "configs/curate_r1_distill_1p5b_filtered.yaml"})
    assert r.returncode == 0, r.stderr
    assert ("configs/curate_r1_distill_1p5b_filtered.yaml  (the student's pass-rate filter)" in r.stdout
            and "set-up + stage one     8460 s  (share 0.2" in r.stdout and "training              33840 s" in r.stdout)


def test_plan_without_argument_picks_the_demo_and_says_why(tmp_path):
    r = _run_sh("--plan")
    assert r.returncode == 0 and "recipe demo_cpu (STUDENT_MODEL is not set)" in r.stdout
    # STUDENT_MODEL set but CUDA hidden: still the demo, with the reason
    student = str(_model_dir(tmp_path / "s"))
    r = _run_sh("--plan", env={"STUDENT_MODEL": student, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0 and "recipe demo_cpu (STUDENT_MODEL is set but no CUDA device is visible" in r.stdout
    # a visible GPU (nvidia-smi lists one) with STUDENT_MODEL: the formal recipe, whose preflight refuses this
    # interpreter's CPU torch where a GPU is visible (a GPU node set up with the CPU stack)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    e = dict(os.environ, STUDENT_MODEL=student, TEACHER_MODEL=student, TRAIN_DATA="synth:train:10",
             PATH=f"{fake}:{os.environ['PATH']}")
    e.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run(["bash", str(REPO / "run.sh"), "--plan"], capture_output=True, text=True, env=e, timeout=60)
    from data_tools.preflight import torch_is_cpu_build

    if torch_is_cpu_build(version("torch")):
        assert r.returncode == 2 and "preflight (r1_distill_1p5b): torch" in r.stderr, r.stderr
        assert "is a CPU build but 1 GPU(s) are visible" in r.stderr
    else:
        assert r.returncode == 0 and "recipe r1_distill_1p5b (STUDENT_MODEL is set and CUDA is visible)" in r.stdout


def test_plan_without_evaluation_keeps_no_evaluation_time():
    r = _run_sh("--plan", "demo_cpu", env={"MAX_WALL_TIME_SECONDS": "300", "DEADLINE_RESERVE_SECONDS": "45",
                                           "EVAL_PROTOCOLS": ""})
    assert r.returncode == 0 and "set-up + stage one       76 s  (share 0.3 of 255 s" in r.stdout


def test_run_sh_arguments_and_the_training_config_are_checked_before_anything_runs(tmp_path):
    """--plan after the recipe is a plan, not a run; an extra word or option is refused; a training config that
    does not parse stops --plan (and a real run, before stage one) with the key named."""
    r = _run_sh("demo_cpu", "--plan", env={"OUTPUT_DIR": str(tmp_path / "out")})
    assert r.returncode == 0 and "stage one" in r.stdout and not (tmp_path / "out").exists(), r.stderr[-2000:]
    r = _run_sh("demo_cpu", "extra")
    assert r.returncode == 2 and "one recipe at most, got 'demo_cpu' and 'extra'" in r.stderr
    r = _run_sh("--plann")
    assert r.returncode == 2 and "unknown option '--plann'" in r.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text((REPO / "configs" / "demo_cpu.yaml").read_text() + "learning_rat: 1.0e-5\n")
    r = _run_sh("--plan", env={"TRAIN_CONFIG": str(typo)})
    assert r.returncode == 2 and "unknown key(s) ['learning_rat']" in r.stderr and "nothing was run" in r.stderr


def test_plan_refuses_a_clock_without_room_and_an_unknown_recipe():
    r = _run_sh("--plan", "demo_cpu", env={"MAX_WALL_TIME_SECONDS": "200", "DEADLINE_RESERVE_SECONDS": "60"})
    assert r.returncode == 2 and "clock: error:" in r.stderr and "leaves nothing" in r.stderr
    r = _run_sh("--plan", "nope")
    assert r.returncode == 2 and "unknown recipe 'nope'" in r.stderr


def test_a_second_run_exits_75_at_once_before_set_up_preflight_and_the_config_check(tmp_path):
    """The run lock is checked first: a run whose OUTPUT_DIR another live run holds exits 75 in seconds, before
    set-up, the preflight and the training config's check (a config that would fail them is never looked at)."""
    from data_tools.runio import EXIT_LOCKED, acquire_lock

    out = tmp_path / "out"
    holder = subprocess.Popen(["sleep", "120"])
    try:
        acquire_lock(out, owner_pid=holder.pid)
        env = _contract_env(out, TRAIN_CONFIG=tmp_path / "missing.yaml", STUDENT_MODEL=tmp_path / "no-model")
        t0 = time.time()
        r = subprocess.run(["bash", str(REPO / "run.sh")], env=env, capture_output=True, text=True, timeout=120)
        took = time.time() - t0
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == EXIT_LOCKED, r.stdout + r.stderr
    assert f"is in use by pid {holder.pid}" in r.stderr and "preflight" not in r.stdout + r.stderr
    assert "missing.yaml" not in r.stderr and "make setup" not in r.stdout + r.stderr
    assert took < 15, f"{took:.1f}s"  # ~0.3 s idle (no set-up, no imports beyond the standard library)
    assert (out / ".opd.lock").exists()  # the holder's lock is left alone


# ------------------------------------------------------------------------- checkpoint spacing

def _drive(cb, deadline, t, steps, step_s):
    """Run ``steps`` fake optimizer steps of ``step_s`` seconds; return the steps at which a save was asked."""
    saves = []
    args = SimpleNamespace()
    for step in range(1, steps + 1):
        state = SimpleNamespace(global_step=step, is_world_process_zero=True)
        control = SimpleNamespace(should_save=False, should_training_stop=False)
        deadline.on_step_begin(args, state, control)
        t[0] += step_s
        deadline.on_step_end(args, state, control)
        cb.on_step_end(args, state, control)
        if control.should_save:
            saves.append(step)
            cb.on_save(args, state, control)
        if control.should_training_stop:
            break
    return saves


def test_exports_spread_over_the_end_of_the_window():
    from trainers.callbacks import DeadlineCallback, SaveCadenceCallback

    t = [1000.0]
    now = lambda: t[0]  # noqa: E731
    # run started at 1000; training begins at 1200 (stage one took 200 s); horizon 1200 s after the run start
    deadline = DeadlineCallback(1200.0, 1000.0, clock=now, handle_sigterm=False)
    t[0] = 1200.0
    deadline.on_train_begin(None, None, None)
    cb = SaveCadenceCallback(every_minutes=2.0, clock=now, hedge_fractions=(0.8, 0.9), fraction=deadline.window_fraction)
    saves = _drive(cb, deadline, t, steps=200, step_s=10.0)
    # window = 1000 s of training: cadence every 120 s until 0.8 (step 80), then 0.8 and 0.9, then the final stop
    assert saves == [12, 24, 36, 48, 60, 72, 80, 90, 100]
    assert deadline.stop_reason.startswith("deadline") and deadline.window_fraction() == 1.0
    # the three kept (highest steps) sit at 0.8, 0.9 and the end: none of them in the cadence's last minutes
    assert [s / 100 for s in saves[-3:]] == [0.8, 0.9, 1.0]


def test_one_long_step_crossing_both_hedges_saves_once():
    from trainers.callbacks import DeadlineCallback, SaveCadenceCallback

    t = [0.0]
    deadline = DeadlineCallback(100.0, 0.0, clock=lambda: t[0], handle_sigterm=False)
    deadline.on_train_begin(None, None, None)
    cb = SaveCadenceCallback(clock=lambda: t[0], hedge_fractions=(0.8, 0.9), fraction=deadline.window_fraction)
    state = SimpleNamespace(global_step=1)
    control = SimpleNamespace(should_save=False)
    t[0] = 95.0
    cb.on_step_end(None, state, control)
    assert control.should_save and cb.crossed == [0.8, 0.9]
    assert cb.take_covered() == [0.8, 0.9] and cb.take_covered() == []  # this save is both hedges' export
    control.should_save = False
    t[0] = 97.0
    cb.on_step_end(None, state, control)
    assert not control.should_save
    with pytest.raises(ValueError, match="hedge_fractions"):
        SaveCadenceCallback(hedge_fractions=(0.8, 1.2), fraction=lambda: 0.0)


def test_hedge_fractions_validated_against_ckpt_keep(tmp_path):
    from trainers.opd_config import OPDConfig

    with pytest.raises(ValueError, match="ckpt_keep"):
        OPDConfig(output_dir=str(tmp_path), ckpt_keep=2, ckpt_hedge_fractions=[0.8, 0.9], report_to="none")
    with pytest.raises(ValueError, match="increasing"):
        OPDConfig(output_dir=str(tmp_path), ckpt_hedge_fractions=[0.9, 0.8], report_to="none")
    assert OPDConfig(output_dir=str(tmp_path), ckpt_hedge_fractions=[], report_to="none").ckpt_hedge_fractions == []


# ------------------------------------------------------------------------------ stage one's budget

def test_chunk_budget_sizes_each_call_to_the_time_left():
    from stages.curate_clock import ChunkBudget

    t = [0.0]
    b = ChunkBudget(100.0, {"teacher": 4, "student": 8}, clock=lambda: t[0], hard_end=150.0, probe=2, max_tokens=40)
    assert b.plan(["teacher", "student"], 10, forced=True) == (2, 150.0)  # the first call: a probe, until the hard end
    assert b.plan(["teacher"], 10) == (2, 100.0)  # nothing timed, not forced: a probe, until the deadline
    b.record("teacher", 2, 4.0, 80, 8)  # 2 s a problem, samples of 10 tokens
    assert b.per_prompt("student") == pytest.approx(4.0)  # borrowed: the teacher's x 8/4 samples
    t[0] = 40.0
    assert b.plan(["teacher"], 50) == (30, 100.0)  # 60 s left at 2 s a problem
    assert b.plan(["teacher"], 50, forced=True) == (30, 150.0)  # no curriculum row yet: it may run to the hard end
    assert b.plan(["teacher"], 10) == (10, 100.0)  # at most the rest of the chunk
    assert b.plan(["teacher"], 50, interruptible=False) == (7, 100.0)  # no stop in flight: 2 s x 40/10 tokens a problem
    t[0] = 99.0
    assert b.plan(["teacher", "student"], 10) == (0, None)
    assert b.stop_reason == "budget: the next teacher+student call of one problem needs ~6s, 1s left"
    t[0] = 120.0
    assert b.plan(["student"], 10) == (0, None) and b.stop_reason == "budget: spent before the next student call"
    assert b.plan(["student"], 10, forced=True) == (2, 150.0)  # ... but with no curriculum row yet, a probe ...
    t[0] = 151.0
    assert b.plan(["student"], 10, forced=True) == (0, None)  # ... never past the hard end
    assert b.stop_reason.startswith("no time left for stage one's first student calls")
    assert (b.tokens, b.gen_s) == (80, 4.0)
    assert ChunkBudget(None, {"teacher": 1, "student": 1}).plan(["teacher"], 7) == (7, None)  # no clock: whole chunks


class _FakeClock:
    def __init__(self, start: float):
        self.now = start

    def time(self) -> float:
        return self.now

    @staticmethod
    def strftime(fmt, *a):
        return time.strftime(fmt, *a)


def _fake_time(monkeypatch, fake: _FakeClock) -> None:
    """Stage one's modules read the fake clock (every ``time.time()`` of the stage)."""
    import stages.curate as C
    import stages.curate_clock
    import stages.curate_curriculum
    import stages.curate_sampling

    for mod in (C, stages.curate_clock, stages.curate_curriculum, stages.curate_sampling):
        monkeypatch.setattr(mod, "time", fake)


def _fake_engine(fake: _FakeClock, per_prompt_s: float, calls: list, *, interruptible: bool = True,
                 slow_after: int | None = None):
    """A stand-in for vLLM that answers at once and advances the fake clock by ``per_prompt_s`` a problem (5 s to
    start): the privileged teacher reads 'The correct answer is X.' from its prompt and answers X; every other
    prompt gets a wrong answer (so a problem is in the curriculum only through ``zero_pass_share``). ``interruptible``: a call stops at its ``stop_at`` (the problems not done by then are dropped),
    else it runs whole. ``slow_after``: from that call on, a problem takes 4 x as long (the rate measured before no
    longer holds)."""
    import re

    from transformers import AutoTokenizer

    from data_tools.generation.engines import Sample
    from data_tools.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))

    class FakeEngine:
        def __init__(self, model, **kw):
            self.model, self.tokenizer, self.startup_s = model, tok, 5.0
            self.name, self.dtype, self.interruptible = "fake", "float32", interruptible
            fake.now += 5.0

        def close(self):
            pass

        def generate(self, prompts, *, n, max_tokens, temperature, top_p, chunk_size, desc, seeds=None, stop_at=None):
            calls.append(desc)
            each = per_prompt_s * (4 if slow_after is not None and len(calls) > slow_after else 1)
            out = []
            for i, p in enumerate(prompts):
                if interruptible and stop_at is not None and fake.now + each > stop_at:
                    fake.now = stop_at
                    break
                fake.now += each
                m = re.search(r"The correct answer is (.+?)\.", p)
                ans = m.group(1) if m else "-987654321"
                out += [Sample(i, j, f"\\boxed{{{ans}}}", 5, 20, "stop") for j in range(n)]
            yield out

    return FakeEngine


def _curate_argv(out, *extra):
    return ["--config", str(REPO / "configs" / "curate_demo_cpu.yaml"), "--train_data", "synth:train:12",
            "--output_dir", str(out), *map(str, extra)]


def test_curate_sizes_its_calls_to_its_budget_keeps_what_it_measured_and_resumes(tmp_path, monkeypatch, capsys):
    import data_tools.generation.engines
    import stages.curate as C
    from data_tools.config import parse_config

    fake = _FakeClock(time.time())
    calls: list[str] = []
    _fake_time(monkeypatch, fake)
    monkeypatch.setattr(data_tools.generation.engines, "VLLMEngine", _fake_engine(fake, 5.0, calls))
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    out = tmp_path / "run"
    argv = _curate_argv(out, "--chunk_size", 2, "--zero_pass_share", 1)  # a curriculum row from the first problem
    # clock 200 s, share 0.3 -> stage one until 60 s; engine up at 5 s; 5 s a problem and role. Chunk 1: a probe of one
    # problem (15 s), then the other (25 s); chunk 2 whole (45 s); chunk 3: the one problem 15 s hold (55 s), then stop
    (cfg,) = parse_config([C.CurateConfig], argv + ["--max_wall_time_seconds", "200", "--time_share", "0.3"], env={})
    m = C.curate(cfg)
    assert "resuming" not in capsys.readouterr().out
    b = m["budget"]
    assert calls == ["teacher chunk 1/6 (problems 1-1 of 2)", "student chunk 1/6 (problems 1-1 of 2)",
                     "teacher chunk 1/6 (problems 2-2 of 2)", "student chunk 1/6 (problems 2-2 of 2)",
                     "teacher chunk 2/6", "student chunk 2/6",
                     "teacher chunk 3/6 (problems 1-1 of 2)", "student chunk 3/6 (problems 1-1 of 2)"]
    assert (b["chunks"], b["chunks_measured"], b["chunks_partial"], b["problems_measured"], b["problems_unmeasured"]) == (6, 2, 1, 5, 7)
    assert b["budget_end_s"] == 60.0 and b["ended_at_s"] == 55.0 and b["probe_end_s"] == 100.0
    assert b["stop_reason"] == "budget: the next teacher+student call of one problem needs ~10s, 5s left"
    assert b["completion_tokens"] == 5 * 5 * 12 and b["generation_s"] == 50.0 and b["dropped_samples"] == 0
    parts = out / "curate" / "parts"
    assert sorted(f.name for f in parts.glob("*.partial.parquet")) == ["student-00002.partial.parquet",
                                                                        "teacher-00002.partial.parquet"]
    rollouts = pq.read_table(out / "curate" / "rollouts.parquet")
    cur = pq.read_table(out / "curate" / "curriculum.parquet").to_pylist()
    assert rollouts.num_rows == 5 * 12  # 5 problems x (4 teacher + 8 student samples)
    measured = set(rollouts.column("problem_id").to_pylist())
    assert {r["problem_id"] for r in cur} <= measured and len(measured) == 5
    # the seeded visiting order, not the file's: the 5 measured are the first 5 of the seeded shuffle
    import random

    ids = pq.read_table(out / "curate" / "problems.parquet").column("problem_id").to_pylist()
    order = list(ids)
    random.Random(0).shuffle(order)
    assert measured == set(order[:5]) and measured != set(ids[:5])
    # resume under a new clock with more room: the two whole chunks are kept, the partial one measured again, then
    # the rest (a probe first: this run has no rate yet)
    calls.clear()
    fake.now = time.time()
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    (cfg,) = parse_config([C.CurateConfig], argv + ["--max_wall_time_seconds", "1000", "--time_share", "0.5"], env={})
    m = C.curate(cfg)
    text = capsys.readouterr().out
    assert (f"[curate] resuming: 2/6 teacher and 2/6 student chunks already in {out / 'curate' / 'parts'}; "
            "measuring the rest") in text
    assert "[teacher] chunk 3/6 -> teacher-00002.parquet: 2 problems" in text  # the real index, not a restart at 1
    assert calls == ["teacher chunk 3/6 (problems 1-1 of 2)", "student chunk 3/6 (problems 1-1 of 2)",
                     "teacher chunk 3/6 (problems 2-2 of 2)", "student chunk 3/6 (problems 2-2 of 2)"] + [
        f"{r} chunk {i + 1}/6" for i in range(3, 6) for r in ("teacher", "student")]
    assert m["budget"]["chunks_measured"] == 6 and m["budget"]["stop_reason"] == "every problem measured"
    assert not list(parts.glob("*.partial.parquet"))  # replaced by the whole chunk's parts
    assert pq.read_table(out / "curate" / "rollouts.parquet").num_rows == 12 * 12
    n_calls = len(calls)
    m = C.curate(cfg)  # a third run finds everything on disk and generates nothing
    assert "6/6 teacher and 6/6 student chunks already in" in (text := capsys.readouterr().out)
    assert "nothing left to measure" in text and len(calls) == n_calls
    # its clock line reports no engine of its own (the manifest keeps the earlier run's rates for run.sh)
    assert "no engine started this run" in text and "engine start-up" not in text
    assert m["budget"]["engine_startup_s"] == 5.0


@pytest.mark.parametrize("zero_share, probes", [(1.0, 1), (0.25, 2)])
def test_a_spent_budget_measures_probes_until_a_curriculum_exists_not_a_whole_first_chunk(tmp_path, monkeypatch,
                                                                                         zero_share, probes):
    """The CPU demo on a loaded machine: engine start-up ended after stage one's budget. Stage one measures probes
    (chunk_size / 8 problems) past its budget only until the measured problems give a curriculum row (one probe
    when every zero-pass problem is kept, two when a quarter is: round(0.25 x 2) = 0 rows, round(0.25 x 4) = 1), never
    past half the training window (100 s), instead of a whole first chunk far past its budget (the chunk of 10 here
    would have ended at 160 s of a 60 s budget). An engine that cannot stop in flight is sized on the worst case."""
    import data_tools.generation.engines
    import stages.curate as C
    from data_tools.config import parse_config

    fake = _FakeClock(time.time())
    calls: list[str] = []
    _fake_time(monkeypatch, fake)
    monkeypatch.setattr(data_tools.generation.engines, "VLLMEngine", _fake_engine(fake, 5.0, calls, interruptible=False))
    monkeypatch.setenv("OPD_RUN_START", str(fake.now - 55.0))  # set-up took 55 s; the engine's 5 s end the budget
    (cfg,) = parse_config([C.CurateConfig], _curate_argv(tmp_path / "run", "--chunk_size", 10, "--max_wall_time_seconds",
                                                         200, "--time_share", 0.3, "--zero_pass_share", zero_share),
                          env={})
    m = C.curate(cfg)
    b = m["budget"]
    assert calls == [f"{r} chunk 1/2 (problems {2 * k + 1}-{2 * k + 2} of 10)" for k in range(probes)
                     for r in ("teacher", "student")]
    assert b["budget_end_s"] == 60.0 and b["probe_end_s"] == 100.0 and b["probe_size"] == 2
    assert b["ended_at_s"] == 60.0 + 20.0 * probes
    assert (b["problems_measured"], b["chunks_measured"], b["chunks_partial"]) == (2 * probes, 0, 1)
    assert b["stop_reason"] == "budget: spent before the next teacher+student call"
    assert m["counts"]["curriculum"] == {1: 2, 2: 1}[probes]  # a curriculum exists


def test_a_call_in_flight_stops_at_the_deadline_keeping_its_finished_samples(tmp_path, monkeypatch, capsys):
    """A call sized on the rate measured so far runs slower than it (a loaded machine): it stops at stage one's
    deadline, its finished samples are kept in a partial part, the unfinished dropped and counted in one line; the
    problems without their student samples are not measured."""
    import data_tools.generation.engines
    import stages.curate as C
    from data_tools.config import parse_config

    fake = _FakeClock(time.time())
    calls: list[str] = []
    _fake_time(monkeypatch, fake)
    monkeypatch.setattr(data_tools.generation.engines, "VLLMEngine", _fake_engine(fake, 2.0, calls, slow_after=2))
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    # until 60 s; engine up at 5 s; a probe of 2 problems at 2 s each and role (9 s, 13 s); then the other 8 fit the 47 s
    # left at 4 s a problem, but the teacher takes 8 s a problem: its call ends at the deadline with 5 problems done
    (cfg,) = parse_config([C.CurateConfig], _curate_argv(tmp_path / "run", "--chunk_size", 10, "--max_wall_time_seconds",
                                                         200, "--time_share", 0.3, "--zero_pass_share", 1), env={})
    m = C.curate(cfg)
    text = capsys.readouterr().out
    assert calls == ["teacher chunk 1/2 (problems 1-2 of 10)", "student chunk 1/2 (problems 1-2 of 10)",
                     "teacher chunk 1/2 (problems 3-10 of 10)"]
    line = ("[curate] stage one's deadline stopped the teacher call of chunk 1/2 in flight: 20 finished samples kept, "
            "12 unfinished dropped")
    assert text.count(line) == 1
    b = m["budget"]
    assert b["ended_at_s"] == 60.0 and b["dropped_samples"] == 12 and b["stop_reason"].startswith("deadline: the teacher")
    assert (b["problems_measured"], b["chunks_partial"]) == (2, 1)  # 5 more have teacher samples, none a student's
    roll = pq.read_table(tmp_path / "run" / "curate" / "rollouts.parquet")
    assert roll.num_rows == 2 * 12 + 5 * 4
    assert (tmp_path / "run" / "curate" / "parts" / "teacher-00000.partial.parquet").exists()


def test_curate_separate_teacher_splits_its_budget_by_samples(tmp_path, monkeypatch):
    import data_tools.generation.engines
    import stages.curate as C
    from data_tools.config import parse_config
    from data_tools.models import resolve_model

    fake = _FakeClock(time.time())
    calls: list[str] = []
    _fake_time(monkeypatch, fake)
    monkeypatch.setattr(data_tools.generation.engines, "VLLMEngine", _fake_engine(fake, 5.0, calls))
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    teacher = tmp_path / "teacher"  # another directory holding the same model's files: a second engine
    teacher.mkdir()
    for f in Path(resolve_model("smollm2-135m")).iterdir():
        (teacher / f.name).symlink_to(f)
    argv = _curate_argv(tmp_path / "run", "--chunk_size", 2, "--teacher_context", "teacher", "--teacher_model", teacher,
                        "--teacher_samples", 4, "--student_samples", 8, "--max_wall_time_seconds", 200,
                        "--time_share", 0.5)
    (cfg,) = parse_config([C.CurateConfig], argv, env={})
    m = C.curate(cfg)
    # budget until 100 s; teacher engine up at 5 s; its share: (100 - 5 - 5) x 4/12 = 30 s -> until 35 s: a probe of
    # one problem (10 s), the other (15 s), chunks 2 (25 s) and 3 (35 s); then the student over those 3 chunks, sized
    # on the teacher's rate x 8/4 samples (engine 40 s; 50, 60, 70 s)
    assert calls == [f"teacher chunk 1/6 (problems {k}-{k} of 2)" for k in (1, 2)] + [
        f"teacher chunk {i + 1}/6" for i in (1, 2)] + [f"student chunk {i + 1}/6" for i in range(3)]
    assert m["budget"]["chunks_measured"] == 3 and m["budget"]["ended_at_s"] == 70.0


def _spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


def test_hard_stop_cuts_a_step_at_the_horizon_but_never_an_optimizer_update_or_a_save():
    from trainers.callbacks import DeadlineCallback, HardStopCallback, HorizonReached

    def armed(horizon_s):
        d = DeadlineCallback(horizon_s, time.time(), handle_sigterm=False)
        h = HardStopCallback(d)
        h.on_train_begin(None, None, None)
        return h

    h = armed(0.2)
    t0 = time.time()
    with pytest.raises(HorizonReached, match="reached during a step"):
        _spin(5.0)  # a step longer than the time left
    assert time.time() - t0 < 2.0 and not h.armed
    # during the optimizer update the alarm waits, and fires when the update is done
    h = armed(0.2)
    h.on_pre_optimizer_step(None, None, None)
    _spin(0.5)
    with pytest.raises(HorizonReached):
        h.on_optimizer_step(None, None, None)
    # a save that runs past the horizon finishes first; the stop comes after it
    h = armed(0.2)
    h.on_step_end(None, None, SimpleNamespace(should_training_stop=False, should_save=True))
    _spin(0.5)
    with pytest.raises(HorizonReached):
        h.on_save(None, None, None)
    # the deadline's own stop disarms it: the final save is the reserve's
    h = armed(0.2)
    h.on_step_end(None, None, SimpleNamespace(should_training_stop=True, should_save=True))
    _spin(0.5)
    h.on_save(None, None, None)
    assert not h.armed


# ------------------------------------------------------------------------- slow: the real run.sh

def _contract_env(out: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "STUDENT_MODEL", "TEACHER_MODEL", "TRAIN_DATA", "EVAL_DATA", "CKPT_DIR", "EXPERIMENT_NAME", "OPD_RUN_START",
        "OPD_LOCK_OWNER", "CURATE_CONFIG", "TRAIN_CONFIG", "EVAL_PROTOCOLS")}
    env.update(OUTPUT_DIR=str(out), **{k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``bash run.sh`` (the embedded demo) under a 300 s clock, evaluation off so the clock goes to stage
    one and training: its output directory, exit code, log and wall time. As root (CI) it runs as on the formal
    machine, on a fresh 256 MiB tmpfs /tmp with HOME=/tmp (.ci/small_tmp.sh: a peak over 16 MiB there fails it)."""
    out = tmp_path_factory.mktemp("run_sh") / "out"
    env = _contract_env(out, MAX_WALL_TIME_SECONDS=300, DEADLINE_RESERVE_SECONDS=45, EVAL_PROTOCOLS="",
                        SMALL_TMP_KEEP=str(out.parent))
    cmd = ["bash", str(REPO / "run.sh")]
    if os.geteuid() == 0 and shutil.which("unshare"):
        cmd = ["bash", str(REPO / ".ci" / "small_tmp.sh"), *cmd]
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return SimpleNamespace(out=out, rc=r.returncode, log=r.stdout + r.stderr, wall=time.time() - t0)


def _last_export(out: Path) -> Path:
    from trainers.callbacks import checkpoint_steps

    steps = checkpoint_steps(out / "checkpoints")
    assert steps, f"no checkpoint-<step> in {out / 'checkpoints'}"
    return steps[-1][1]


@pytest.mark.slow
def test_run_sh_fits_the_whole_run_in_its_clock(demo_run):
    assert demo_run.rc == 0, demo_run.log[-3000:]
    assert demo_run.wall < 300, f"run.sh took {demo_run.wall:.0f}s of a 300 s clock"
    log = demo_run.log
    assert "recipe demo_cpu (STUDENT_MODEL is not set)" in log and "[curate] budget: until" in log
    assert "[curate] clock:" in log and "[train] clock: training from" in log and "done at" in log
    budget = json.loads((demo_run.out / "curate" / "manifest.json").read_text())["budget"]
    # stage one's calls are sized to its 76.5 s (set-up and the engine's start-up take most of it on 2 cores): it
    # measures what fits, at least its probe, and ends within one call of its budget (or, while no curriculum row
    # exists yet, of its probes' end)
    assert budget["budget_end_s"] == pytest.approx(0.3 * 255, abs=0.1) and budget["problems_measured"] >= 2
    assert budget["ended_at_s"] <= max(budget["budget_end_s"], budget["probe_end_s"] or 0) + 30
    summary = json.loads((demo_run.out / "train_summary.json").read_text())
    assert summary["horizon_s"] == 255 and summary["wall_s"] <= 300  # training and its final export inside the clock
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_last_export(demo_run.out))
    assert model.num_parameters() > 10**8


@pytest.mark.slow
def test_final_export_loads_and_generates_in_vllm(demo_run):
    assert demo_run.rc == 0, demo_run.log[-3000:]
    code = ("import json, sys\nfrom data_tools.generation.engines import VLLMEngine\n"
            "e = VLLMEngine(sys.argv[1], max_model_len=256)\n"
            "s = [x for b in e.generate(['What is 2 + 3?'], n=2, max_tokens=8) for x in b]\n"
            "e.close()\nprint(json.dumps([[x.n_tokens, x.finish_reason] for x in s]))\n")
    r = subprocess.run([sys.executable, "-c", code, str(_last_export(demo_run.out))], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    samples = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(samples) == 2 and all(1 <= n <= 8 and reason in ("stop", "length") for n, reason in samples)


@pytest.mark.slow
def test_ctrl_c_during_training_saves_stops_and_releases_the_lock(demo_run, tmp_path):
    """SIGINT to run.sh mid-training (as Ctrl-C sends it) acts like SIGTERM: training saves after its
    current step and stops, run.sh exits 130 and releases the lock. The run resumes demo_run's, and
    stage one's budget is spent at once, so it reuses the measured chunks without an engine."""
    assert demo_run.rc == 0, demo_run.log[-3000:]
    cfg = tmp_path / "curate.yaml"
    cfg.write_text((REPO / "configs" / "curate_demo_cpu.yaml").read_text() + "time_share: 0.001\n")
    metrics = demo_run.out / "metrics" / "train.jsonl"
    lines = lambda: len(metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
    before = lines()
    env = _contract_env(demo_run.out, MAX_WALL_TIME_SECONDS=900, DEADLINE_RESERVE_SECONDS=45, EVAL_PROTOCOLS="",
                        CURATE_CONFIG=cfg)
    log = tmp_path / "log"
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", str(REPO / "run.sh")], env=env, stdout=f, stderr=subprocess.STDOUT,
                             preexec_fn=default_sigint)  # as a terminal's foreground job, however pytest was started
    try:
        deadline = time.time() + 600
        while lines() == before:  # a new training step: training is running
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(2)
        stage = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        os.kill(p.pid, signal.SIGINT)
        rc = p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert rc == 130, text[-3000:]
    assert "got SIGINT; stopping the current stage" in text
    assert "curate: skipped, training has state" in text  # the resumed run keeps the curriculum it began with
    summary = json.loads((demo_run.out / "train_summary.json").read_text())
    assert summary["stop_reason"] == "sigterm" and summary["global_step"] > before
    assert _last_export(demo_run.out).name == f"checkpoint-{summary['global_step']}"
    assert not list(demo_run.out.rglob(".opd.lock"))  # released
    assert stage and all(not Path(f"/proc/{pid}").exists() for pid in stage)  # the stage is gone, not orphaned


def test_a_resumed_run_does_not_save_the_hedges_it_had_passed_again():
    from trainers.callbacks import SaveCadenceCallback

    f = [0.85]  # the run's share (OPDTrainer.time_fraction) when the resumed run's first step ends
    cb = SaveCadenceCallback(hedge_fractions=(0.8, 0.9), fraction=lambda: f[0])
    cb.resume_at(0.84)  # the resumed save was at 0.84: the 0.8 hedge's export is on disk
    state, control = SimpleNamespace(global_step=11), SimpleNamespace(should_save=False)
    cb.on_step_end(None, state, control)
    assert not control.should_save and cb.crossed == [0.8] and cb.take_covered() == []
    f[0] = 0.91
    cb.on_step_end(None, state, control)
    assert control.should_save and cb.take_covered() == [0.9] and cb.crossed == [0.8, 0.9]
