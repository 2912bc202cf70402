"""data_tools.rehearsal: the rehearsal's verified share in stage one, and that a real run cannot reach it."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from data_tools import rehearsal
from data_tools.grader import Verdict

ENV = "OPD_REHEARSAL_VERIFIED"


def test_parse_and_fractions():
    s = rehearsal.parse("0.5")
    assert (s.teacher, s.student) == (0.5, 0.25)  # the student gets half the teacher's share
    s = rehearsal.parse(" 0.75 , 0.4 ")
    assert (s.teacher, s.student) == (0.75, 0.4)
    for bad in ("", "x", "0", "1.5", "0.5,-0.1", "0.5,0.2,0.1", "0.5,"):
        with pytest.raises(ValueError, match=ENV):
            rehearsal.parse(bad)
    assert rehearsal.from_env({}) is None and rehearsal.from_env({ENV: "  "}) is None
    assert rehearsal.from_env({ENV: "0.6,0.3"}).student == 0.3


def test_share_is_deterministic_per_sample_and_near_its_fraction():
    s = rehearsal.parse("0.5,0.25")
    keys = [(f"p{i}", role, j) for i in range(2500) for role in ("teacher", "student") for j in range(4)]
    got = [s.counts(*k) for k in keys]
    assert got == [s.counts(*k) for k in keys]  # same keys, same answer (resumed or sharded stage one)
    for role, frac in (("teacher", 0.5), ("student", 0.25)):
        sel = [g for k, g in zip(keys, got) if k[1] == role]
        assert abs(sum(sel) / len(sel) - frac) < 0.015, (role, sum(sel) / len(sel))
    # teacher and student samples of one problem are drawn independently: not the same set at equal fractions
    eq = rehearsal.parse("0.5,0.5")
    t = [eq.counts(f"p{i}", "teacher", 0) for i in range(400)]
    st = [eq.counts(f"p{i}", "student", 0) for i in range(400)]
    assert 0.35 < sum(a == b for a, b in zip(t, st)) / 400 < 0.65
    assert rehearsal.unit_hash("p1", "teacher", 0) == rehearsal.unit_hash("p1", "teacher", 0) != \
        rehearsal.unit_hash("p1", "teacher", 1)


def test_count_verified_keeps_real_verdicts_and_marks_forced_ones(capsys):
    v_wrong, v_right = Verdict(False, "7", "exact"), Verdict(True, "5", "exact")
    keys = [(f"p{i}", "student", 0) for i in range(200)]
    assert rehearsal.count_verified([v_wrong] * 200, keys, env={}) == [v_wrong] * 200  # a real run: unchanged
    out = rehearsal.count_verified([v_wrong] * 199 + [v_right], keys, env={ENV: "1,0.5"})
    share = rehearsal.parse("1,0.5")
    for (pid, role, i), v in zip(keys[:199], out[:199]):
        forced = share.counts(pid, role, i)
        assert v.correct == forced and v.path == ("rehearsal" if forced else "exact") and v.extracted == "7"
    assert out[199] is v_right  # the grader's verdict stands
    assert 60 < sum(v.correct for v in out) < 140
    printed = capsys.readouterr().out
    assert printed.count("[rehearsal]") == 1 and f"{ENV}=1,0.5" in printed
    rehearsal.count_verified([v_wrong], keys[:1], env={ENV: "1,0.5"})
    assert "[rehearsal]" not in capsys.readouterr().out  # once per process and setting
    with pytest.raises(ValueError):
        rehearsal.count_verified([v_wrong, v_wrong], keys[:1], env={ENV: "1"})  # one key per verdict


def test_a_config_file_cannot_set_it(tmp_path):
    from data_tools.config import parse_config
    from stages.curate import CurateConfig

    for key in ("rehearsal_verified", "OPD_REHEARSAL_VERIFIED", "verified_fraction"):
        cfg = tmp_path / f"{key}.yaml"
        cfg.write_text(f"train_data: synth:train:4\n{key}: 0.5\n")
        with pytest.raises(ValueError, match=f"only `run.sh --rehearse` sets it.*{ENV}"):
            parse_config([CurateConfig], ["--config", str(cfg)], env={})
    with pytest.raises(ValueError, match="unknown flag"):  # nor a flag
        parse_config([CurateConfig], ["--rehearsal_verified", "0.5"], env={})


class _Engine:
    """Stage one's engine contract with fixed wrong answers (a random-weight model verifies nothing)."""

    name, dtype, startup_s, model = "fake", "float32", 0.0, "fake"

    def generate(self, prompts, *, n, max_tokens, temperature, top_p, chunk_size, desc, seeds=None, stop_at=None):
        from data_tools.generation.engines import Sample

        yield [Sample(prompt_index=p, sample_index=j, completion="so the answer is \\boxed{-1}", n_tokens=max_tokens,
                      n_prompt_tokens=3, finish_reason="length") for p in range(len(prompts)) for j in range(n)]


def _rows(n):
    return [{"problem_id": f"r{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


@pytest.mark.parametrize("value", [None, "0.5,0.25"])
def test_generate_chunk_counts_the_share(tmp_path, monkeypatch, value):
    from stages.curate import CurateConfig, generate_chunk

    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    cfg = CurateConfig(train_data="synth:train:4", teacher_context="privileged", max_tokens=16, chunk_size=40,
                       output_dir=str(tmp_path / "out"))
    rows = _rows(40)
    for role, n in (("teacher", 4), ("student", 8)):
        generate_chunk(_Engine(), role, 0, rows, ["prompt"] * 40, cfg, tmp_path, n, "fake")
        t = pq.read_table(tmp_path / f"{role}-00000.parquet").to_pylist()
        assert len(t) == 40 * n
        forced = [r for r in t if r["correct"]]
        if value is None:
            assert not forced  # a real run: the wrong answers stay wrong
            continue
        share = rehearsal.parse(value)
        assert {(r["problem_id"], r["sample_index"]) for r in forced} == {
            (r["problem_id"], r["sample_index"]) for r in t if share.counts(r["problem_id"], role, r["sample_index"])}
        assert all(r["grader_path"] == "rehearsal" for r in forced)
        assert abs(len(forced) / len(t) - share.fraction(role)) < 0.1


def test_curate_records_the_share_in_its_manifest_and_fingerprint(tmp_path, monkeypatch):
    """stage one end to end with the fake engine: the manifest names the share, the band filter keeps rows with
    solutions, and chunks of a rehearsal are refused by a run without it."""
    from transformers import AutoTokenizer

    import stages.curate as C
    import stages.curate_sampling as S
    from data_tools.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    eng = _Engine()
    eng.tokenizer, eng.close = tok, lambda: None
    monkeypatch.setattr(S, "make_engine", lambda kind, model, **kw: setattr(eng, "model", model) or eng)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(24)))
    cfg = dict(train_data=str(data), teacher_context="privileged", max_tokens=16, chunk_size=12, teacher_samples=4,
               student_samples=8, output_dir=str(tmp_path / "run"))
    monkeypatch.setenv(ENV, "0.5")
    m = C.curate(C.CurateConfig(**cfg))
    assert m["rehearsal"]["teacher_fraction"] == 0.5 and m["rehearsal"]["student_fraction"] == 0.25
    assert json.loads((tmp_path / "run" / "curate" / "manifest.json").read_text())["rehearsal"] == m["rehearsal"]
    cur = pq.read_table(tmp_path / "run" / "curate" / "curriculum.parquet").to_pylist()
    assert len(cur) >= 12 and all(r["teacher_solution"] for r in cur)  # the SFT phase has solutions
    assert sum(0 < r["pass_rate"] < 1 for r in cur) >= 12
    monkeypatch.delenv(ENV)
    with pytest.raises(ValueError, match="different curation"):
        C.curate(C.CurateConfig(**cfg))
    m2 = C.curate(C.CurateConfig(**{**cfg, "output_dir": str(tmp_path / "real")}))
    # nothing verifies without it: the band keeps none, so the curriculum falls back to every problem, none solved
    assert m2["rehearsal"] is None and m2["counts"]["teacher_solutions"] == 0
    assert m2["counts"]["filter_fallback"] is True and m2["counts"]["curriculum"] == 24


@pytest.mark.parametrize("when", ["start", "mid-chunk"])
def test_stage_one_falls_back_to_the_hf_engine_when_vllm_fails(tmp_path, monkeypatch, caplog, when):
    """An untested vLLM (the formal image's 0.17) failing to start, or failing inside a chunk, does not end stage
    one: one line, the hf engine measures that chunk again and the rest; every chunk is measured once."""
    import logging

    from transformers import AutoTokenizer

    import stages.curate as C
    import stages.curate_sampling as S
    from data_tools.generation import fallback
    from data_tools.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    kinds, calls = [], []

    class Broken(_Engine):
        name = "vllm-cuda"

        def generate(self, prompts, **kw):
            calls.append(self.name)
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore text")

    def make(kind, model, **kw):
        kinds.append(kind)
        if kind != "hf" and when == "start":
            raise ImportError("vllm 0.17: cannot import name 'X'")
        eng = Broken() if kind != "hf" else _Engine()
        if kind == "hf":
            eng.name = "hf-cuda"
            real = eng.generate

            def gen(prompts, **kw):
                calls.append("hf-cuda")
                return real(prompts, **kw)

            eng.generate = gen
        eng.tokenizer, eng.close, eng.model = tok, lambda: None, model
        return eng

    monkeypatch.setattr(S, "make_engine", make)
    monkeypatch.setattr(fallback, "_said", set())
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(24)))
    cfg = C.CurateConfig(train_data=str(data), teacher_context="privileged", max_tokens=16, chunk_size=12,
                         teacher_samples=2, student_samples=2, output_dir=str(tmp_path / "run"), engine="vllm")
    with caplog.at_level(logging.WARNING):
        m = C.curate(cfg)
    said = [r.getMessage() for r in caplog.records if "the vLLM engine failed" in r.getMessage()]
    assert len(said) == 1 and ("to start" in said[0] if when == "start" else "in teacher chunk 0" in said[0])
    assert kinds[0] == "vllm" and set(kinds[1:]) == {"hf"}
    # 2 chunks x 2 roles measured by the hf engine; the broken vLLM was tried once (mid-chunk) or never (start)
    assert calls.count("hf-cuda") == 4 and calls.count("vllm-cuda") == (1 if when == "mid-chunk" else 0)
    assert m["counts"]["rollouts"] == 24 * 4
