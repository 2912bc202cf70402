"""OPDTrainer on tiny random models (CPU): privileged context, vocab mismatch, parameter updates, guards.

The tiny models share SmolLM2's tokenizer (the embedded default, converted once and cached) so the
chat template and special tokens are real; their bodies are 2-layer, 16-wide Llamas, so a step
takes about a second.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

REFERENCE = "REFSOLUTION-7731 so the answer is 5."


# ---------------------------------------------------------------- fixtures shared with test_train_stage.py


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from data_tools.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None), padding_side="left")


def tiny_model(tokenizer, vocab_size=None, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    m.generation_config.eos_token_id = tokenizer.eos_token_id
    return m


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_student")
    tiny_model(tokenizer).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def curriculum_rows(n=8):
    """Rows of stage one's curriculum schema (design: curate writes these columns)."""
    return [dict(problem_id=f"p{i}", problem=f"What is {i} + {i + 1}?", answer=str(2 * i + 1),
                 reference=f"{REFERENCE} ({i})", source="synth", level=str(1 + i % 3), pass_rate=0.5,
                 teacher_pass_rate=0.75, bucket=i % 2, curriculum_index=i, prompt_style="short") for i in range(n)]


@pytest.fixture()
def curriculum_path(tmp_path):
    from data_tools.runio import write_parquet

    return str(write_parquet(curriculum_rows(), tmp_path / "curate" / "curriculum.parquet"))


def make_args(tmp_path, **kw):
    from trainers.opd_config import OPDConfig

    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_generations=4, max_completion_length=6, learning_rate=1e-2, debug_max_steps=2,
                max_wall_time_seconds=10_000, deadline_reserve_seconds=10, ckpt_every_minutes=0, use_cpu=True,
                save_rollouts=True, dataloader_num_workers=0)
    base.update(kw)
    return OPDConfig(**base)


def make_trainer(tmp_path, tokenizer, curriculum_path, *, model=None, teacher=None, **kw):
    from trainers.data import build_train_dataset, load_curriculum
    from trainers.opd_trainer import OPDTrainer

    args = make_args(tmp_path, **kw)
    ds = build_train_dataset(load_curriculum(curriculum_path), tokenizer, prompt_style=args.prompt_style)
    return OPDTrainer(model=model if model is not None else tiny_model(tokenizer), teacher_model=teacher, args=args,
                      train_dataset=ds, processing_class=tokenizer)


# ---------------------------------------------------------------- tests


def test_privileged_context_teacher_sees_reference(tmp_path, tokenizer, curriculum_path):
    tr = make_trainer(tmp_path, tokenizer, curriculum_path)
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    for i in range(len(rows)):
        student = tokenizer.decode(out["prompt_ids"][i][out["prompt_mask"][i].bool()])
        teacher = tokenizer.decode(out["teacher_prompt_ids"][i][out["teacher_prompt_mask"][i].bool()])
        assert "REFSOLUTION-7731" in teacher and "REFSOLUTION-7731" not in student
        assert rows[i]["prompt"].split("<|im_start|>user")[1][:20] in student  # same problem in both
    assert out["advantages"].shape == (8,)

    tr2 = make_trainer(tmp_path / "b", tokenizer, curriculum_path, teacher_context="teacher")
    out2 = tr2._generate_and_score_completions(rows)
    assert torch.equal(out2["teacher_prompt_ids"], out2["prompt_ids"])


def test_advantages_from_grader(tmp_path, tokenizer, curriculum_path, monkeypatch):
    """Rewards from the grader -> group-normalised advantages, zero-variance groups 0; metrics logged."""
    import data_tools.grader as grader
    from trainers.losses import group_advantages

    pattern = [True, False, False, False, True, True, True, True]

    def fake_grade_batch(preds, golds, **kw):
        return [grader.Verdict(correct=c, extracted="x", path="test") for c in pattern[: len(preds)]]

    monkeypatch.setattr(grader, "grade_batch", fake_grade_batch)
    # every completion ends with EOS (a truncated one would earn 0 whatever the grader says)
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, generation_kwargs={"forced_eos_token_id": tokenizer.eos_token_id})
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    assert all(r["finish_reason"] == "stop" for r in tr._pending_rollouts["rows"])
    expect = group_advantages(torch.tensor(pattern, dtype=torch.float32), 4)
    assert torch.allclose(out["advantages"], expect)
    assert torch.equal(out["advantages"][4:], torch.zeros(4))
    m = tr._metrics["train"]
    assert m["reward/mean"][-1] == pytest.approx(5 / 8)
    assert m["reward/zero_std_frac"][-1] == pytest.approx(0.5)
    assert m["reward/group_pass_rate"][-1] == pytest.approx(1.0)


#: A bias on EOS that makes about half of the tiny models' 6-token completions stop (seeded): both kinds in a batch.
EOS_BIAS = 8.0


def _all_correct(monkeypatch):
    import data_tools.grader as grader

    monkeypatch.setattr(grader, "grade_batch",
                        lambda preds, golds, **kw: [grader.Verdict(correct=True, extracted="x", path="test")] * len(preds))


@pytest.mark.parametrize("mode", ["zero_reward", "mask"])
def test_truncated_completions_earn_nothing(tmp_path, tokenizer, curriculum_path, monkeypatch, mode):
    """Graded correct but cut at max_completion_length: reward 0; mask mode also drops it from the loss,
    whose value is then the plain sampled-token loss over the finished completions only."""
    _all_correct(monkeypatch)
    torch.manual_seed(0)
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, seed=1),
                      teacher=tiny_model(tokenizer, seed=2), teacher_context="teacher", truncated_completions=mode,
                      generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], EOS_BIAS]]})
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    roll = tr._pending_rollouts["rows"]
    cut = torch.tensor([r["finish_reason"] == "length" for r in roll])
    assert 0 < int(cut.sum()) < len(roll), "need both truncated and finished completions"
    assert [r["reward"] for r in roll] == [0.0 if c else 1.0 for c in cut.tolist()]
    assert all(r["correct"] for r in roll)  # the grader's verdict is kept; the reward is withheld
    m = tr._metrics["train"]
    assert m["reward/mean"][-1] == pytest.approx(1 - cut.float().mean().item())
    assert m["reward/truncated_withheld_frac"][-1] == pytest.approx(cut.float().mean().item())
    assert m["completions/clipped_ratio"][-1] == pytest.approx(cut.float().mean().item())
    cmask = out["completion_mask"]
    if mode == "mask":
        assert cmask[cut].sum() == 0 and (cmask[~cut].sum(1) > 0).all()
    else:
        assert (cmask.sum(1) > 0).all()
    assert int(out["num_items_in_batch"]) == int(cmask.sum())

    # the loss against a plain forward: sum over kept tokens of (k1 - A) / N (ratio 1, w_kl = w_reward = 1)
    model = tr.accelerator.unwrap_model(tr.model)
    loss, _, _ = tr._compute_loss(model, out, out["num_items_in_batch"])
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    K = out["completion_ids"].size(1)

    def logp(mdl, mask):
        z = mdl(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1].float() / tr.temperature
        return torch.log_softmax(z, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        full = torch.cat([out["prompt_mask"], cmask], 1)
        k1 = logp(model, full) - logp(tr.teacher_model, full)
    ref = ((k1 - out["advantages"].unsqueeze(1)) * cmask).sum() / cmask.sum()
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-6)


def test_two_steps_change_every_trainable_parameter(tmp_path, tokenizer, curriculum_path):
    model = tiny_model(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=model)
    teacher_before = {n: p.detach().clone() for n, p in tr.teacher_model.named_parameters()}
    tr.train()
    assert tr.state.global_step == 2
    for n, p in tr.model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p.detach(), before[n]), f"{n} did not change"
    for n, p in tr.teacher_model.named_parameters():  # the frozen initial student stays frozen
        assert torch.equal(p, teacher_before[n]), f"teacher {n} changed"
    run = Path(tr.args.output_dir)
    lines = (run / "metrics" / "train.jsonl").read_text().splitlines()
    assert len(lines) == 2
    import json

    rec = json.loads(lines[-1])
    for k in ("loss", "loss/kl", "loss/reward", "kl/sampled_mean", "reward/mean", "reward/group_pass_rate",
              "reward/zero_std_frac", "completions/clip_rate", "completions/mean_length", "entropy", "grad_norm",
              "learning_rate", "time/generation", "time/teacher", "time/update", "throughput/tokens_per_s",
              "memory/peak_gib", "engine", "step", "wall_s"):
        assert k in rec, k
    assert rec["engine"] == "hf-generate" and rec["step"] == 2
    import pyarrow.parquet as pq

    t = pq.read_table(run / "rollouts" / "step-000002.parquet").to_pylist()
    assert len(t) == 8 and sorted(r["sample_index"] for r in t) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(r["seq_kl"] == r["seq_kl"] for r in t)  # filled (not NaN)
    assert (Path(tr.args.ckpt_dir) / "checkpoint-2" / "model.safetensors").exists()


@pytest.mark.parametrize("kw", [dict(kl_mode="full"), dict(kl_mode="full", full_topk=8),
                                dict(num_iterations=2, gradient_accumulation_steps=1, per_device_train_batch_size=8)])
def test_other_modes_train(tmp_path, tokenizer, curriculum_path, kw):
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, debug_max_steps=2, **kw)
    tr.train()
    assert tr.state.global_step == 2
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    if kw.get("kl_mode") == "full":
        assert "kl/full_mean" in logs[-1]
    if kw.get("num_iterations") == 2:  # second pass over the same batch: the ratio moved off 1
        assert logs[-1]["ppo/ratio_mean"] != pytest.approx(1.0, abs=1e-7)


def test_steps_per_generation_splits_one_rollout_batch_into_steps(tmp_path, tokenizer, curriculum_path):
    """steps_per_generation = 2: one generation call of 8 completions (2 prompts x 4) feeds two optimizer steps of 4,
    each normalised by its own completion tokens; the second step is PPO-corrected against the batch's pi_old."""
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, debug_max_steps=4, steps_per_generation=2,
                      per_device_train_batch_size=4, gradient_accumulation_steps=1)
    assert tr.generation_batch_size == 8
    gens, seen = [], []
    generate, compute = tr._generate_and_score_completions, tr._compute_loss

    def gen_spy(inputs):
        out = generate(inputs)
        gens.append(sorted({x["problem_id"] for x in inputs}))
        assert "old_logps" in out and out["completion_ids"].size(0) == 8
        return out

    def loss_spy(model, inputs, n):
        seen.append((float(n), float(inputs["completion_mask"].sum()), inputs["completion_ids"].size(0)))
        return compute(model, inputs, n)

    tr._generate_and_score_completions, tr._compute_loss = gen_spy, loss_spy
    tr.train()
    assert tr.state.global_step == 4
    assert len(gens) == 2 and all(len(g) == 2 for g in gens) and gens[0] != gens[1]
    assert [b for _, _, b in seen] == [4, 4, 4, 4]
    for n, tokens, _ in seen:  # each step's divisor is its own tokens (one process), not the rollout batch's
        assert n == pytest.approx(max(tokens, 1.0))
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert logs[0]["ppo/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # first mini-batch: pi = pi_old
    assert logs[1]["ppo/ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # after one update at lr 1e-2: moved
    assert logs[1]["throughput/tokens_per_s"] == 0.0 < logs[0]["throughput/tokens_per_s"]
    rollouts = sorted(p.name for p in (Path(tr.args.output_dir) / "rollouts").glob("*.parquet"))
    assert rollouts == ["step-000001.parquet", "step-000003.parquet"]  # one file per rollout batch


def test_steps_per_generation_refused_with_async(tmp_path):
    with pytest.raises(ValueError, match="steps_per_generation"):
        make_args(tmp_path, steps_per_generation=2, async_generation=True, fast_generation=True)
    with pytest.raises(ValueError, match="steps_per_generation must be >= 1"):
        make_args(tmp_path, steps_per_generation=0)


def test_reward_only_never_runs_the_teacher(tmp_path, tokenizer, curriculum_path):
    """w_kl = 0 (sampled mode): no teacher forward, and the gradient is the plain policy gradient."""
    teacher = tiny_model(tokenizer, seed=3)
    calls = []
    teacher.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():  # a poisoned teacher: any read of it would make the loss NaN
        for p in teacher.parameters():
            p.fill_(float("nan"))
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, teacher=teacher, w_kl=0.0, teacher_context="teacher")
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    inputs = tr._generate_and_score_completions(rows)
    inputs["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 2.0, -2.0, 0.3])
    model = tr.accelerator.unwrap_model(tr.model)
    params = [p for p in model.parameters() if p.requires_grad]
    N = int(inputs["completion_mask"].sum())
    loss, _, _ = tr._compute_loss(model, inputs, N)
    assert calls == [] and torch.isfinite(loss)
    got = torch.autograd.grad(loss, params)
    # reference: gradient of -sum_i A_i sum_t log pi(y_it) / N over completion tokens, from a plain forward
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    K = inputs["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1].float() / tr.temperature
    lp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    ref = -(inputs["advantages"].unsqueeze(1) * lp * inputs["completion_mask"]).sum() / N
    want = torch.autograd.grad(ref, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    assert any(float(w.abs().max()) > 0 for w in want)


def test_vocab_mismatch_teacher_matches_sliced(tmp_path, tokenizer, curriculum_path):
    """A teacher with 2 extra embedding rows gives the same loss as the same teacher without them."""
    student = tiny_model(tokenizer, seed=1)
    teacher_small = tiny_model(tokenizer, seed=2)
    V = teacher_small.get_output_embeddings().weight.shape[0]
    teacher_big = copy.deepcopy(teacher_small)
    teacher_big.resize_token_embeddings(V + 2)
    with torch.no_grad():
        teacher_big.get_output_embeddings().weight[V:] = 3.0  # rows that would matter if not sliced
    assert teacher_big.get_output_embeddings().weight.shape[0] == V + 2

    losses_ = []
    for name, teacher in (("small", teacher_small), ("big", teacher_big)):
        tr = make_trainer(tmp_path / name, tokenizer, curriculum_path, model=copy.deepcopy(student),
                          teacher=teacher, teacher_context="teacher")
        assert tr.shared_vocab == V
        torch.manual_seed(0)
        rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
        out = tr._generate_and_score_completions(rows)
        out["advantages"] = torch.linspace(-1, 1, 8)
        loss, _, _ = tr._compute_loss(tr.model, out, out["num_items_in_batch"])
        losses_.append(loss)
    assert torch.allclose(losses_[0], losses_[1])


def _plain_k1_inputs(tr, out):
    """Student and teacher log-probs of the completion tokens from plain forwards: ``(lp_s, lp_t)``, (B, K)."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    K = out["completion_ids"].size(1)

    def logp(mdl):
        z = mdl(input_ids=ids, attention_mask=mask).logits[:, -K - 1:-1].float() / tr.temperature
        return torch.log_softmax(z, -1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        return logp(tr.accelerator.unwrap_model(tr.model)), logp(tr.teacher_model)


def test_rollout_importance_sampling_correction(tmp_path, tokenizer, curriculum_path):
    """Engine log-probs unlike the trainer's: the loss is sum_t min(pi/pi_rollout, cap) (k1 - A) / N, and the
    mismatch is logged under sampling/* (TRL GRPO's names)."""
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, seed=1),
                      teacher=tiny_model(tokenizer, seed=2), teacher_context="teacher", vllm_importance_sampling_cap=2.0)
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    tr.rollouts.is_weights = True  # as under vLLM colocate, whose generation fills sampling_logps (CUDA only)
    out["advantages"] = torch.linspace(-1, 1, 8)
    lp_s, lp_t = _plain_k1_inputs(tr, out)
    mask = out["completion_mask"].bool()
    g = torch.Generator().manual_seed(0)
    samp = lp_s + torch.randn(lp_s.shape, generator=g)  # a rollout engine that disagrees by ~1 nat
    samp[0, 0] = float("nan")  # a token the engine gave no log-prob for: weight 1
    out["sampling_logps"] = samp
    N = int(mask.sum())
    loss, _, _ = tr._compute_loss(tr.accelerator.unwrap_model(tr.model), out, N)

    w = torch.exp(lp_s - samp).clamp(max=2.0)
    w[0, 0] = 1.0
    k1 = (lp_s - lp_t).clamp(-10, 10)
    ref = (w * (k1 - out["advantages"].unsqueeze(1)))[mask].sum() / N
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-4, atol=1e-6)

    tr._finish_step()
    m = tr._metrics["train"]
    known = mask & ~torch.isnan(samp)
    diff = (lp_s - samp).abs()[known]
    assert m["sampling/sampling_logp_difference/mean"][-1] == pytest.approx(float(diff.mean()), rel=1e-4)
    assert m["sampling/sampling_logp_difference/max"][-1] == pytest.approx(float(diff.max()), rel=1e-4)
    assert m["sampling/importance_sampling_ratio/mean"][-1] == pytest.approx(float(w[known].mean()), rel=1e-4)
    assert m["sampling/importance_sampling_ratio/max"][-1] == pytest.approx(2.0)
    assert m["sampling/importance_sampling_ratio/capped_frac"][-1] == pytest.approx(float((w[known] >= 2).float().mean()))


def test_loss_terms_not_multiplied_by_the_process_count(tmp_path, tokenizer, curriculum_path, monkeypatch):
    """Two processes (simulated: each half of the batch with TRL's num_items / 2, the sums reduced):
    loss/kl and loss/reward are the global batch's terms, not twice them."""
    from accelerate import Accelerator
    from trl.trainer.utils import split_tensor_dict

    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, seed=1),
                      teacher=tiny_model(tokenizer, seed=2), teacher_context="teacher", save_rollouts=False)
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    out["advantages"] = torch.linspace(-1, 1, 8)
    lp_s, lp_t = _plain_k1_inputs(tr, out)
    mask = out["completion_mask"].bool()
    N = int(mask.sum())
    model = tr.accelerator.unwrap_model(tr.model)
    for half in split_tensor_dict(out, 2):
        tr._compute_loss(model, half, torch.tensor(N / 2.0))  # what compute_loss passes with 2 processes
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    tr._finish_step()
    m = tr._metrics["train"]
    assert m["loss/kl"][-1] == pytest.approx(float((lp_s - lp_t).clamp(-10, 10)[mask].sum() / N), rel=1e-4)
    adv = out["advantages"].unsqueeze(1).expand_as(lp_s)
    assert m["loss/reward"][-1] == pytest.approx(float(-adv[mask].sum() / N), rel=1e-4)


def test_student_with_more_vocabulary_rows_refused(tmp_path, tokenizer, curriculum_path):
    V = len(tokenizer)
    with pytest.raises(ValueError, match=f"student has {V + 64} vocabulary rows but the teacher only {V}"):
        make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, vocab_size=V + 64),
                     teacher=tiny_model(tokenizer), teacher_context="teacher")


def test_self_teacher_honours_teacher_dtype(tmp_path, tokenizer, curriculum_path):
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, teacher_dtype="bfloat16")
    assert {p.dtype for p in tr.teacher_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in tr.model.parameters()} == {torch.float32}
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    loss, _, _ = tr._compute_loss(tr.accelerator.unwrap_model(tr.model), out, out["num_items_in_batch"])
    assert torch.isfinite(loss)


def test_different_tokenizers_fail_at_start(tokenizer):
    from data_tools.models import check_same_tokenizer

    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<brand_new_token>"])
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_same_tokenizer(tokenizer, other)
    check_same_tokenizer(tokenizer, copy.deepcopy(tokenizer))


def test_nonfinite_steps_are_skipped_then_stop(tmp_path, tokenizer, curriculum_path):
    from trainers.opd_trainer import NonFiniteError

    model = tiny_model(tokenizer)
    teacher = tiny_model(tokenizer, seed=3)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.fill_(float("nan"))  # teacher log-probs -> NaN -> loss NaN
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=model, teacher=teacher, teacher_context="teacher",
                      max_consecutive_nonfinite=2, debug_max_steps=5)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        tr.train()
    for n, p in tr.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} was updated from a non-finite step"


def test_config_range_checks(tmp_path):
    for bad in (dict(kl_mode="forward"), dict(teacher_context="x"), dict(num_generations=3),
                dict(curriculum_mix=2.0), dict(deadline_reserve_seconds=20_000),
                dict(lr_scheduler_type="cosine"), dict(w_kl=0.0, w_reward=0.0), dict(teacher_logprob_min=1.0),
                dict(k1_clamp=-1.0), dict(truncated_completions="drop"), dict(vllm_importance_sampling_cap=0.0)):
        with pytest.raises(ValueError):
            make_args(tmp_path, **bad)
    a = make_args(tmp_path, debug_max_steps=0)
    assert a.max_steps >= 10**9 and a.horizon_seconds == 9990
    assert a.ckpt_dir == str(tmp_path / "run" / "checkpoints")
    assert a.curriculum_path == str(tmp_path / "run" / "curate" / "curriculum.parquet")


def test_export_checkpoint_bf16_rotation_and_atomicity(tmp_path, tokenizer):
    import json

    from transformers import AutoModelForCausalLM

    from trainers.callbacks import checkpoint_steps, export_checkpoint, find_resume_checkpoint

    model = tiny_model(tokenizer)
    for step in (1, 2, 3, 4):
        export_checkpoint(model, tokenizer, tmp_path / "ck", step, dtype=torch.bfloat16, keep=3)
    assert [s for s, _ in checkpoint_steps(tmp_path / "ck")] == [2, 3, 4]
    d = tmp_path / "ck" / "checkpoint-4"
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    m2 = AutoModelForCausalLM.from_pretrained(d)
    assert torch.equal(m2.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    # resume state: the newest checkpoint without trainer_state.json (killed mid-save) is skipped
    (tmp_path / "rs" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "rs" / "checkpoint-3").mkdir()
    (tmp_path / "rs" / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert find_resume_checkpoint(tmp_path / "rs").endswith("checkpoint-3")


class _FakeCuda:
    """torch.cuda's four memory calls over a scripted allocator: ``alloc`` bytes now, ``peak`` since the reset."""

    def __init__(self):
        self.alloc, self.peak, self.resets = 0, 0, 0

    def is_available(self):
        return True

    def max_memory_allocated(self):
        return self.peak

    def memory_allocated(self):
        return self.alloc

    def reset_peak_memory_stats(self):
        self.resets += 1
        self.peak = self.alloc

    def use(self, nbytes):  # a transient allocation of nbytes on top of what is held
        self.peak = max(self.peak, self.alloc + nbytes)


def test_step_memory_separates_step_peaks_from_the_run_peak_and_growth():
    from trainers.model_utils import StepMemory

    gib = 2**30
    cuda = _FakeCuda()
    cuda.alloc = 2 * gib
    cuda.use(6 * gib)  # model loading before the first step: 8 GiB peak
    mem = StepMemory(cuda)
    rows = []
    for transient, kept in ((3, 0.5), (1, 0.5), (2, 0.0)):  # each step: a transient, then memory it keeps
        mem.begin()
        cuda.use(int(transient * gib))
        cuda.alloc += int(kept * gib)
        rows.append(mem.end())
    assert cuda.resets == 3
    assert [r["memory/step_peak_gib"] for r in rows] == [5.0, 3.5, 5.0]
    assert [r["memory/allocated_gib"] for r in rows] == [2.5, 3.0, 3.0]
    assert [r["memory/peak_gib"] for r in rows] == [8.0, 8.0, 8.0]  # the loading peak, not lost to the resets
    cuda.use(10 * gib)  # between steps (an export): 13 GiB, counted at the next step
    mem.begin()
    assert mem.end()["memory/peak_gib"] == 13.0


def test_step_memory_on_cpu_reports_the_resident_peak_only():
    import resource

    from trainers.model_utils import StepMemory

    class NoCuda:
        def is_available(self):
            return False

    out = StepMemory(NoCuda()).end()
    assert set(out) == {"memory/peak_gib"}
    assert out["memory/peak_gib"] == pytest.approx(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, rel=0.01)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_computes_in_fp32(tmp_path, monkeypatch, caplog, native):
    """``bf16: true`` on a CPU that emulates bf16 (no AVX512-BF16 / AMX) is turned off with one warning: there bf16
    autocast made the formal recipe's CPU miniature ~9x slower (SFT steps 71-80 s against 8.3 s), and fp32 is exact.
    A CPU with native bf16 keeps it."""
    import logging

    from trainers import opd_config

    monkeypatch.setattr(opd_config, "cpu_bf16_native", lambda: native)
    with caplog.at_level(logging.WARNING, logger="trainers.opd_config"):
        args = make_args(tmp_path, bf16=True)
    said = [r.getMessage() for r in caplog.records if r.name == "trainers.opd_config"]
    assert args.bf16 is native and args.use_cpu
    assert said == ([] if native else ["bf16: this CPU has no native bf16 (AVX512-BF16 / AMX), where bf16 autocast runs "
                                       "several times slower than fp32: training computes in fp32"])
    assert args.decode_torch_dtype(torch.float32) == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("bf16,expect", [(True, torch.bfloat16), (False, torch.float32)])
def test_bf16_autocast_reaches_the_backbone_of_every_forward(tmp_path, tokenizer, curriculum_path, bf16, expect,
                                                             monkeypatch):
    """fp32 weights + ``bf16: true`` (the formal recipe): the student's and the teacher's backbones compute in bf16.
    TRL's ``_get_last_hidden_state`` calls the backbone past accelerate's autocast wrapper of ``forward``, so without
    ``OPDTrainer``'s own autocast every forward ran in fp32 (an SFT step of the formal recipe: 246 s on an H200)."""
    monkeypatch.setattr("trainers.opd_config.cpu_bf16_native", lambda: True)  # bf16 on any CPU, as on a GPU
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, bf16=bf16, debug_max_steps=1)
    seen = []
    hooks = [m.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, i, o: seen.append((mod.training, o.dtype)))
             for m in (tr.model, tr.teacher_model)]
    tr.train()
    for h in hooks:
        h.remove()
    assert tr.state.global_step == 1 and seen
    assert {d for _, d in seen} == {expect}, seen  # generation (eager, outside autocast) is not hooked in training mode
    assert next(tr.model.parameters()).dtype == torch.float32  # the master weights stay fp32


def test_exports_record_the_hedges_each_save_covers(tmp_path, tokenizer, curriculum_path):
    """exports.jsonl names the hedge fractions each save is the export of, and those crossed so far: the rehearsal's
    report reads them (the window's share is driven by the step here: 0.25 a step)."""
    import json

    tr = make_trainer(tmp_path, tokenizer, curriculum_path, debug_max_steps=4, ckpt_hedge_fractions=[0.5, 0.75],
                      ckpt_keep=4)
    tr.cadence.fraction = lambda: tr.state.global_step / 4
    tr.train()
    rows = [json.loads(x) for x in (Path(tr.args.output_dir) / "metrics" / "exports.jsonl").read_text().splitlines()]
    assert [(r["step"], r["hedges"], r["hedges_crossed"]) for r in rows][:2] == [(2, [0.5], [0.5]),
                                                                                (3, [0.75], [0.5, 0.75])]


def live_probe():
    """A callback that, at each optimizer step's end, notes every tensor Python still references that is new since
    the previous step's end (its "births", held weakly). ``kept(k)`` is the bytes of step ``k``'s births still alive:
    a step's batch lives until the next step replaces it, so anything of step k alive two steps later is kept."""
    import gc
    import warnings
    import weakref

    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self):
            self.known, self.born, self.kept_at_end = weakref.WeakValueDictionary(), {}, {}

        def on_step_end(self, args, state, control, **kwargs):
            gc.collect()
            births = weakref.WeakValueDictionary()
            with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
                warnings.simplefilter("ignore")
                objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
            for o in objects:
                if id(o) not in self.known:
                    self.known[id(o)] = births[id(o)] = o
            self.born[state.global_step] = births

        def kept(self, step: int) -> int:
            return sum(t.untyped_storage().nbytes() for t in list(self.born[step].values()))

    return Probe()


def test_nothing_is_kept_across_on_policy_steps(tmp_path, tokenizer, curriculum_path):
    """No tensor made in an on-policy step outlives the next step (a climb of ~one hidden-state tensor a
    step on the GPU would be such a tensor). Step 1 makes what a run keeps (optimizer state); steps 2..6's tensors
    are all gone by the end of step 8."""
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, debug_max_steps=8)
    probe = live_probe()
    tr.add_callback(probe)
    tr.train()
    assert sorted(probe.born) == list(range(1, 9)) and probe.kept(1) > 0
    assert {k: probe.kept(k) for k in range(2, 7)} == {k: 0 for k in range(2, 7)}


@pytest.mark.parametrize("kw,copied", [(dict(bf16=True), True), (dict(bf16=False), False),
                                       (dict(bf16=True, decode_dtype="float32"), False)])
def test_decoder_reads_a_bf16_copy_of_fp32_weights_under_autocast(tmp_path, tokenizer, curriculum_path, kw, copied,
                                                                   monkeypatch):
    """fp32 weights + bf16 autocast (the formal recipe): the fast decoder runs a bf16 copy of the student, refreshed
    from the trained weights before every generation (half the bytes read a decoded token); its rotary buffers stay
    fp32. Without autocast, or with decode_dtype float32, it decodes the student itself."""
    import trainers.fast_generation as fg

    monkeypatch.setattr("trainers.opd_config.cpu_bf16_native", lambda: True)  # bf16 on any CPU, as on a GPU

    tr = make_trainer(tmp_path, tokenizer, curriculum_path, fast_generation=True, debug_max_steps=2, **kw)
    decoded, real = [], fg.generator_for  # the model each generation decodes with
    monkeypatch.setattr(fg, "generator_for", lambda model, *a, **k: (decoded.append(model), real(model, *a, **k))[1])
    tr.train()
    student = tr.accelerator.unwrap_model(tr.model)
    assert len(decoded) == 2 and tr.rollouts.name == "hf-generate-fast"
    if not copied:
        assert all(m is student for m in decoded) and tr.rollouts.decode_copy is None
        return
    snap = decoded[0]
    assert decoded[1] is snap and snap is not student and snap is tr.rollouts.decode_copy
    assert {p.dtype for p in snap.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in snap.buffers() if b.is_floating_point()} == {torch.float32}
    # the copy holds the weights of the step before the last generation; refreshed, it holds the trained ones
    stale = [p.clone() for p in snap.parameters()]
    assert fg.decode_weights(tr, student, tr.rollouts) is snap
    for p, q, old in zip(snap.parameters(), student.parameters(), stale):
        assert torch.equal(p, q.detach().to(torch.bfloat16))
    assert any(not torch.equal(p, old) for p, old in zip(snap.parameters(), stale))  # the last step moved them
    with pytest.raises(ValueError, match="decode_dtype must be"):
        make_args(tmp_path, decode_dtype="int8")


def test_matmul_precision_is_set_after_the_generation_engine(tmp_path, tokenizer, curriculum_path, monkeypatch):
    """vLLM colocate's worker sets torch's fp32 matmul precision to 'highest' while TRL builds it (inside the trainer's
    __init__): the recipe's matmul_precision is applied after that, on a CUDA machine only."""
    import trainers.model_utils as mu
    import trainers.opd_trainer as ot
    from trainers.trl_compat import DistillationTrainer

    order = []
    real_init = DistillationTrainer.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        order.append("engine built (vLLM sets 'highest' here)")

    monkeypatch.setattr(DistillationTrainer, "__init__", init)
    monkeypatch.setattr(ot, "apply_matmul_precision", lambda p: order.append(f"matmul_precision {p!r}"))
    make_trainer(tmp_path, tokenizer, curriculum_path, matmul_precision="high")
    assert order == ["engine built (vLLM sets 'highest' here)", "matmul_precision 'high'"]
    # the function itself: set on CUDA, left alone without it or when empty
    before = torch.get_float32_matmul_precision()
    try:
        assert not mu.apply_matmul_precision("high") and torch.get_float32_matmul_precision() == before  # no CUDA
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert not mu.apply_matmul_precision("")
        assert mu.apply_matmul_precision("high") and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
    with pytest.raises(ValueError, match="matmul_precision must be"):
        make_args(tmp_path, matmul_precision="tf32")
