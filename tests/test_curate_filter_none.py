"""Stage one under ``filter: none``: the teacher alone samples (the whole budget), every usable problem is a curriculum
row in the seeded visiting order, with the shortest verified teacher solution where there is one; under a clock, on
resume, with a separate teacher, against a changed filter; and stage two trains on such a curriculum.

The engine is a stand-in (``_Teacher``) whose samples are a plain function of the prompt, so the expected curriculum
is computed here from that function, not from stage one's code.
"""

from __future__ import annotations

import json
import random
import re
import time
import zlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.test_run_contract import _FakeClock, _fake_time
from tests.test_train_stage import TINY_FLAGS, _env
from tests.test_shards import digits  # noqa: F401 - pytest fixture
from tests.test_trainer import tiny_model_dir, tokenizer  # noqa: F401 - pytest fixtures

REPO = Path(__file__).resolve().parents[1]
WRONG = "-987654321"


def _says(prompt: str, j: int, only: str | None = None) -> tuple[str, int, bool]:
    """Sample ``j`` of the stand-in for ``prompt`` ("What is a + b?"): ``(completion, n_tokens, correct)``. A third
    of the problems (by a hash of the prompt) are never solved, the others in 2 of 4 samples; lengths differ by
    sample, so the shortest verified one is unique. ``only``: the one problem solved (its sample 1)."""
    a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", prompt).groups())
    h = zlib.crc32(prompt.encode())
    ok = h % 3 != 0 and ((h >> 2) + j) % 2 == 0 if only is None else (only in prompt and j == 1)
    return f"try {j}: \\boxed{{{a + b if ok else WRONG}}}", 10 + 3 * ((h + j) % 4), ok


def _engine(fake: _FakeClock | None, calls: list, opened: list, per_prompt_s: float = 5.0, only: str | None = None):
    """A stand-in engine (``make_engine``'s): answers by ``_says`` (``only``: its argument); with a fake clock each
    problem takes ``per_prompt_s`` (5 s to start), and a call stops at its ``stop_at``."""
    from transformers import AutoTokenizer

    from data_tools.generation.engines import Sample
    from data_tools.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))

    class Engine:
        name, dtype, interruptible, startup_s = "fake", "float32", True, 5.0

        def __init__(self, model):
            self.model, self.tokenizer = model, tok
            opened.append(model)
            if fake:
                fake.now += self.startup_s

        def close(self):
            pass

        def generate(self, prompts, *, n, max_tokens, temperature, top_p, chunk_size, desc, seeds=None, stop_at=None):
            calls.append(desc)
            out = []
            for i, p in enumerate(prompts):
                if fake:
                    if stop_at is not None and fake.now + per_prompt_s > stop_at:
                        fake.now = stop_at
                        break
                    fake.now += per_prompt_s
                for j in range(n):
                    text, n_tokens, _ = _says(p, j, only)
                    out.append(Sample(i, j, text, n_tokens, 20, "stop"))
            yield out

    return lambda kind, model, **kw: Engine(model)


def _data(tmp_path: Path, n: int) -> Path:
    """``n`` problems "What is a + b?" and one row without an answer (rejected at load)."""
    rows = [{"id": f"q{i}", "problem": f"What is {i} + {2 * i + 3}?", "answer": str(3 * i + 3)} for i in range(n)]
    rows.insert(3, {"id": "bad", "problem": "What is 1 + 1?", "answer": ""})
    f = tmp_path / "problems.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _argv(data: Path, out: Path, *extra) -> list[str]:
    return ["--config", str(REPO / "configs" / "curate_demo_cpu.yaml"), "--train_data", str(data),
            "--output_dir", str(out), "--filter", "none", "--chunk_size", "2", *map(str, extra)]


def _run(monkeypatch, argv: list[str], engine) -> dict:
    import stages.curate as C
    import stages.curate_sampling
    from data_tools.config import parse_config

    monkeypatch.setattr(stages.curate_sampling, "make_engine", engine)
    (cfg,) = parse_config([C.CurateConfig], argv, env={})
    return C.curate(cfg)


def _visit(out: Path, seed: int = 0) -> list[str]:
    """The seeded visiting order of the usable problems (problems.parquet: the load's order), shuffled as documented."""
    ids = pq.read_table(out / "curate" / "problems.parquet").column("problem_id").to_pylist()
    random.Random(seed).shuffle(ids)
    return ids


def _expected(rollouts: list[dict]) -> dict[str, tuple[str | None, float]]:
    """problem_id -> (shortest verified teacher completion or None, teacher pass rate), from ``_says`` on each measured
    problem's prompt (not from stage one's verdicts)."""
    prompt = {r["problem_id"]: r["prompt"] for r in rollouts}
    out = {}
    for pid, p in prompt.items():
        said = [_says(p, j) for j in range(4)]
        ok = [(n, text) for text, n, good in said if good]
        out[pid] = (min(ok)[1] if ok else None, len(ok) / 4)
    return out


def _tables(out: Path) -> dict:
    cur = out / "curate"
    return {"curriculum": pq.read_table(cur / "curriculum.parquet").to_pylist(),
            "rollouts": pq.read_table(cur / "rollouts.parquet").drop_columns(["started_at", "finished_at"]).to_pylist()}


def test_filter_none_samples_only_the_teacher_and_keeps_every_usable_problem(tmp_path, monkeypatch, capsys):
    calls, opened = [], []
    out = tmp_path / "run"
    m = _run(monkeypatch, _argv(_data(tmp_path, 12), out), _engine(None, calls, opened))
    assert calls and all(c.startswith("teacher chunk ") for c in calls), calls
    assert sorted(p.name for p in (out / "curate" / "parts").iterdir()) == [f"teacher-{i:05d}.parquet" for i in range(6)]
    roll = pq.read_table(out / "curate" / "rollouts.parquet").to_pylist()
    assert {r["role"] for r in roll} == {"teacher"} and len(roll) == 12 * 4
    cur = pq.read_table(out / "curate" / "curriculum.parquet").to_pylist()
    # every usable problem (12 of 13 rows: the one without an answer stays a load reject), in the seeded visiting order
    assert [r["problem_id"] for r in cur] == _visit(out) and len(cur) == 12
    assert [r["curriculum_index"] for r in cur] == list(range(12))
    assert {r["bucket"] for r in cur} == {0} and all(r["pass_rate"] is None for r in cur)
    want = _expected(roll)
    assert {r["problem_id"]: (r["teacher_solution"], r["teacher_pass_rate"]) for r in cur} == want
    n_sol = sum(s is not None for s, _ in want.values())
    assert 0 < n_sol < 12  # the reference is worth comparing: some solved, some not
    # the privileged teacher's context is the row's answer line, solution or not (as under the band filter)
    assert all(r["reference"] == f"The correct answer is {r['answer']}." for r in cur)
    rejects = pq.read_table(out / "curate" / "rejects.parquet").to_pylist()
    assert [(r["problem_id"], r["stage"]) for r in rejects] == [("bad", "load")]  # no filter rejects
    c = m["counts"]
    assert (c["problems"], c["curriculum"], c["teacher_solutions"], c["filter_rejects"]) == (12, 12, n_sol, 0)
    assert c["student_accuracy"] is None and c["teacher_accuracy"] == round(sum(r["correct"] for r in roll) / 48, 4)
    assert m["budget"]["student_chunks"] == 0 and m["budget"]["teacher_chunks"] == m["budget"]["chunks_measured"] == 6
    assert m["budget"]["mean_completion_tokens_of"] == "teacher"
    assert m["config"]["filter"] == "none"
    text = capsys.readouterr().out
    assert f"12 problems -> 12 in curriculum (filter none), {n_sol} with a verified teacher solution, 1 rejects" in text
    assert "student acc" not in text


def test_the_band_filter_stays_the_default():
    from stages.curate import CurateConfig

    cfg = CurateConfig(output_dir="/tmp/opd-test-filter-unused")
    assert cfg.filter == "pass_rate" and cfg.roles == ("teacher", "student")
    assert CurateConfig(output_dir="/tmp/opd-test-filter-unused", filter="none").roles == ("teacher",)


def test_a_clock_that_ends_mid_way_measures_teacher_chunks_and_keeps_every_row_then_resumes(tmp_path, monkeypatch,
                                                                                             capsys):
    fake = _FakeClock(time.time())
    calls, opened = [], []
    _fake_time(monkeypatch, fake)
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    data, out = _data(tmp_path, 20), tmp_path / "run"
    engine = _engine(fake, calls, opened)
    # clock 200 s, share 0.3: stage one until 60 s; engine up at 5 s; 5 s a problem, the teacher's alone (no student
    # call shares the time). Chunk 1: a probe of one problem (10 s), the other (15 s); chunks 2-5 whole (55 s); chunk 6:
    # the one problem 5 s hold (60 s), then the budget is spent
    argv = _argv(data, out)
    m = _run(monkeypatch, argv + ["--max_wall_time_seconds", "200", "--time_share", "0.3"], engine)
    assert calls == ["teacher chunk 1/10 (problems 1-1 of 2)", "teacher chunk 1/10 (problems 2-2 of 2)"] + [
        f"teacher chunk {i}/10" for i in range(2, 6)] + ["teacher chunk 6/10 (problems 1-1 of 2)"]
    b = m["budget"]
    assert (b["chunks_measured"], b["chunks_partial"], b["problems_measured"], b["problems_unmeasured"]) == (5, 1, 11, 9)
    assert b["ended_at_s"] == 60.0 and b["stop_reason"] == "budget: spent before the next teacher call"
    parts = out / "curate" / "parts"
    assert sorted(p.name for p in parts.iterdir()) == [f"teacher-{i:05d}.parquet" for i in range(5)] + [
        "teacher-00005.partial.parquet"]
    roll = pq.read_table(out / "curate" / "rollouts.parquet").to_pylist()
    cur = pq.read_table(out / "curate" / "curriculum.parquet").to_pylist()
    visit = _visit(out)
    assert [r["problem_id"] for r in cur] == visit and [r["curriculum_index"] for r in cur] == list(range(20))
    want = _expected(roll)
    assert set(want) == set(visit[:11])  # the first 11 of the visiting order measured
    assert {r["problem_id"]: (r["teacher_solution"], r["teacher_pass_rate"]) for r in cur} == {
        pid: want.get(pid, (None, None)) for pid in visit}
    assert m["counts"]["teacher_solutions"] == sum(s is not None for s, _ in want.values()) > 0
    assert "9 not measured (stage one's time ended first)" in capsys.readouterr().out

    # run again on the same, spent clock: the chunks on disk are done (teacher parts alone), so no engine starts
    n_opened = len(opened)
    m = _run(monkeypatch, argv + ["--max_wall_time_seconds", "200", "--time_share", "0.3"], engine)
    assert len(opened) == n_opened and len(calls) == 7 and m["counts"]["curriculum"] == 20
    assert m["budget"]["stop_reason"] == "budget spent before stage one began; the chunks measured earlier are used"
    # resume under a clock with room: the 5 whole chunks kept, the partial one measured again (a probe first), then the rest
    kept = {p.name: p.stat().st_mtime_ns for p in parts.glob("teacher-0000[0-4].parquet")}
    calls.clear()
    fake.now = time.time()
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    m = _run(monkeypatch, argv + ["--max_wall_time_seconds", "1000", "--time_share", "0.5"], engine)
    text = capsys.readouterr().out
    assert f"[curate] resuming: 5/10 teacher chunks already in {parts}; measuring the rest" in text
    assert calls == ["teacher chunk 6/10 (problems 1-1 of 2)", "teacher chunk 6/10 (problems 2-2 of 2)"] + [
        f"teacher chunk {i}/10" for i in range(7, 11)]
    assert {p.name: p.stat().st_mtime_ns for p in parts.glob("teacher-0000[0-4].parquet")} == kept
    assert m["budget"]["chunks_measured"] == 10 and not list(parts.glob("*.partial.parquet"))
    # ... and writes what one uninterrupted run writes
    _run(monkeypatch, _argv(data, tmp_path / "whole"), _engine(None, [], []))
    assert _tables(out) == _tables(tmp_path / "whole")


def test_two_shards_write_the_curriculum_of_one(tmp_path, monkeypatch, capsys):
    """Shards (``--shard i/N``, as ``--workers`` and nodes run them) measure their chunks of the visiting order, teacher
    alone, and the merge of their chunks is one process's curriculum."""
    import stages.curate as C
    import stages.curate_sampling
    from data_tools.config import parse_config

    data = _data(tmp_path, 10)
    _run(monkeypatch, _argv(data, tmp_path / "one"), _engine(None, [], []))
    calls: list[str] = []
    monkeypatch.setattr(stages.curate_sampling, "make_engine", _engine(None, calls, []))
    (cfg,) = parse_config([C.CurateConfig], _argv(data, tmp_path / "two"), env={})
    prep = C.prepare(cfg)  # the parent's part: state.json, problems, parts/
    t0 = time.time()
    recs = [C.run_shard(cfg, g, 2) for g in (0, 1)]
    text = capsys.readouterr().out
    assert "[curate] shard 0/2 done: 3/3 of its chunks measured" in text  # chunks 1, 3, 5 of 5
    assert "[curate] shard 1/2 done: 2/2 of its chunks measured" in text
    assert calls == [f"teacher chunk {i}/5" for i in (1, 3, 5, 2, 4)]
    m = C.merge(cfg, prep, recs, t_start=t0, clock=C.stage_clock(cfg, t0, announce=False), run_id="test")
    assert [s["chunks_measured"] for s in m["workers"]["per_shard"]] == [3, 2]
    assert _tables(tmp_path / "two") == _tables(tmp_path / "one")


def test_a_separate_teacher_gets_the_whole_budget(tmp_path, monkeypatch):
    """Two engines: under the band filter the teacher gets its samples' share of the budget, then the student's engine
    starts; under none no student engine starts and the teacher measures until the budget's end."""
    from data_tools.models import resolve_model

    fake = _FakeClock(time.time())
    calls, opened = [], []
    _fake_time(monkeypatch, fake)
    monkeypatch.setenv("OPD_RUN_START", str(fake.now))
    teacher = tmp_path / "teacher"  # another directory holding the same model's files: a second engine
    teacher.mkdir()
    for f in Path(resolve_model("smollm2-135m")).iterdir():
        (teacher / f.name).symlink_to(f)
    # budget until 100 s; teacher engine up at 5 s; a probe of one problem (10 s), the other (15 s), chunks 2-9 (95 s),
    # one problem of chunk 10 (100 s). The band filter's teacher would stop at 35 s ((100 - 5 - 5) x 4/12 from 5 s).
    m = _run(monkeypatch, _argv(_data(tmp_path, 30), tmp_path / "run", "--teacher_context", "teacher", "--teacher_model",
                                teacher, "--max_wall_time_seconds", 200, "--time_share", 0.5), _engine(fake, calls, opened))
    assert opened == [str(teacher)]  # the student's engine never started
    assert calls == ["teacher chunk 1/15 (problems 1-1 of 2)", "teacher chunk 1/15 (problems 2-2 of 2)"] + [
        f"teacher chunk {i}/15" for i in range(2, 10)] + ["teacher chunk 10/15 (problems 1-1 of 2)"]
    b = m["budget"]
    assert (b["ended_at_s"], b["chunks_measured"], b["problems_measured"]) == (100.0, 9, 19)
    cur = pq.read_table(tmp_path / "run" / "curate" / "curriculum.parquet").to_pylist()
    assert len(cur) == 30
    # a separate teacher's context in stage two: its verified solution where it has one, else the answer line
    for r in cur:
        assert r["reference"] == (r["teacher_solution"] or f"The correct answer is {r['answer']}.")
    assert any(r["teacher_solution"] for r in cur) and not all(r["teacher_solution"] for r in cur)


def test_calls_are_forced_past_a_spent_budget_until_a_verified_solution_exists(tmp_path, monkeypatch, capsys):
    """Set-up took the whole budget: probes run past it until one verified teacher solution exists (what the SFT phase
    needs; every problem is a row already), then stop: here the third problem visited is the first one solved."""
    from data_tools.problems import load_problems

    fake = _FakeClock(time.time())
    calls, opened = [], []
    _fake_time(monkeypatch, fake)
    monkeypatch.setenv("OPD_RUN_START", str(fake.now - 60.0))  # the budget (60 s) is spent at the start
    data, out = _data(tmp_path, 12), tmp_path / "run"
    visit = list(load_problems(data, seed=0).rows)
    random.Random(0).shuffle(visit)
    m = _run(monkeypatch, _argv(data, out, "--chunk_size", 1, "--max_wall_time_seconds", 200, "--time_share", 0.3),
             _engine(fake, calls, opened, only=visit[2]["problem"]))
    assert [r["problem_id"] for r in visit] == _visit(out)
    # engine up at 65 s, a probe of one problem every 5 s, until 80 s: the third solved the first; none past it
    assert calls == ["teacher chunk 1/12", "teacher chunk 2/12", "teacher chunk 3/12"]
    assert m["budget"]["ended_at_s"] == 80.0 and m["budget"]["stop_reason"] == "budget: spent before the next teacher call"
    cur = pq.read_table(out / "curate" / "curriculum.parquet").to_pylist()
    assert [r["problem_id"] for r in cur if r["teacher_solution"]] == [visit[2]["problem_id"]] and len(cur) == 12
    assert m["counts"]["teacher_solutions"] == 1
    assert "until a verified teacher solution exists, probes run past it, never past 100s" in capsys.readouterr().out


def test_a_teacher_that_verifies_nothing_is_said_at_the_end(tmp_path, monkeypatch, capsys):
    """Under filter none every problem is a row whatever the teacher solved: a stage one with no verified solution
    says so in one line naming the curriculum (stage two's SFT phase has nothing), under the band filter nothing
    extra (it has no row then)."""
    monkeypatch.delenv("OPD_REHEARSAL_VERIFIED", raising=False)
    calls, opened = [], []
    data, out = _data(tmp_path, 6), tmp_path / "run"
    m = _run(monkeypatch, _argv(data, out), _engine(None, calls, opened, only="no problem says this"))
    said = capsys.readouterr().out
    assert m["counts"]["teacher_solutions"] == 0 and m["counts"]["curriculum"] == 6
    assert (f"[curate] WARNING: no verified teacher solution in {out / 'curate' / 'curriculum.parquet'} (filter none; "
            "the teacher verified none of its 6 problems measured)") in said
    _run(monkeypatch, _argv(data, tmp_path / "solved"), _engine(None, calls, opened))  # some solved: no warning
    assert "WARNING: no verified teacher solution" not in capsys.readouterr().out


def test_a_band_that_keeps_nothing_falls_back_to_every_problem(tmp_path, monkeypatch, capsys):
    """The band filter over problems nobody solves keeps none: the curriculum is then every usable problem (as filter
    none builds it, said in one line and in the manifest), never an empty table that ends the run with no export; a
    band that keeps rows is unchanged."""
    monkeypatch.delenv("OPD_REHEARSAL_VERIFIED", raising=False)
    calls, opened = [], []
    data, out = _data(tmp_path, 6), tmp_path / "run"
    m = _run(monkeypatch, [*_argv(data, out), "--filter", "pass_rate"],
             _engine(None, calls, opened, only="no problem says this"))
    said = capsys.readouterr().out
    assert m["config"]["filter"] == "pass_rate" and {"teacher", "student"} <= {c.split()[0] for c in calls}
    assert m["counts"]["filter_fallback"] is True and m["counts"]["filter_rejects"] == 0
    assert m["counts"]["curriculum"] == 6 and m["counts"]["teacher_solutions"] == 0
    cur = pq.read_table(out / "curate" / "curriculum.parquet").to_pylist()
    assert [r["problem_id"] for r in cur] == _visit(out) and {r["pass_rate"] for r in cur} == {None}
    assert ("[curate] WARNING: the pass-rate filter kept none of the 6 problems measured: "
            f"{out / 'curate' / 'curriculum.parquet'} is every usable problem instead (6, unfiltered") in said
    assert "(filter pass_rate; it kept none: every problem instead)" in said
    m2 = _run(monkeypatch, [*_argv(data, tmp_path / "solved"), "--filter", "pass_rate"], _engine(None, calls, opened))
    assert m2["counts"]["filter_fallback"] is False and 0 < m2["counts"]["curriculum"] < 6
    assert "kept none" not in capsys.readouterr().out


def test_a_resume_over_other_problems_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Chunk i is the i-th slice of the visiting order of the problems read: the same data path read into other
    problems (a row added) would map the chunks on disk to other problems, so that resume is refused, naming it, and
    the state stays; the same problems resume."""
    monkeypatch.delenv("OPD_REHEARSAL_VERIFIED", raising=False)
    calls, opened = [], []
    data, out = _data(tmp_path, 6), tmp_path / "run"
    _run(monkeypatch, _argv(data, out), _engine(None, calls, opened))
    state = json.loads((out / "curate" / "state.json").read_text())
    assert len(state["problems_sha"]) == 16
    _run(monkeypatch, _argv(data, out), _engine(None, calls, opened))  # the same problems: resumes
    data.write_text(data.read_text() + json.dumps({"id": "q99", "problem": "What is 99 + 1?", "answer": "100"}) + "\n")
    with pytest.raises(ValueError, match=r"holds chunks of other problems: .*problems.jsonl now reads 7 usable problems "
                                         r"whose ids differ"):
        _run(monkeypatch, _argv(data, out), _engine(None, calls, opened))
    assert json.loads((out / "curate" / "state.json").read_text()) == state


def test_student_samples_may_be_0_under_filter_none_only():
    from stages.curate import CurateConfig

    assert CurateConfig(output_dir="/tmp/opd-test-filter-unused", filter="none", student_samples=0).roles == ("teacher",)
    with pytest.raises(ValueError, match=r"^student_samples must be >= 1, got 0$"):
        CurateConfig(output_dir="/tmp/opd-test-filter-unused", student_samples=0)


def test_a_bad_filter_is_one_clear_error():
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    with pytest.raises(ValueError, match=r"^filter must be one of \['pass_rate', 'none'\], got 'pass-rate'$"):
        CurateConfig(output_dir="/tmp/opd-test-filter-unused", filter="pass-rate")
    with pytest.raises(ValueError, match=r"filter must be one of \['pass_rate', 'none'\], got 'band'"):
        parse_config([CurateConfig], ["--filter", "band", "--output_dir", "/tmp/opd-test-filter-unused"], env={})


def test_a_yaml_filter_off_names_the_boolean_yaml_made_of_it(tmp_path):
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    cfg = tmp_path / "c.yaml"
    cfg.write_text("filter: off\noutput_dir: /tmp/opd-test-filter-unused\n")
    with pytest.raises(ValueError, match=r"got 'False' \(YAML read a bare off / no / false as a boolean: write none\)$"):
        parse_config([CurateConfig], ["--config", str(cfg)], env={})
    for value in ("None", "NONE"):  # (a YAML null is refused by the config reader: a key that needs a value)
        cfg.write_text(f"filter: {value}\noutput_dir: /tmp/opd-test-filter-unused\n")
        with pytest.raises(ValueError, match=r"\(filter names are lowercase: write none\)$"):
            parse_config([CurateConfig], ["--config", str(cfg)], env={})


def test_a_changed_filter_is_another_curation(tmp_path, monkeypatch):
    from stages.curate import CurateConfig, _fingerprint

    monkeypatch.delenv("OPD_REHEARSAL_VERIFIED", raising=False)
    models = {"student": {"path": "/m/s", "config_sha256": "ab", "weights": {"model.safetensors": 1}},
              "teacher": {"path": "/m/t", "config_sha256": "cd", "weights": {"model.safetensors": 2}}}
    fp = lambda **kw: _fingerprint(CurateConfig(output_dir="/tmp/opd-test-filter-unused", **kw), models)  # noqa: E731
    # the band filter's fingerprint is the one it had before the filter setting existed: its runs still resume
    assert fp() == "e54062fe17f37327" and fp(grader_profile="formal", student_samples=3) == "270d1406b03d3ffd"
    assert fp(filter="none") != fp()
    assert fp(filter="none", student_samples=3) == fp(filter="none")  # no student samples: not part of it
    assert fp(student_samples=3) != fp()

    data, out = _data(tmp_path, 4), tmp_path / "run"
    band = [a for a in _argv(data, out) if a not in ("--filter", "none")]
    _run(monkeypatch, band, _engine(None, [], []))
    before = sorted(p.name for p in (out / "curate" / "parts").iterdir())
    assert "student-00000.parquet" in before
    with pytest.raises(ValueError, match="holds chunks of a different curation"):
        _run(monkeypatch, _argv(data, out), _engine(None, [], []))
    assert sorted(p.name for p in (out / "curate" / "parts").iterdir()) == before  # nothing written


def test_stage_two_trains_on_an_unfiltered_curriculum(tmp_path, tiny_model_dir, tokenizer, monkeypatch):  # noqa: F811
    """The formal recipe's trainer on a ``filter: none`` curriculum of the tiny model (null pass rates, rows without a
    solution): an SFT pass over the rows with a verified solution, then on-policy steps over the rows."""
    from stages.train import main
    from trainers.data import build_train_dataset, load_curriculum

    run = tmp_path / "run"
    _run(monkeypatch, _argv(_data(tmp_path, 8), run, "--student_model", tiny_model_dir, "--prompt_style", "short"),
         _engine(None, [], []))
    cur_path = run / "curate" / "curriculum.parquet"
    cur = pq.read_table(cur_path).to_pylist()
    n_sol = sum(r["teacher_solution"] is not None for r in cur)
    assert len(cur) == 8 and 0 < n_sol < 8 and all(r["pass_rate"] is None for r in cur)
    ds = build_train_dataset(load_curriculum(cur_path), tokenizer)
    assert ds["problem_id"] == [r["problem_id"] for r in cur] and set(ds["bucket"]) == {0}
    assert sum(bool(s) for s in ds["teacher_solution"]) == n_sol

    env = _env(tmp_path / "t", tiny_model_dir, cur_path)  # copies it where stage one leaves it, under its OUTPUT_DIR
    for k in ("OUTPUT_DIR", "STUDENT_MODEL", "TRAIN_DATA"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.delenv("TEACHER_MODEL", raising=False)
    rc = main(["--config", str(REPO / "configs" / "opd_r1_distill_1p5b.yaml"), *TINY_FLAGS, "--sft_batch_size", "4",
               "--sft_max_epochs", "1", "--use_vllm", "false", "--bf16", "false", "--teacher_dtype", "float32",
               "--export_dtype", "float32", "--decode_compile", "false", "--gradient_checkpointing", "false",
               "--debug_max_steps", "3", "--max_wall_time_seconds", "100000", "--lr_warmup_time", "0"])
    assert rc == 0
    out = Path(env["OUTPUT_DIR"])
    recs = [json.loads(x) for x in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["sft/off_policy_step"] for r in recs] == [1.0, 0.0, 0.0]  # one pass over <= 4 solutions, then on-policy
    trained = {r["problem_id"] for f in (out / "rollouts").glob("*.parquet") for r in pq.read_table(f).to_pylist()}
    assert trained and trained <= {r["problem_id"] for r in cur}


def test_the_formal_stage_one_is_the_filtered_one_with_filter_none():
    """configs/curate_r1_distill_1p5b.yaml (the formal stage one) differs from
    configs/curate_r1_distill_1p5b_filtered.yaml by its filter alone (and the settings only the filter reads), and by
    the seconds the student's samples took there."""
    from dataclasses import asdict

    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    env = {"STUDENT_MODEL": "/models/student", "TEACHER_MODEL": "/models/teacher", "TRAIN_DATA": "/data/train.parquet",
           "OUTPUT_DIR": "/tmp/opd-test-filter-unused"}
    configs = REPO / "configs"
    (filtered,) = parse_config([CurateConfig], ["--config", str(configs / "curate_r1_distill_1p5b_filtered.yaml")], env=env)
    (unfiltered,) = parse_config([CurateConfig], ["--config", str(configs / "curate_r1_distill_1p5b.yaml")], env=env)
    assert (filtered.filter, unfiltered.filter) == ("pass_rate", "none")
    only_filter = {"filter", "student_samples", "band_low", "band_high", "zero_pass_share", "n_buckets", "order",
                   "time_share"}
    # the student's samples' share of stage one's seconds goes to training: the teacher's 4 of 12 samples a problem
    share = filtered.time_share * filtered.teacher_samples / (filtered.teacher_samples + filtered.student_samples)
    assert unfiltered.time_share == pytest.approx(round(share, 2)) == 0.07
    assert {k: v for k, v in asdict(unfiltered).items() if k not in only_filter} == {
        k: v for k, v in asdict(filtered).items() if k not in only_filter}


@pytest.mark.slow
def test_two_workers_under_filter_none_write_the_curriculum_of_one_and_a_killed_one_resumes(digits):
    """Real worker processes (``--workers 2``, the hf engine on test_shards' tiny digit model): the teacher alone
    samples in each, the merge is one worker's curriculum; a worker killed after its first chunk stops the run, and a
    re-run resumes every shard to the same tables."""
    import subprocess
    import sys

    from tests.test_shards import _done, _env as shard_env

    def curate(out: Path, workers: int, env: dict | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "stages.curate", "--train_data", digits["data"], "--student_model", digits["model"],
               "--teacher_context", "privileged", "--privileged_reference", "answer", "--prompt_style", "short",
               "--teacher_samples", "4", "--max_tokens", "5", "--max_model_len", "256", "--chunk_size", "2",
               "--engine", "hf", "--answer_filter", "numeric", "--filter", "none", "--workers", str(workers),
               "--output_dir", str(out)]
        return subprocess.Popen(cmd, cwd=REPO, env=shard_env(**(env or {})), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    root = digits["root"]
    rc, _, err = _done(curate(root / "none-one", 1))
    assert rc == 0, err[-3000:]
    one = _tables(root / "none-one")
    assert {r["role"] for r in one["rollouts"]} == {"teacher"} and len(one["rollouts"]) == 10 * 4
    assert len(one["curriculum"]) == 10 and any(r["teacher_solution"] for r in one["curriculum"])
    out = root / "none-two"
    rc, stdout, err = _done(curate(out, 2, {"OPD_TEST_CURATE_SHARD_EXIT": "1"}))
    assert rc == 1 and "worker 1/2 (CUDA_VISIBLE_DEVICES=1) exited with code 9" in err
    assert "[w1/2] [teacher] chunk 2/5 -> teacher-00001.parquet" in stdout
    rc, stdout, err = _done(curate(out, 2))
    assert rc == 0, err[-3000:]
    assert "[curate] resuming:" in stdout and " teacher chunks already in " in stdout and "student chunks" not in stdout
    assert _tables(out) == one
    m = json.loads((out / "curate" / "manifest.json").read_text())
    assert [s["chunks_measured"] for s in m["workers"]["per_shard"]] == [3, 2]
