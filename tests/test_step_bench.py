"""The realistic step bench: drawn lengths honoured by both generators, the decode floor by hand.

CPU, tiny shapes: one optimizer step of OPDTrainer (FastGenerator path) and of TRL's DistillationTrainer (both its
own HF generate and the bench's fast-path substitution) through ``bench/opd_step_realistic.py``.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import step_realism as sr  # noqa: E402

#: The step benches compare OPDTrainer with TRL's own DistillationTrainer (TRL >= 1.10).
needs_trl_distillation = pytest.mark.skipif(
    not hasattr(__import__("trl"), "DistillationTrainer"),
    reason="the bench's peer is TRL's DistillationTrainer, which this TRL (before 1.10) lacks")


def test_lognormal_mu_hits_the_clip_rate():
    mu = sr.lognormal_mu(8192, 0.0645, 0.75)
    # P(L > cap) from the normal CDF of ln L, against the target 6.45%.
    p = 1.0 - statistics.NormalDist(mu, 0.75).cdf(math.log(8192))
    assert p == pytest.approx(0.0645, abs=1e-9)
    assert math.exp(mu) == pytest.approx(2623.78, abs=0.01)  # the median stated in the docstring


def test_draw_lengths_deterministic_and_clipped_rows_at_cap():
    a = sr.draw_lengths(4000, 8192, seed=3, batch=1)
    assert a == sr.draw_lengths(4000, 8192, seed=3, batch=1)
    assert a != sr.draw_lengths(4000, 8192, seed=3, batch=2)
    lens, clip = a
    assert all(1 <= n <= 8192 for n in lens)
    assert all(n == 8192 for n, c in zip(lens, clip) if c)
    assert sum(clip) / len(clip) == pytest.approx(0.0645, abs=0.012)  # 4,000 draws: ~3 standard errors


def test_decode_floor_by_hand():
    # Rows of 3 and 1 tokens, prompts 2 and 5 tokens: decode steps t = 1, 2 (token 0 is the prefill's).
    # t=1: weights + row 0 live (L=3 > 1) reading 2+1 = 3 tokens; row 1 (L=1) finished.
    # t=2: weights + row 0 reading 2+2 = 4 tokens.
    f = sr.decode_floor([3, 1], [2, 5], w_bytes=100, kv_tok=10, bandwidth=50.0)
    assert f["steps"] == 2
    assert f["weight_bytes"] == 200
    assert f["kv_bytes"] == (3 + 4) * 10
    assert f["seconds"] == pytest.approx((200 + 70) / 50.0)
    # A third row of 4 tokens with prompt 1: live at t = 1, 2, 3 reading 2, 3, 4 tokens; three decode steps.
    g = sr.decode_floor([3, 1, 4], [2, 5, 1], w_bytes=100, kv_tok=10, bandwidth=1.0)
    assert (g["steps"], g["kv_bytes"], g["bytes"]) == (3, (7 + 9) * 10, 300 + 160)


def test_kv_bytes_per_token_qwen15():
    from transformers import Qwen2Config

    import opd_step_bench as sb

    assert sr.kv_bytes_per_token(Qwen2Config(**sb.QWEN15)) == 2 * 28 * 2 * 128 * 2


def test_forced_eos_processor_forces_and_suppresses():
    proc = sr.ForcedEOSProcessor([1, -1], eos_id=0)
    out0 = proc(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 5))  # t = 0: nobody may end
    assert torch.isinf(out0[:, 0]).all() and torch.isfinite(out0[:, 1:]).all()
    out1 = proc(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5))  # t = 1: row 0 must end, row 1 may not
    assert out1[0, 0] == 0 and torch.isinf(out1[0, 1:]).all()
    assert torch.isinf(out1[1, 0]) and torch.isfinite(out1[1, 1:]).all()


def test_fit_extrapolate_linear_step_time():
    import opd_step_realistic as osr

    # step time 1 + 0.01 t: time to step s = s + 0.005 s^2
    tr = [(s, s + 0.005 * s * s) for s in range(0, 512, 128)]
    assert osr.fit_extrapolate(tr, 1000) == pytest.approx(1000 + 0.005 * 1000**2, rel=1e-9)


@needs_trl_distillation
def test_realistic_tiny_one_step_lengths_respected(tmp_path):
    """Ours (FastGenerator) and TRL (own HF generate, and the fast-path substitution) produce exactly the drawn
    lengths; the JSON carries the floor and the pieces."""
    # no --variants: the default, compact+grow, is the trainer as shipped (compaction and KV growth on), hook and all
    import json

    import opd_step_realistic as osr

    out = tmp_path / "r.json"
    res = osr.main(["--device", "cpu", "--tiny", "--completions", "8", "--micro-batch", "4", "--cap", "32",
                    "--prompt-len", "8", "--warmup", "1", "--warmup-micro", "1", "--steps", "1",
                    "--trl-gen-budget-s", "600",
                    "--grader-workers", "0", "--fail-fast", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["table"] == res["table"]
    warm, *ours = res["pieces"]["ours"]["compact+grow"]["rows"]
    assert warm["warmup"] and warm["micro_steps"] == 1 and warm["mismatched"] == 0  # batch 0, generated
    assert len(ours) == 1 and ours[0]["mismatched"] == 0 and ours[0]["batch"] == 1
    lens, clip = sr.draw_lengths(8, 32, 0, 1)  # the timed batch, for every trainer
    assert ours[0]["tokens"] == sum(lens)
    trl_u = res["pieces"]["trl_update"]["rows"][0]
    assert trl_u["mismatched"] == 0 and trl_u["tokens"] == sum(lens)
    assert trl_u["generation_source"] == "replay of ours" and ours[0]["generation_calls"] == [1]
    g = res["pieces"]["trl_gen"]
    assert g["mismatched"] == 0 and not g["extrapolated"] and g["tokens"] == sum(lens)
    assert g["trace"][0][0] == 0 and g["steps_done"] == max(lens)  # the tracer saw every step
    f = res["floor"]["1"]
    assert f["completion_tokens"] == sum(lens) and f["steps"] == max(lens) - 1
    assert "| ours/compact+grow (step) |" in res["table"]


def test_realistic_tiny_rollout_batch_in_several_updates(tmp_path):
    """``spgN``: one generation call (the drawn lengths respected), N optimizer steps, timed as one row."""
    import opd_step_realistic as osr

    ov, notes = osr.variant_overrides(["compact+grow+spg2"])
    assert ov["compact+grow+spg2"]["steps_per_generation"] == 2 and not notes
    res = osr.main(["--device", "cpu", "--tiny", "--completions", "16", "--micro-batch", "4", "--cap", "24",
                    "--prompt-len", "8", "--warmup", "0", "--steps", "1", "--pieces", "ours", "--variants",
                    "compact+grow+spg2", "--grader-workers", "0", "--fail-fast"])
    (row,) = res["pieces"]["ours"]["compact+grow+spg2"]["rows"]
    assert row["updates"] == 2 and len(row["update_steps_s"]) == 2 and row["generation_calls"] == [0]
    assert row["mismatched"] == 0 and row["step"] == pytest.approx(sum(row["update_steps_s"]))
    with pytest.raises(SystemExit, match="spg3"):
        osr.main(["--device", "cpu", "--tiny", "--completions", "16", "--micro-batch", "4", "--cap", "24",
                  "--warmup", "0", "--steps", "1", "--pieces", "ours", "--variants", "spg3", "--fail-fast"])


@needs_trl_distillation
def test_realistic_tiny_generation_mode_and_merge(tmp_path):
    """Generation-only variant mode honours the lengths on every call; --merge combines two calls' JSONs."""
    import opd_step_realistic as osr

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--device", "cpu", "--tiny", "--completions", "8", "--micro-batch", "4", "--cap", "24",
              "--prompt-len", "8", "--grader-workers", "0", "--fail-fast"]
    ra = osr.main(common + ["--pieces", "ours", "--variant-mode", "generation", "--warmup", "1", "--steps", "1",
                            "--json", str(a)])
    rows = ra["pieces"]["ours"]["compact+grow@gen"]["rows"]
    assert [r["batch"] for r in rows] == [0, 1] and all(r["mismatched"] == 0 for r in rows)
    for r in rows:
        assert r["tokens"] == sum(sr.draw_lengths(8, 24, 0, r["batch"])[0])
    assert "trl_update" not in ra["pieces"] and "trl_step_composite" not in ra
    rb = osr.main(common + ["--pieces", "trl_update,trl_gen", "--warmup", "1", "--trl-update-steps", "1",
                            "--trl-gen-budget-s", "1e-9", "--json", str(b)])
    g = rb["pieces"]["trl_gen"]  # cut by max_time: the rest is extrapolated
    assert g["extrapolated"] and g["mismatched"] > 0 and g["steps_done"] < g["steps_needed"]
    # max_time 1e-9 stops HF generate after its first token, whatever the machine's speed: a deterministic cut
    assert g["steps_done"] == 1 and g["extrapolation"].startswith("measured mean")
    assert g["generation"] == pytest.approx(g["generation_measured"] * g["steps_needed"], rel=1e-9)
    m = osr.main(["--merge", str(a), str(b)])
    assert m["pieces"]["trl_update"]["rows"][0]["generation_source"] == "trainers.fast_generation"
    assert m["pieces"]["trl_update"]["rows"][0]["mismatched"] == 0
    assert "ours/compact+grow@gen (generation)" in m["table"] and "TRL (own generate + update)" in m["table"]


@needs_trl_distillation
def test_trl_refuses_a_teacher_with_more_rows(tmp_path):
    """Why the bench cuts TRL's teacher to the student's rows: TRL 1.16 compares config.vocab_size and raises."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    import opd_step_bench as sb
    import opd_step_realistic as osr

    tok = sb.build_tokenizer(sb.TINY["vocab_size"])
    student = sb.build_model(sb.TINY, tok, 1, "cpu")
    teacher = sb.build_model(osr.TINY_TEACHER, tok, 2, "cpu")
    args = DistillationConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match="vocab_size"):
        DistillationTrainer(model=student, teacher_model=teacher, args=args,
                            train_dataset=Dataset.from_dict({"prompt": ["qa qb"]}), processing_class=tok)


def test_fast_hook_follows_row_ids_of_a_compacted_batch():
    """The FastGenerator hook forces EOS by original row (``row_ids``) and refuses a shrunk batch without them."""
    from types import SimpleNamespace

    from data_tools.generation import fast_decoder as gen
    from data_tools.generation.fast_decoder import SamplingParams

    sp = SamplingParams(max_new_tokens=8, do_sample=False)
    eos = torch.tensor([0])
    targets = torch.tensor([0, 2, -1, 2])  # eos step per original row
    logits = torch.zeros(2, 6)
    logits[:, 4] = 1.0  # greedy picks token 4
    orig = gen.sample_next
    with sr.fast_generator_hook():
        sr._ACTIVE.update(targets=targets, eos_id=0, alt_id=5)
        try:
            sr._ACTIVE["state"] = SimpleNamespace(step_idx=torch.tensor([2]), row_ids=torch.tensor([1, 2]))
            assert gen.sample_next(logits, sp, eos, None).tolist() == [0, 4]  # row 1 ends at step 2, row 2 never
            sr._ACTIVE["state"] = SimpleNamespace(step_idx=torch.tensor([2]))
            with pytest.raises(RuntimeError, match="row_ids"):
                gen.sample_next(logits, sp, eos, None)
        finally:
            sr._ACTIVE.update(targets=None, state=None)
    assert gen.sample_next is orig  # restored on exit


def test_variant_overrides_join_levers():
    """'compact+compile' ('compact+grow') turns both decoder levers on and every other lever off; an unknown part is
    refused."""
    import opd_step_realistic as osr

    out, notes = osr.variant_overrides(["base", "compact+compile", "compact+grow"])
    assert notes == []
    assert out["base"] == {"decode_compaction": False, "decode_compile": False, "decode_kv_growth": False,
                           "async_generation": False, "head_kernel": "trl"}
    assert out["compact+compile"] == {"decode_compaction": True, "decode_compile": True, "decode_kv_growth": False,
                                      "async_generation": False, "head_kernel": "trl"}
    assert out["compact+grow"] == {"decode_compaction": True, "decode_compile": False, "decode_kv_growth": True,
                                   "async_generation": False, "head_kernel": "trl"}
    with pytest.raises(SystemExit, match="unknown variant"):
        osr.variant_overrides(["compact+turbo"])


def test_fit_extrapolate_clamps_a_falling_step_time_to_a_lower_bound():
    """The H200 trace of TRL's generate (2026-12-02): 92 ms/step over its first 256 steps, 79 ms over the next
    256, cut at 517. The first interval and the 5-step tail are left out; one interval is left, so the rest is
    decoded at its 79.1 ms/step: 44.29 + 7,675 x 0.07910 s, flagged as a lower bound only when a fit falls."""
    import opd_step_realistic as osr

    tr = [(0, 0.0), (256, 23.6806), (512, 43.9272), (517, 44.2895)]
    assert osr.fit_extrapolate(tr, 8192) == pytest.approx(44.2895 + (8192 - 517) * (43.9272 - 23.6806) / 256, rel=1e-9)
    assert not osr.fit_is_lower_bound(tr, 8192)  # a single interval has no slope to clamp
    falling = [(0, 0.0), (100, 20.0), (200, 30.0), (300, 39.0), (400, 47.0)]  # 100, 90, 80 ms/step after the first
    assert osr.fit_is_lower_bound(falling, 1000)
    assert osr.fit_extrapolate(falling, 1000) == pytest.approx(47.0 + 600 * 0.09, rel=1e-9)


def test_a_variant_that_cannot_be_built_is_recorded_and_the_next_runs(tmp_path):
    """head_kernel=liger is refused on a CPU: its piece records the error, the next variant still measures."""
    import opd_step_realistic as osr

    res = osr.main(["--device", "cpu", "--tiny", "--completions", "8", "--micro-batch", "4", "--cap", "24",
                    "--prompt-len", "8", "--grader-workers", "0", "--steps", "1", "--warmup", "0",
                    "--variants", "liger,compact", "--pieces", "ours", "--json", str(tmp_path / "r.json")])
    ours = res["pieces"]["ours"]
    assert "no CUDA" in ours["liger"]["error"] and ours["liger"]["rows"] == []
    assert "error" not in ours["compact"] and len(ours["compact"]["rows"]) == 1
    assert "| ours/liger (step) |" in res["table"] and "failed: ValueError" in res["table"]
    with pytest.raises(SystemExit, match="--pieces"):
        osr.main(["--device", "cpu", "--tiny", "--pieces", "bogus"])


def test_train_steps_with_forced_lengths_decode_the_drawn_lengths(tmp_path):
    """``opd_step_bench.py --train-steps N --forced-lengths``: each ``train()`` step's completions end at that step's
    drawn lengths (the memory bench of varying shapes), and the step's logged mean length is theirs."""
    import opd_step_bench as sb

    res = sb.main(["--device", "cpu", "--tiny", "--skip-bench", "--train-steps", "2", "--forced-lengths",
                   "--new-tokens", "24", "--prompts", "8", "--train-json", str(tmp_path / "train.json")])
    lens = [sr.draw_lengths(8, 24, 0, b)[0] for b in range(2)]
    assert len(set(map(sum, lens))) == 2  # two different batches of lengths, not all at the cap
    assert [(c["batch"], c["tokens"], c["mismatched"]) for c in res["forced_lengths"]] == [
        (b, sum(lens[b]), 0) for b in range(2)]
    assert [r["completions/mean_length"] for r in res["steps"]] == [pytest.approx(sum(x) / 8) for x in lens]
    for bad in (["--forced-lengths", "--async-generation"],  # the hook forces one decoder call at a time
                ["--forced-lengths", "--clip-rate", "0"], ["--forced-lengths", "--clip-rate", "1.5"],
                ["--clip-rate", "0.1"]):  # refused before any model is built
        with pytest.raises(SystemExit):
            sb.main(["--device", "cpu", "--tiny", "--skip-bench", "--train-steps", "2", *bad])
