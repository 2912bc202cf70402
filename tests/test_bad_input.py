"""Bad input and bad places: typed config values, broken data files, unwritable and full
directories, model directories, grader CLI, metrics after a crash, file modes. Fast, no generation."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faultkit import REPO, fill, read_only_dir, tmpfs

ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _cli(args, tmp_path, **env):
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env={**ENV, **env}, capture_output=True,
                          text=True, timeout=120)


# ---- config values ----------------------------------------------------------------------------------

@pytest.mark.parametrize("line, needle", [
    ("max_tokens: 2.5", "key 'max_tokens': 2.5 (float) is not a valid int"),
    ("teacher_samples: [2, 4]", "key 'teacher_samples' takes a single value, got a list"),
    ("temperature: yes", "key 'temperature': True (bool) is not a valid float"),
    ("max_model_len: null", "key 'max_model_len' needs a value"),
])
def test_yaml_value_of_wrong_type_names_file_and_key(tmp_path, line, needle):
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"{line}\noutput_dir: {tmp_path / 'out'}\n")
    with pytest.raises(ValueError) as e:
        parse_config([CurateConfig], ["--config", str(cfg)], env={})
    assert str(cfg) in str(e.value) and needle in str(e.value)


def test_yaml_values_convert_like_flags(tmp_path):
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"temperature: 7e-1\nteacher_samples: '3'\nlimit: null\noutput_dir: {tmp_path / 'out'}\n")
    (c,) = parse_config([CurateConfig], ["--config", str(cfg)], env={})
    assert (c.temperature, c.teacher_samples, c.limit) == (0.7, 3, None)  # PyYAML reads 7e-1 as a string


def test_curate_cli_bad_value_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"max_tokens: 2.5\noutput_dir: {tmp_path / 'out'}\n")
    r = _cli(["stages.curate", "--config", str(cfg)], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"opd curate: error: config file {cfg}: key 'max_tokens': "
                                                 f"2.5 (float) is not a valid int")
    r = _cli(["stages.curate", "--max_tokens", "2.5", "--output_dir", str(tmp_path / "o")], tmp_path)
    assert r.returncode == 2 and "usage:" not in r.stderr
    assert "argument --max_tokens/--max-tokens: invalid int value: '2.5'" in r.stderr.strip().splitlines()[-1]


def test_known_trl_vllm_warnings_silenced_others_kept():
    code = ("import warnings; warnings.simplefilter('default'); import data_tools.config, trl.generation; "
            "warnings.warn('other warning', UserWarning)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TRL currently supports vLLM" not in r.stderr and "other warning" in r.stderr


def test_engine_start_noise_silenced_real_warnings_kept():
    """What vLLM's stack prints at every start and says nothing (a Triton notice on CPU, a deprecated alias, Python's
    resource tracker at exit) is silenced by exact message, here and in the processes an engine starts; other
    warnings, of the same categories and loggers, still show."""
    code = r"""
import logging, os, subprocess, sys, warnings
warnings.simplefilter("default")
logging.basicConfig(format="%(name)s: %(message)s")
import data_tools.generation.engines as e
warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead", FutureWarning)
warnings.warn("a real FutureWarning", FutureWarning)
lg = logging.getLogger("vllm.triton_utils.importing")
lg.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
lg.warning("a real vLLM warning")
env = dict(os.environ)
e.quiet_noise(env)
child = ("import warnings\n"
         "warnings.warn_explicit('resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at "
         "shutdown', UserWarning, 'resource_tracker.py', 254, module='multiprocessing.resource_tracker')\n"
         "warnings.warn('`torch.distributed.reduce_op` is deprecated', FutureWarning)\n"
         "warnings.warn('a real UserWarning in a child', UserWarning)\n")
subprocess.run([sys.executable, "-c", child], env=env, check=True)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for noise in ("reduce_op", "Triton is installed", "resource_tracker"):
        assert noise not in r.stderr, r.stderr
    for real in ("a real FutureWarning", "vllm.triton_utils.importing: a real vLLM warning", "a real UserWarning in a child"):
        assert real in r.stderr, r.stderr


def test_vllm_cpu_engine_starts_without_loading_bar_or_cpp_notices(monkeypatch, tmp_path):
    """The engine is built with no weights-loading bar; on CPU its processes start with torch's C++ log at ERROR (a
    NUMA binding notice at every start), this process's environment is left as it was, and a level the user set wins."""
    vllm = pytest.importorskip("vllm")
    from data_tools.generation import engines

    seen = []

    class FakeLLM:
        def __init__(self, **kw):
            seen.append((kw, os.environ.get("TORCH_CPP_LOG_LEVEL"), os.environ.get("PYTHONWARNINGS", "")))

        def get_tokenizer(self):
            return None

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(engines, "on_gpu", lambda: False)
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    engines.VLLMEngine("/models/m")
    kw, level, pywarn = seen[-1]
    assert kw["use_tqdm_on_load"] is False and level == "ERROR" and "TORCH_CPP_LOG_LEVEL" not in os.environ
    assert pywarn.startswith("default::DeprecationWarning,ignore:`torch.distributed.reduce_op` is deprecated:")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "WARNING")
    engines.VLLMEngine("/models/m")
    assert seen[-1][1] == "WARNING" and os.environ["TORCH_CPP_LOG_LEVEL"] == "WARNING"


def test_vllm_generate_shows_no_progress_bar_and_a_line_a_chunk(capsys):
    """vLLM's bar counts prompts, which finish together at a chunk's end (an ETA that says nothing): generate asks
    for none (``use_tqdm=False``, and no weights-loading bar), prints a line a chunk, and a heartbeat while one runs."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from data_tools.generation import engines

    calls = []

    class FakeLLM:
        def generate(self, requests, sampling, use_tqdm=True):
            calls.append(use_tqdm)
            time.sleep(0.25)
            return [SimpleNamespace(outputs=[SimpleNamespace(text="7", token_ids=[1], finish_reason="stop")],
                                    prompt_token_ids=r["prompt_token_ids"]) for r in requests]

    class Tok:
        chat_template = None

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[1, 2] for _ in texts]}

        def encode(self, text, add_special_tokens=False):
            return [1, 2]

    eng = engines.VLLMEngine.__new__(engines.VLLMEngine)
    eng.llm, eng.tokenizer, eng.procs, eng.name, eng.request_seeds = FakeLLM(), Tok(), [], "vllm-cpu", False
    os.environ["OPD_HEARTBEAT_S"] = "0.1"
    try:
        out = [len(b) for b in eng.generate(["a", "b", "c"], n=1, max_tokens=4, chunk_size=2, desc="student chunk 1/1")]
    finally:
        os.environ.pop("OPD_HEARTBEAT_S")
    assert out == [2, 1] and calls == [False, False]
    lines = capsys.readouterr().out.splitlines()
    assert "[student chunk 1/1] prompts 0-2 of 3 generating: 0s" in lines
    assert [x.split(" |")[0] for x in lines if " | " in x] == ["[student chunk 1/1] 2/3 prompts x 1 samples",
                                                               "[student chunk 1/1] 3/3 prompts x 1 samples"]


# ---- data files -------------------------------------------------------------------------------------

def test_non_utf8_line_rejects_that_line_only(tmp_path):
    from data_tools.problems import load_problems

    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"problem": "What is 1+1?", "answer": "2"}\n'
                  b'{"problem": "What is 2+\xff2?", "answer": "4"}\n'
                  b'{"problem": "What is 3+3?", "answer": "6"}\n')
    res = load_problems(f)
    assert [r["answer"] for r in res.rows] == ["2", "6"]
    assert len(res.rejects) == 1 and res.rejects[0]["row_index"] == 1
    assert res.rejects[0]["reason"].startswith("line 2 is not UTF-8")


def test_json_array_file(tmp_path):
    from data_tools.problems import load_problems

    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"question": "What is 1+1?", "answer": "2"}, 7, {"question": "What is 2+2?", "answer": 4}]))
    res = load_problems(f)
    assert [r["answer"] for r in res.rows] == ["2", "4"]
    assert [r["reason"] for r in res.rejects] == ["item 1 is not a JSON object"]


def test_duplicate_with_other_answer_is_a_conflict(tmp_path):
    from data_tools.problems import load_problems

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "problem": "What is 2+2?", "answer": "4"},
        {"id": "b", "problem": "what is  2+2?", "answer": "4"},
        {"id": "c", "problem": "What is 2+2?", "answer": "5"}]))
    res = load_problems(f)
    reasons = {r["problem_id"]: r["reason"] for r in res.rejects}
    assert reasons["b"] == "duplicate problem (first seen as a)"
    assert reasons["c"] == "conflict: duplicate problem with a different answer ('5' here, '4' in a)"
    assert (res.duplicates, res.conflicts, len(res.rows)) == (1, 1, 1)  # each repeated row counted once


@pytest.mark.parametrize("name, body", [("empty.jsonl", b""), ("blank.jsonl", b"\n\n"), ("empty.json", b"[]")])
def test_empty_input_is_error_exit_2(tmp_path, name, body):
    f = tmp_path / name
    f.write_bytes(body)
    r = _cli(["stages.curate", "--train_data", str(f), "--output_dir", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"opd curate: error: {f}: no rows (the file is empty)"


def test_overlong_problems_go_to_rejects_before_generation(tmp_path):
    """A 5 MB problem and a ~700-token one under max_model_len=512 are rejected by the tokenizer count."""
    from data_tools.models import resolve_model
    from stages.curate import CurateConfig, fit_context

    model = resolve_model("smollm2-135m")
    rows = [{"problem_id": "ok", "problem": "What is 2 + 3?", "answer": "5", "solution": None},
            {"problem_id": "huge", "problem": "1 + " * 1_250_000 + "1 = ?", "answer": "1250001", "solution": None},
            {"problem_id": "long", "problem": "What is " + " + ".join(["12"] * 230) + "?", "answer": "2760",
             "solution": None}]
    cfg = CurateConfig(max_model_len=512, max_tokens=24, prompt_style="short", output_dir=str(tmp_path / "o"))
    t0 = time.time()
    kept, rejects = fit_context(rows, cfg, model, model)
    assert [r["problem_id"] for r in kept] == ["ok"]
    assert {r["problem_id"] for r in rejects} == {"huge", "long"}
    assert all(r["stage"] == "context" and "> max_model_len 512" in r["reason"] for r in rejects)
    n_long = int(next(r for r in rejects if r["problem_id"] == "long")["reason"].split()[2])
    assert 512 - 24 < n_long < 1000
    assert time.time() - t0 < 60


def test_a_refused_curation_leaves_the_other_curations_tables_as_they_were(tmp_path):
    """Another curation's chunks in OUTPUT_DIR: stage one refuses before it writes anything (it rewrote
    problems.parquet first, and the finished run's joins lost their rows)."""
    from stages.curate import CurateConfig, prepare

    cur = tmp_path / "o" / "curate"
    (cur / "parts").mkdir(parents=True)
    (cur / "parts" / "teacher-00000.parquet").write_bytes(b"chunk")
    (cur / "state.json").write_text(json.dumps({"fingerprint": "another curation"}))
    (cur / "problems.parquet").write_bytes(b"the finished run's problems")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"problem": "What is 2 + 3?", "answer": "5"}) + "\n")
    cfg = CurateConfig(train_data=str(data), output_dir=str(tmp_path / "o"), max_model_len=512, max_tokens=24,
                       prompt_style="short")
    with pytest.raises(ValueError, match="holds chunks of a different curation"):  # opd curate: one line, exit 2
        prepare(cfg)
    assert (cur / "problems.parquet").read_bytes() == b"the finished run's problems"
    assert json.loads((cur / "state.json").read_text()) == {"fingerprint": "another curation"}


# ---- models -----------------------------------------------------------------------------------------

def test_model_dir_with_only_config_says_what_is_missing(tmp_path):
    from data_tools.models import resolve_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model(tmp_path)
    msg = str(e.value)
    assert "no tokenizer" in msg and "no weights" in msg and "sentencepiece" not in msg


# ---- grader CLI -------------------------------------------------------------------------------------

def test_grader_cli_missing_file_and_integer_gold(tmp_path):
    r = _cli(["data_tools.grader", str(tmp_path / "nope.jsonl")], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"grader: error: cannot read {tmp_path / 'nope.jsonl'}: No such file or directory"
    f = tmp_path / "g.jsonl"
    f.write_text(json.dumps({"gold": 42, "pred": "so the answer is \\boxed{42}"}) + "\n")
    r = _cli(["data_tools.grader", str(f)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["correct"] is True


# ---- unwritable and full directories ----------------------------------------------------------------

def test_read_only_run_dir_is_one_line_error(tmp_path):
    from data_tools.runio import RunDirError, acquire_lock

    with read_only_dir(tmp_path / "ro") as ro:
        with pytest.raises(RunDirError, match="is not writable: read-only file system|is not writable: permission"):
            acquire_lock(ro / "run")
        r = _cli(["data_tools.runio", "lock", str(ro / "run"), "--pid", str(os.getpid())], tmp_path)
        assert r.returncode == 2 and r.stderr.startswith("opd: error: ") and "Traceback" not in r.stderr
        r = _cli(["stages.curate", "--train_data", "synth:train:4", "--output_dir", str(ro / "run")], tmp_path)
        assert r.returncode == 2 and "not writable" in r.stderr and "Traceback" not in r.stderr


def test_evaluation_checks_writability_before_generating(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        t0 = time.time()
        r = _cli(["stages.evaluate", "--protocol", "synth_heldout", "--limit", "2", "--output_dir", str(ro / "run")],
                 tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert "not writable" in r.stderr.strip().splitlines()[-1]
        assert "vllm" not in r.stdout.lower() and time.time() - t0 < 90  # stopped before any engine


def test_full_disk_says_disk_full(tmp_path):
    from data_tools.runio import RunDirError, check_writable, describe_os_error

    with tmpfs(tmp_path / "small", "64k") as d:
        fill(d)
        with pytest.raises(RunDirError, match="^disk full"):
            check_writable(d / "run")
        # torch's zip writer reports a full disk as "unexpected pos": recognised from the free space
        assert describe_os_error(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 128"),
                                 d).startswith("disk full")


# ---- metrics and report after a crash; file modes ---------------------------------------------------

def test_metrics_deduplicated_on_resume(tmp_path):
    from transformers import TrainerState

    from trainers.callbacks import MetricsJsonlCallback

    path = tmp_path / "train.jsonl"
    # steps 1..10 logged, then killed during the save of step 10: resumed from the state of step 8
    path.write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in [*range(1, 11), 9]) + '{"step": 1')
    cb = MetricsJsonlCallback(path, start_time=time.time())
    state = TrainerState()
    state.global_step = 8
    cb.on_train_begin(None, state, None)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == list(range(1, 9))
    state.global_step = 9
    cb.on_log(None, state, None, logs={"loss": 0.5})
    cb.on_log(None, state, None, logs={"loss": 0.5})  # the same step logged twice: one row
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == list(range(1, 10))


def test_report_spans_processes_and_counts_steps_once(tmp_path, monkeypatch):
    from stages.report import main

    monkeypatch.delenv("CKPT_DIR", raising=False)
    t1, t2 = 1_000_000.0, 1_000_500.0  # two processes: 120 s, then (resumed) 90 s
    rows = [{"step": s, "wall_s": 20.0 * s, "time": t1 + 20.0 * s, "time/step": 20.0, "loss": 1.0} for s in range(1, 7)]
    rows += [{"step": s, "wall_s": 30.0 * (s - 6), "time": t2 + 30.0 * (s - 6), "time/step": 30.0, "loss": 0.5}
             for s in (7, 8, 9)]
    rows.insert(6, {"step": 6, "wall_s": 121.0, "time": t1 + 121.0, "time/step": 21.0, "loss": 1.0})  # logged twice
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--run", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["steps"] == 9 and report["train_wall_s"] == 121.0 + 90.0


def test_exports_are_world_readable(tmp_path):
    from transformers import AutoTokenizer

    from tests.test_trainer import tiny_model
    from trainers.callbacks import export_checkpoint

    tok = AutoTokenizer.from_pretrained(__import__("data_tools.models", fromlist=["x"]).resolve_model(None))
    old = os.umask(0o022)
    try:
        dest = export_checkpoint(tiny_model(tok), tok, tmp_path / "ckpt", 3)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dest.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}
    assert stat.S_IMODE(dest.stat().st_mode) == 0o755


# ---- signals to the generation stages ---------------------------------------------------------------

@pytest.mark.parametrize("sig, ignored", [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)])
def test_exit_on_sigterm_unwinds_without_traceback(tmp_path, sig, ignored):
    """SIGINT (even when started with it ignored, as a script's background job is) and SIGTERM run finally blocks."""
    mark = tmp_path / "finally-ran"
    code = (f"import time\nfrom data_tools.generation.processes import exit_on_sigterm\nexit_on_sigterm()\n"
            f"try:\n    print('ready', flush=True)\n    time.sleep(60)\nfinally:\n    open({str(mark)!r}, 'w').close()\n")
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=pre)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig and mark.exists() and "Traceback" not in err


def test_a_second_signal_while_stopping_is_ignored(tmp_path):
    """Ctrl-C twice: the second one lands in the finally block (the engine's shutdown) and must not interrupt it."""
    mark = tmp_path / "shutdown-finished"
    code = (f"import time\nfrom data_tools.generation.processes import exit_on_sigterm\nexit_on_sigterm()\n"
            f"try:\n    print('ready', flush=True)\n    time.sleep(60)\nfinally:\n    print('stopping', flush=True)\n"
            f"    time.sleep(1.5)\n    open({str(mark)!r}, 'w').close()\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    assert p.stdout.readline().strip() == "stopping"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130 and mark.exists() and "Traceback" not in err
    assert "SIGINT again: already stopping" in err


def test_heartbeat_prints_during_silence(capsys):
    from data_tools.progress import heartbeat

    with heartbeat("vllm start-up", every=0.1):
        time.sleep(0.35)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and lines[0] == "[vllm start-up] still running: 0s"


def test_a_contract_teacher_is_honoured_or_refused(tmp_path, capsys):
    """TEACHER_MODEL set over a recipe whose teacher is the privileged student (the demos): the teacher is that model,
    said once; with --teacher_context privileged on the command line as well, an error, never a TEACHER_MODEL unused."""
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    env = {"TEACHER_MODEL": "/models/teacher", "OUTPUT_DIR": str(tmp_path / "out")}
    (cfg,) = parse_config([CurateConfig], ["--config", "configs/curate_demo_cpu.yaml"], env=env)
    assert (cfg.teacher_context, cfg.teacher_model) == ("teacher", "/models/teacher")
    assert "TEACHER_MODEL is set: the teacher is /models/teacher (teacher_context teacher)" in capsys.readouterr().err
    (plain,) = parse_config([CurateConfig], ["--config", "configs/curate_demo_cpu.yaml"], env={"OUTPUT_DIR": env["OUTPUT_DIR"]})
    assert plain.teacher_context == "privileged"  # no contract teacher: the recipe's own
    with pytest.raises(ValueError, match="TEACHER_MODEL=/models/teacher is set, but --teacher_context privileged"):
        parse_config([CurateConfig], ["--config", "configs/curate_demo_cpu.yaml", "--teacher_context", "privileged"],
                     env=env)


def test_a_teacher_with_another_tokenizer_is_refused_before_stage_one(tmp_path):
    """run.sh's config check (``stages.train --check_config``, before stage one) loads both tokenizers: a teacher the
    trainer would refuse after stage one's hours is refused in seconds, naming both models; a same-tokenizer teacher
    passes."""
    from transformers import AutoTokenizer

    from data_tools.models import check_teacher_tokenizer, resolve_model

    student = Path(resolve_model("smollm2-135m"))
    for name, extra in (("same", []), ("other", ["<extra_tool_token>"])):
        d = tmp_path / name
        d.mkdir()
        for f in student.iterdir():
            if not f.name.startswith("tokenizer") and f.name != "special_tokens_map.json":
                (d / f.name).symlink_to(f)
        tok = AutoTokenizer.from_pretrained(student)
        tok.add_tokens(extra)
        tok.save_pretrained(d)
    check_teacher_tokenizer(None, tmp_path / "same")  # the embedded student and a same-tokenizer teacher: fine
    r = _cli(["stages.train", "--config", str(REPO / "configs" / "demo_cpu.yaml"), "--check_config",
              "--teacher_model", str(tmp_path / "other"), "--teacher_context", "teacher"], tmp_path,
             OUTPUT_DIR=str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"opd train: configuration error: teacher {tmp_path / 'other'} cannot teach student "
                           f"{student}: student and teacher tokenizers differ"), line
    assert "only in teacher: ['<extra_tool_token>']" in line


def test_a_clock_too_short_for_the_evaluation_reserve_names_the_way_out():
    from data_tools.clock import split

    with pytest.raises(ValueError, match=r"leaves nothing after the reserve 60s and the evaluation reserve 240s; set "
                                         r"MAX_WALL_TIME_SECONDS above 300, or keep no evaluation time with "
                                         r"EVAL_PROTOCOLS= \(empty: no evaluation\)"):
        split(300, 60, 240, 0.3)
    with pytest.raises(ValueError, match="set MAX_WALL_TIME_SECONDS above 60 or lower DEADLINE_RESERVE_SECONDS"):
        split(60, 60, 0, 0.3)


@pytest.mark.skipif(sys.version_info[:2] >= (3, 12), reason="the refusal is for an interpreter older than the lock's")
def test_setup_gpu_on_another_python_says_what_to_do(tmp_path):
    """requirements/gpu.lock is resolved for Python 3.12: on 3.11 `make setup-gpu` stops with one line naming the
    way out before pip tries (and fails on contourpy 1.4.0, which needs 3.12)."""
    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    r = subprocess.run(["make", "-s", "setup-gpu", f"VENV={tmp_path / 'v'}"], cwd=repo, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "requirements/gpu.lock is resolved for Python 3.12" in r.stderr and "make gpu-lock GPU_PY=3.11" in r.stderr
