"""``python -m stages.train``: configs, run contract (deadline, checkpoints, resume, lock)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_trainer import curriculum_path, tiny_model_dir, tokenizer  # noqa: F401 - pytest fixtures

REPO = Path(__file__).resolve().parents[1]
#: The stage-two recipes in configs/ (other stages' configs are tested with their stages).
TRAIN_CONFIGS = ["demo_cpu.yaml", "demo_gpu.yaml", "opd_r1_distill_1p5b.yaml"]


@pytest.mark.parametrize("name", TRAIN_CONFIGS)
def test_train_configs_load_and_validate(name, tmp_path, monkeypatch):
    import transformers.training_args as ta

    from data_tools.config import parse_config
    from trainers.opd_config import OPDConfig

    path = REPO / "configs" / name
    first = path.read_text().splitlines()[0]
    assert first.startswith("# run: "), "every config states its command on its first line"
    # the GPU recipe asks for bf16, which TrainingArguments refuses on a CPU machine: validate as on a GPU
    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "STUDENT_MODEL": "/models/student", "MAX_WALL_TIME_SECONDS": "3600"}
    (args,) = parse_config([OPDConfig], ["--config", str(path)], env=env)
    assert args.output_dir == str(tmp_path / "out") and args.student_model == "/models/student"
    assert args.max_wall_time_seconds == 3600.0  # the environment wins over the YAML
    assert args.max_steps >= 10**9  # never bounded by steps
    if name == "opd_r1_distill_1p5b.yaml":
        # the fast decoder generates (the rehearsed path); vLLM colocate is one flag away
        assert args.max_completion_length >= 8192 and not args.use_vllm and args.vllm_mode == "colocate"
        assert args.kl_mode == "sampled" and args.w_reward > 0 and args.ckpt_every_minutes == 30
        assert args.lr_scheduler_type == "linear_time"  # the formal default: linear decay over the clock
        # SFT on the verified teacher solutions for 8 passes, then on-policy KL + reward (LEARNING.md, "The verdict so far")
        assert args.sft_share_start == args.sft_share_end == 1.0 and args.sft_max_epochs == 8 and args.w_kl > 0
        assert args.sft_learning_rate == pytest.approx(10 * args.learning_rate)
        assert args.matmul_precision == "high" and not args.tf32  # TF32 for the fp32 head, set by the trainer
        (full,) = parse_config([OPDConfig], ["--config", str(path)], env={"OUTPUT_DIR": str(tmp_path / "o2")})
        assert full.max_wall_time_seconds == 12 * 3600
        # turning SFT off: one error names both settings that act only on SFT steps, and the flags it names work
        off = ["--config", str(path), "--sft_share_start", "0", "--sft_share_end", "0"]
        with pytest.raises(ValueError, match=r"set --sft_learning_rate 0 --sft_max_epochs 0 as well"):
            parse_config([OPDConfig], off, env=env)
        (no_sft,) = parse_config([OPDConfig], off + ["--sft_learning_rate", "0", "--sft_max_epochs", "0"], env=env)
        assert no_sft.sft_share_start == no_sft.sft_share_end == no_sft.sft_max_epochs == 0 and no_sft.w_kl > 0
    if name == "demo_cpu.yaml":
        assert not args.bf16 and args.model_dtype == "float32" and args.teacher_context == "privileged"
    if name.startswith("demo_"):  # the formal recipe's order, one pass of SFT so the on-policy steps show too
        assert args.sft_share_start == args.sft_share_end == 1.0 and args.sft_max_epochs == 1 and args.w_kl > 0


def _env(tmp_path, model_dir, data, **extra):
    # the curriculum where stage one leaves it (TRAIN_DATA names stage one's raw problems, not this)
    dest = tmp_path / "run" / "curate" / "curriculum.parquet"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(data, dest)
    env = dict(os.environ, OUTPUT_DIR=str(tmp_path / "run"), STUDENT_MODEL=model_dir, TRAIN_DATA="synth:train:8",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OPD_LOG_LEVEL="WARNING")  # keeps a PYTHONPATH that holds the dependencies (GPU machine: --target dir)
    env.pop("TEACHER_MODEL", None)
    env.pop("CKPT_DIR", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


TINY_FLAGS = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--num_generations", "4",
              "--max_completion_length", "6", "--learning_rate", "1e-3", "--prompt_style", "short"]


def test_deadline_stops_in_time_with_loadable_final_checkpoint(tmp_path, tiny_model_dir, curriculum_path):  # noqa: F811
    env = _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=90, DEADLINE_RESERVE_SECONDS=30)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "stages.train", *TINY_FLAGS, "--ckpt_every_steps", "3",
                           "--ckpt_every_minutes", "0"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=200)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert wall < 90, f"run took {wall:.0f}s, past MAX_WALL_TIME_SECONDS=90"
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    # the clock stopped it: between steps ("deadline ...") or, where a step ran past the horizon on a slow
    # machine, cut short by the hard stop ("horizon ... reached during a step")
    assert summary["stop_reason"].startswith(("deadline", "horizon")), summary["stop_reason"]
    assert summary["wall_s"] <= 60 + 5
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("checkpoint-*"))
    assert 1 <= len(ckpts) <= 3
    final = tmp_path / "run" / "checkpoints" / f"checkpoint-{summary['global_step']}"
    assert final in ckpts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (final / f).exists(), f
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_killed_run_resumes_from_last_state(tmp_path, tiny_model_dir, curriculum_path, monkeypatch, capfd):  # noqa: F811
    """Run until killed (SIGKILL right after a saved step), restart: global_step continues from the save. The tied
    output head, stored once with the embeddings, is not reported as a missing key."""
    env = _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=600, DEADLINE_RESERVE_SECONDS=10)
    cmd = [sys.executable, "-m", "stages.train", *TINY_FLAGS, "--ckpt_every_steps", "2", "--ckpt_every_minutes", "0"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    resume = tmp_path / "run" / "resume"
    deadline = time.time() + 150
    try:
        while time.time() < deadline:
            done = [p for p in resume.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
            if any(int(p.name.split("-")[1]) >= 2 for p in done):
                break
            time.sleep(0.5)
        else:
            pytest.fail("no resume state appeared")
    finally:
        proc.kill()  # SIGKILL: no clean shutdown, no final checkpoint
        proc.wait()
    saved = max(int(p.name.split("-")[1]) for p in resume.glob("checkpoint-*") if (p / "trainer_state.json").exists())
    from stages.train import main

    for k in ("OUTPUT_DIR", "STUDENT_MODEL", "TRAIN_DATA"):
        monkeypatch.setenv(k, env[k])
    # in-process restart (saves the interpreter start-up); the deadline is far away here. The fixture's curriculum
    # has no teacher solutions: the demo's SFT pass is turned off, as the first run had it
    no_sft = ["--sft_share_start", "0", "--sft_share_end", "0", "--sft_learning_rate", "0", "--sft_max_epochs", "0"]
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()  # transformers' default (warning), whatever an earlier test in this
    hf_logging.set_verbosity_warning()      # process set: the line below is made from its warning
    try:
        rc = main(["--config", str(REPO / "configs" / "demo_cpu.yaml"), *TINY_FLAGS, *no_sft,
                   "--debug_max_steps", str(saved + 2),
                   "--ckpt_every_steps", "0", "--ckpt_every_minutes", "0", "--max_wall_time_seconds", "100000",
                   "--deadline_reserve_seconds", "10"])
    finally:
        hf_logging.set_verbosity(verbosity)
    assert rc == 0
    out, _ = capfd.readouterr()  # transformers warned; the filter turned it into this line
    assert ("[train] resumed: lm_head.weight not in the checkpoint: tied to the input embeddings, stored once and "
            "loaded with them (not an error)") in out
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["resumed_from"].endswith(f"checkpoint-{saved}")
    assert summary["global_step"] == saved + 2
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert steps[-2:] == [saved + 1, saved + 2]  # continued, not restarted from 1


def test_second_run_on_same_dirs_exits_75(tmp_path, tiny_model_dir, curriculum_path):  # noqa: F811
    from data_tools.runio import EXIT_LOCKED, run_lock
    from stages.train import main

    out = tmp_path / "run"
    # a live foreign holder: our parent process (pytest's parent is alive and not us)
    with run_lock(out):
        lock = out / ".opd.lock"
        rec = json.loads(lock.read_text())
        rec["pid"] = os.getppid()
        lock.write_text(json.dumps(rec))
        rc = main(["--output_dir", str(out), "--student_model", tiny_model_dir, "--curriculum_path", curriculum_path])
        lock.unlink()
    assert rc == EXIT_LOCKED


def test_formal_recipe_at_toy_size_fine_tunes_then_goes_on_policy(tmp_path, tiny_model_dir, monkeypatch,  # noqa: F811
                                                                    capsys):
    """The formal recipe's own config on the CPU (vLLM, bf16 and compile off; toy lengths): its off-policy steps on the
    curriculum's verified solutions stop after sft_max_epochs = 8 passes, and every later step is on-policy, with
    rollouts written (bench/LEARNING.md, "The verdict so far")."""
    from stages.train import main
    from tests.test_offpolicy import solved_curriculum

    cur = solved_curriculum(tmp_path / "data")  # 4 of 8 rows carry a verified solution: one batch of 4 per pass
    env = _env(tmp_path, tiny_model_dir, cur)
    for k in ("OUTPUT_DIR", "STUDENT_MODEL", "TRAIN_DATA"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.delenv("TEACHER_MODEL", raising=False)
    rc = main(["--config", str(REPO / "configs" / "opd_r1_distill_1p5b.yaml"), *TINY_FLAGS, "--sft_batch_size", "4",
               "--use_vllm", "false", "--bf16", "false", "--teacher_dtype", "float32", "--export_dtype", "float32",
               "--decode_compile", "false", "--gradient_checkpointing", "false", "--debug_max_steps", "10",
               "--max_wall_time_seconds", "100000", "--lr_warmup_time", "0"])
    assert rc == 0
    run = tmp_path / "run"
    recs = [json.loads(x) for x in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["sft/off_policy_step"] for r in recs] == [1.0] * 8 + [0.0, 0.0]
    assert [r["sft/epoch"] for r in recs] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 8.0, 8.0]
    assert [r["sft/lr_scale"] for r in recs] == [pytest.approx(1e-5 / 1e-3)] * 8 + [1.0, 1.0]  # TINY_FLAGS' lr 1e-3
    assert recs[-1]["loss/kl"] != 0 and "reward/mean" in recs[-1]
    assert len(list((run / "rollouts").glob("*.parquet"))) == 2  # the two on-policy steps
    lines = [x for x in capsys.readouterr().out.splitlines()
             if x.startswith(("[step", "[train] on-policy")) and "running:" not in x]  # not the heartbeat
    assert all(x.startswith(f"[step {i + 1}] sft loss=") and f" pass={i + 1}.00 lr_scale=0.01 " in x
               for i, x in enumerate(lines[:8])), lines[:8]
    assert lines[8] == "[train] on-policy from step 9 (after 8 off-policy SFT steps, 8 passes over the curriculum's teacher solutions)"
    assert all(" sft " not in x and "reward=" in x for x in lines[9:]) and len(lines) == 11


def test_sft_recipe_without_teacher_solution_column_fails_before_loading_models(tmp_path, tiny_model_dir,  # noqa: F811
                                                                                curriculum_path, monkeypatch, capsys):
    """SFT for the whole clock on a curriculum without stage one's solutions fails before the models load; a recipe
    that only starts with them (sft_max_epochs > 0: the demo's, the formal one's) goes on-policy from step 1."""
    import stages.train as st
    import trainers.model_utils as mu

    env = _env(tmp_path, tiny_model_dir, curriculum_path)  # the plain curriculum: no teacher_solution column
    for k in ("OUTPUT_DIR", "STUDENT_MODEL", "TRAIN_DATA"):
        monkeypatch.setenv(k, env[k])
    load_models = mu.load_models
    monkeypatch.setattr(mu, "load_models", lambda args: pytest.fail("models loaded before the curriculum was checked"))
    rc = st.main(["--config", str(REPO / "configs" / "opd_r1_distill_1p5b.yaml"), *TINY_FLAGS, "--use_vllm", "false",
                  "--bf16", "false", "--sft_max_epochs", "0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "curriculum.parquet: no 'teacher_solution' column" in err
    # the flags it names turn the off-policy terms off and pass the config's checks
    flags = err.split("off-policy terms off: ")[1].split()[:10]
    assert flags == ["--w_sft", "0", "--sft_share_start", "0", "--sft_share_end", "0", "--sft_learning_rate", "0",
                     "--sft_max_epochs", "0"]
    from trainers.opd_config import OPDConfig
    from data_tools.config import parse_config

    (off,) = parse_config([OPDConfig], ["--config", str(REPO / "configs" / "opd_r1_distill_1p5b.yaml"), "--bf16",
                                        "false", "--use_vllm", "false", *flags], env={"OUTPUT_DIR": str(tmp_path / "o")})
    assert not off.trains_on_teacher_solutions

    monkeypatch.setattr(mu, "load_models", load_models)
    assert st.main(["--config", str(REPO / "configs" / "demo_cpu.yaml"), *TINY_FLAGS, "--debug_max_steps", "1",
                    "--ckpt_every_minutes", "0"]) == 0
    [rec] = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert rec["sft/off_policy_step"] == 0.0 and isinstance(rec["kl/sampled_mean"], float)


def test_missing_tied_head_on_resume_is_one_line_other_missing_keys_still_warn(tiny_model_dir, caplog):  # noqa: F811
    import logging

    from transformers import AutoModelForCausalLM

    from stages.train import _explain_tied_keys

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # tie_word_embeddings=True
    said = []
    _explain_tied_keys(model, said.append)
    _explain_tied_keys(model, said.append)  # a second run in this process replaces the filter, not adds one
    logger = logging.getLogger("transformers.trainer")
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"):
        logger.warning("There were missing keys in the checkpoint model loaded: ['lm_head.weight'].")
        logger.warning("There were missing keys in the checkpoint model loaded: ['model.norm.weight'].")
    assert [r.getMessage() for r in caplog.records] == [
        "There were missing keys in the checkpoint model loaded: ['model.norm.weight']."]
    assert said == ["[train] resumed: lm_head.weight not in the checkpoint: tied to the input embeddings, stored once "
                    "and loaded with them (not an error)"]


def test_a_run_with_no_training_time_left_trains_nothing_and_says_so(tmp_path, tiny_model_dir, curriculum_path):  # noqa: F811
    """Set-up and stage one took the window (the run's clock began 90 s ago, the horizon is at 70 s): the start model
    is exported as checkpoint-0 and the stage's last line and its summary say that it trained 0 steps, and why."""
    env = _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=100, DEADLINE_RESERVE_SECONDS=30,
               OPD_RUN_START=repr(time.time() - 90))
    proc = subprocess.run([sys.executable, "-m", "stages.train", *TINY_FLAGS], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 0 and summary["start_model_only"]
    assert summary["stop_reason"].startswith("no training time left at start: training began at")
    last = proc.stdout.strip().splitlines()[-1]
    assert last == (f"[train] trained 0 steps ({summary['stop_reason']}): checkpoint-0 is the start model, not a "
                    "trained one")
    assert (tmp_path / "run" / "checkpoints" / "checkpoint-0" / "config.json").exists()


def test_console_names_the_later_updates_of_a_rollout_batch(capsys):
    """With steps_per_generation > 1 only a rollout batch's first update samples: its line has the reward and the
    lengths, and the later updates say which update of whose rollouts they are, not 'reward=nan len=nan'."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from stages.train import _Console

    cb, state, args = _Console(), TrainerState(), SimpleNamespace(steps_per_generation=4)
    for step in range(1, 7):
        state.global_step = step
        first = step in (1, 5)
        logs = {"loss": 0.1, "kl/sampled_mean": 0.1, "time/step": 1.0}
        if first:
            logs.update({"reward/mean": 0.5, "completions/mean_length": 30.0, "time/generation": 0.5})
        cb.on_log(args, state, None, logs=logs)
    lines = capsys.readouterr().out.splitlines()
    assert "reward=0.500 len=30.0" in lines[0] and "reward=0.500" in lines[4]
    assert lines[1].endswith("update 2/4 of step 1's rollouts step=1.0s") and "update 4/4 of step 1's" in lines[3]
    assert "update 2/4 of step 5's rollouts" in lines[5] and not any("nan" in x for x in lines)


def test_max_steps_caps_the_steps_as_debug_max_steps(tmp_path, tiny_model_dir, curriculum_path, monkeypatch,  # noqa: F811
                                                     capsys):
    """A TRL user's --max_steps stops training after that many steps (transformers keeps its unbounded count, which
    the time schedules need); a max_steps that disagrees with debug_max_steps is refused, naming both, and so is a
    num_train_epochs, which would not stop a run that cycles over the curriculum. An export another training left in
    the exports directory is renamed out of checkpoint-* (files kept), and this run's name their training."""
    from data_tools.config import parse_config
    from stages.train import main
    from trainers.opd_config import UNBOUNDED_STEPS, OPDConfig

    env = {"OUTPUT_DIR": str(tmp_path / "o"), "STUDENT_MODEL": tiny_model_dir, "TRAIN_DATA": curriculum_path}
    (a,) = parse_config([OPDConfig], [*TINY_FLAGS, "--max_steps", "3"], env=env)
    assert (a.debug_max_steps, a.max_steps) == (3, UNBOUNDED_STEPS)
    (b,) = parse_config([OPDConfig], [*TINY_FLAGS], env=env)
    assert (b.debug_max_steps, b.max_steps) == (0, UNBOUNDED_STEPS)
    with pytest.raises(ValueError, match="max_steps 3 and debug_max_steps 2 disagree"):
        parse_config([OPDConfig], [*TINY_FLAGS, "--max_steps", "3", "--debug_max_steps", "2"], env=env)
    for bad in ("0", "-5"):
        with pytest.raises(ValueError, match=f"max_steps must be a cap of >= 1 optimizer steps, or -1 for none; got {bad}"):
            parse_config([OPDConfig], [*TINY_FLAGS, "--max_steps", bad], env=env)
    with pytest.raises(ValueError, match="num_train_epochs 1 would not stop training"):
        parse_config([OPDConfig], [*TINY_FLAGS, "--num_train_epochs", "1"], env=env)

    for k, v in _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=100_000,
                     DEADLINE_RESERVE_SECONDS=10).items():
        if k in ("OUTPUT_DIR", "STUDENT_MODEL", "TRAIN_DATA"):
            monkeypatch.setenv(k, v)
    no_sft = ["--sft_share_start", "0", "--sft_share_end", "0", "--sft_learning_rate", "0", "--sft_max_epochs", "0"]
    stale = tmp_path / "run" / "checkpoints" / "checkpoint-999"  # another run's export in this run's directory
    stale.mkdir(parents=True)
    assert main(["--config", str(REPO / "configs" / "demo_cpu.yaml"), *TINY_FLAGS, *no_sft, "--max_steps", "2",
                 "--ckpt_every_minutes", "0"]) == 0
    assert (f"[train] WARNING: {tmp_path / 'run' / 'checkpoints'} held 1 export(s) this training did not write "
            "(checkpoint-999): renamed to stale-checkpoint-999, files kept") in capsys.readouterr().out
    assert not stale.exists() and stale.with_name("stale-checkpoint-999").is_dir()
    owner = json.loads((tmp_path / "run" / "checkpoints" / "checkpoint-2" / "opd_checkpoint.json").read_text())["owner"]
    assert owner.startswith(f"{(tmp_path / 'run').resolve()}#") and owner == (
        tmp_path / "run" / "metrics" / "export_owner").read_text().strip()
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 2 and summary["stop_reason"] == "max_steps=2 (the step cap)", summary
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
