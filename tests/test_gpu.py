"""GPU tests (marker ``gpu``; skipped without CUDA): ``pytest -m gpu`` on a CUDA machine, with or without vLLM.

The decoder, the hf engine in stage one and evaluation, compiled layers and a few OPDTrainer steps, all
on the GPU; each runs in well under a minute on one H200 with the embedded SmolLM2-135M or tiny models.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.test_generation import hf_greedy, prompts
from tests.test_generation import tiny_model as tiny_qwen
from tests.test_train_stage import TINY_FLAGS, _env
from tests.test_trainer import curriculum_path, tiny_model, tiny_model_dir, tokenizer  # noqa: F401 - fixtures

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[1]


def _run(module: str, args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("gqa", [True, False])
def test_fast_decoder_equals_hf_generate_greedy_on_cuda(gqa):
    """CUDA-graph decode over the static cache = ``model.generate`` token for token (float32, greedy)."""
    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams

    model = tiny_qwen().cuda()
    ps = prompts(n=6)
    ref = hf_greedy(model, ps, 40, 0, [1])
    gen = FastGenerator(0, [1], len_bucket=16, gqa_attention=gqa, check_every=8)
    got = gen.generate(model, ps, SamplingParams(max_new_tokens=40, do_sample=False))
    assert got == ref
    assert gen._state is None and gen.stats["captures"] == 1  # the graph was captured (and freed after the call)


@pytest.mark.parametrize("compile_step,kv_growth", [(False, False), (True, False), (False, True), (True, True)])
def test_compacting_decoder_equals_hf_generate_greedy_on_cuda(compile_step, kv_growth):
    """Compaction (and compiled decode layers) with CUDA graphs per window = ``model.generate`` (float32, greedy).

    A second call re-captures its graphs but compiles nothing new: one compile per batch bucket met. With
    ``kv_growth`` the cache storage is replaced at every window change (grown or shrunk) between captures, the
    graphs of a replaced storage are never replayed, and the tokens stay HF's.
    """
    from tests.test_decode_compaction import EOS, N, PAD, rows, small_vocab_model
    from data_tools.generation.fast_decoder import FastGenerator, SamplingParams
    from data_tools.generation.kv_cache import compiled_batch_sizes

    model = small_vocab_model().cuda()
    ps = rows()
    ref = hf_greedy(model, ps, N, PAD, EOS)
    gen = FastGenerator(PAD, EOS, len_bucket=8, check_every=2, compaction=True, attn_bucket=4, min_batch_bucket=1,
                        compile_step=compile_step, kv_growth=kv_growth)
    sp = SamplingParams(max_new_tokens=N, do_sample=False)
    assert gen.generate(model, ps, sp) == ref
    assert gen.last["compactions"] >= 2 and gen.last["graphs"] >= 4
    if kv_growth:
        assert gen.last["reallocations"] >= 10 and gen.last["graphs"] == len(gen.last["windows"]) - 1
        assert gen.last["kv_peak_bytes"] < 0.6 * 12 * 56 * 2 * 2 * 2 * 16 * 4  # vs the full 12 x 56 fp32 cache
    if compile_step:
        sizes = compiled_batch_sizes(model)
        assert 12 in sizes and len(sizes) >= 3 and sizes <= {12, 6, 3, 2, 1}
        from torch._dynamo.utils import counters

        frames = counters["frames"]["total"]
        assert gen.generate(model, ps, sp) == ref
        assert counters["frames"]["total"] == frames  # no recompile on the second call
    else:
        assert compiled_batch_sizes(model) == set()


def test_hf_engine_greedy_matches_hf_generate_on_smollm2():
    """The hf engine (float32 here) on the real model: greedy text, token counts and finish reasons."""
    from transformers import AutoModelForCausalLM

    from data_tools import prompts as P
    from data_tools.generation.engines import HFEngine
    from data_tools.models import resolve_model

    path = resolve_model(None)
    eng = HFEngine(path, dtype="float32", max_model_len=512)
    assert eng.name == "hf-cuda"
    texts = [P.render(eng.tokenizer, P.student_messages(q, "short")) for q in
             ("What is 2 + 3?", "What is 12 * 4?", "Name a prime number larger than 10.", "What is 9 - 11?")]
    (got,) = list(eng.generate(texts, n=1, max_tokens=20, temperature=0.0, chunk_size=8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    ids = [eng.tokenizer(t)["input_ids"] for t in texts]
    ref = hf_greedy(hf, ids, 20, eng.tokenizer.pad_token_id, eng.eos_ids)
    decode = lambda r: eng.tokenizer.decode(r[:-1] if r[-1] in eng.eos_ids else r, skip_special_tokens=True,  # noqa: E731
                                            clean_up_tokenization_spaces=False)
    assert [s.completion for s in got] == [decode(r) for r in ref]
    assert [s.n_tokens for s in got] == [len(r) for r in ref]
    assert [s.finish_reason for s in got] == ["stop" if r[-1] in eng.eos_ids else "length" for r in ref]
    assert [s.n_prompt_tokens for s in got] == [len(i) for i in ids]
    eng.close()


def test_curate_with_hf_engine(tmp_path):
    """Stage one with ``engine=hf`` on CUDA: row counts, the engine column and manifest, finish reasons."""
    out = tmp_path / "run"
    env = dict(os.environ, OUTPUT_DIR=str(out))
    _run("stages.curate", ["--config", "configs/curate_demo_gpu.yaml", "--engine", "hf", "--train_data",
                           "synth:train:24", "--teacher_samples", "2", "--student_samples", "4",
                           "--max_tokens", "12", "--chunk_size", "10"], env)
    cur = out / "curate"
    manifest = json.loads((cur / "manifest.json").read_text())
    assert manifest["engine"] == {"name": "hf-cuda", "dtype": "bfloat16"}
    roll = pq.read_table(cur / "rollouts.parquet").to_pylist()
    assert len(roll) == 24 * 2 + 24 * 4
    assert {r["engine"] for r in roll} == {"hf-cuda"}
    for role, n in (("teacher", 2), ("student", 4)):
        rows = [r for r in roll if r["role"] == role]
        assert sorted((r["problem_id"], r["sample_index"]) for r in rows) == sorted(
            (pid, j) for pid in {r["problem_id"] for r in rows} for j in range(n))
    assert all(1 <= r["n_tokens"] <= 12 and r["n_prompt_tokens"] > 0 for r in roll)
    assert all(r["n_tokens"] == 12 for r in roll if r["finish_reason"] == "length")
    assert {r["finish_reason"] for r in roll} <= {"stop", "length"}
    assert any(r["finish_reason"] == "stop" for r in roll)
    student = [r for r in roll if r["role"] == "student"]
    clip = sum(r["finish_reason"] == "length" for r in student) / len(student)
    assert manifest["counts"]["student_clip_rate"] == pytest.approx(round(clip, 4))
    acc = sum(r["correct"] for r in student) / len(student)
    assert manifest["counts"]["student_accuracy"] == pytest.approx(round(acc, 4))


def test_compiled_layers_give_eager_loss_on_cuda(tokenizer):  # noqa: F811
    """Regional torch.compile of the decoder layers: the same loss and gradients as eager, on CUDA."""
    from trainers.model_utils import compile_decoder_layers

    eager = tiny_model(tokenizer, seed=3).cuda()
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled, only_with_grad=True)
    ids = torch.randint(0, len(tokenizer), (4, 32), device="cuda")
    losses = []
    for m in (compiled, eager):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (n, pc), (_, pe) in zip(compiled.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-3, atol=1e-5, msg=n)


def test_opd_trainer_steps_on_cuda_write_loadable_exports(tmp_path, tiny_model_dir, curriculum_path):  # noqa: F811
    """Three OPDTrainer steps on the GPU (fast generation, compiled layers): exports transformers loads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    env = _env(tmp_path, tiny_model_dir, curriculum_path, MAX_WALL_TIME_SECONDS=400, DEADLINE_RESERVE_SECONDS=20)
    proc = subprocess.run([sys.executable, "-m", "stages.train", *TINY_FLAGS, "--debug_max_steps", "3",
                           "--ckpt_every_steps", "2", "--ckpt_every_minutes", "0"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["global_step"] == 3 and summary["engine"] == "hf-generate-fast"
    final = tmp_path / "run" / "checkpoints" / "checkpoint-3"
    model = AutoModelForCausalLM.from_pretrained(final)
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    changed = [n for n, p in model.named_parameters() if n in start and not torch.equal(p.detach().cpu(), start[n])]
    assert changed, "three steps at lr 1e-3 left every weight unchanged"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # per-step device memory: the run's peak is the running maximum of the steps' own peaks, and each step's peak is
    # at least what it left allocated
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    run_peak = 0.0
    for r in recs:
        assert 0 < r["memory/allocated_gib"] <= r["memory/step_peak_gib"] <= r["memory/peak_gib"]
        run_peak = max(run_peak, r["memory/step_peak_gib"])
        assert r["memory/peak_gib"] >= run_peak


def test_evaluation_summary_matches_samples_on_cuda(tmp_path):
    """Evaluation with the hf engine: summary.json's numbers are those of its per-sample parquet."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("EVAL_DATA", "OUTPUT_DIR", "EXPERIMENT_NAME")}
    _run("stages.evaluate", ["--protocol", "synth_heldout_gpu", "--engine", "hf", "--limit", "40",
                             "--output_dir", str(out), "--label", "t"], env)
    res = out / "eval" / "t"
    s = json.loads((res / "summary.json").read_text())
    rows = pq.read_table(res / "samples.parquet").to_pylist()
    assert s["engine"]["name"] == "hf-cuda" and {r["engine"] for r in rows} == {"hf-cuda"}
    assert (s["n_problems"], s["n_samples"], len(rows)) == (40, 320, 320)
    assert s["pass_at_1"] == pytest.approx(sum(r["correct"] for r in rows) / 320)
    assert s["clip_rate"] == pytest.approx(sum(r["finish_reason"] == "length" for r in rows) / 320)
    assert s["tokens_generated"] == sum(r["n_tokens"] for r in rows)
    assert all(r["n_tokens"] == 24 for r in rows if r["finish_reason"] == "length")
    per_problem = {}
    for r in rows:
        per_problem.setdefault(r["problem_id"], []).append(r["correct"])
    assert len(per_problem) == 40 and all(len(v) == 8 for v in per_problem.values())
    assert pq.read_table(res / "problems.parquet").num_rows == 40
