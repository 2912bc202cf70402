"""The TRL-version layer (``trainers.trl_compat``): the torch head kernels against plain dense references, and the
text-only base against TRL's own ``DistillationTrainer`` where both are importable (TRL >= 1.10).

The whole trainer suite (tests/test_trainer.py) also runs under the formal stack's TRL 1.0, where the text-only
base and these kernels are what runs (``make formal-venv``; .ci/run).
"""

from __future__ import annotations

import pytest
import torch

from trainers.chunked_heads import ChunkedDivergenceFunction, ChunkedLogProbFunction


def _dense(h, w, b, scale, cap, temperature):
    z = (h.double() @ w.double().t() + (0 if b is None else b.double())) * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z / temperature


def _inputs(n=37, hdim=8, v=29, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = torch.randn(v, hdim, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    return h, w, b


@pytest.mark.parametrize("temperature,scale,cap,bias", [(1.0, 1.0, None, False), (0.7, 1.0, None, True),
                                                        (1.3, 0.5, 3.0, True)])
def test_chunked_logprob_and_entropy_match_the_dense_formula(temperature, scale, cap, bias):
    h, w, b = _inputs(bias=bias)
    t = torch.randint(0, w.size(0), (h.size(0),), generator=torch.Generator().manual_seed(1))
    lp, ent = ChunkedLogProbFunction.apply(h, w, b, t, temperature, 5, cap, scale, ("entropy",))  # 8 chunks
    gl, ge = torch.randn(h.size(0), dtype=torch.float64), torch.randn(h.size(0), dtype=torch.float64)
    ((lp.double() * gl).sum() + (ent.double() * ge).sum()).backward()
    got = [x.grad.clone() for x in (h, w, b) if x is not None]
    for x in (h, w, b):
        if x is not None:
            x.grad = None

    z = _dense(h, w, b, scale, cap, temperature)
    logp_all = torch.log_softmax(z, -1)
    ref_lp = logp_all.gather(1, t[:, None]).squeeze(1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((ref_lp * gl).sum() + (ref_ent * ge).sum()).backward()
    want = [x.grad for x in (h, w, b) if x is not None]
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    for a, r in zip(got, want):
        assert torch.allclose(a.double(), r.double(), atol=1e-4), (a - r).abs().max()


def test_chunked_logprob_without_entropy_returns_none_and_the_same_logprobs():
    h, w, b = _inputs()
    t = torch.arange(h.size(0)) % w.size(0)
    lp, ent = ChunkedLogProbFunction.apply(h, w, b, t, 1.0, 4096, None, 1.0, ())
    assert ent is None
    ref = torch.log_softmax(_dense(h, w, b, 1.0, None, 1.0), -1).gather(1, t[:, None]).squeeze(1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)


@pytest.mark.parametrize("temperature,cap", [(1.0, None), (0.8, 5.0)])
def test_chunked_reverse_kl_matches_the_dense_formula_and_its_student_gradient(temperature, cap):
    sh, sw, sb = _inputs(seed=2)
    th, tw, tb = _inputs(seed=3)
    kl, ent = ChunkedDivergenceFunction.apply(sh, sw, sb, th.detach(), tw.detach(), tb.detach(), 1.0, temperature,
                                              1.0, cap, 1.0, None)
    g = torch.randn(sh.size(0), dtype=torch.float64)
    (kl.double() * g).sum().backward()
    got = [x.grad.clone() for x in (sh, sw, sb)]
    for x in (sh, sw, sb):
        x.grad = None
    ls = torch.log_softmax(_dense(sh, sw, sb, 1.0, cap, temperature), -1)
    lt = torch.log_softmax(_dense(th.detach(), tw.detach(), tb.detach(), 1.0, None, temperature), -1)
    ref = (ls.exp() * (ls - lt)).sum(-1)
    (ref * g).sum().backward()
    assert torch.allclose(kl.double(), ref, atol=1e-5)
    assert torch.allclose(ent.double(), -(ls.exp() * ls).sum(-1), atol=1e-5)
    for a, r in zip(got, (sh.grad, sw.grad, sb.grad)):
        assert torch.allclose(a.double(), r.double(), atol=1e-4)
    with pytest.raises(ValueError, match="beta = 1"):
        ChunkedDivergenceFunction.apply(sh, sw, sb, th, tw, tb, 0.5, 1.0, 1.0, None, 1.0, None)


def test_torch_kernels_agree_with_trls_where_trl_has_them():
    kernels = pytest.importorskip("trl.kernels.chunked_logprob", reason="this TRL has no trl.kernels (TRL 1.0 and 0.29 have none)")
    h, w, b = _inputs(seed=4)
    t = torch.arange(h.size(0)) % w.size(0)
    ours = ChunkedLogProbFunction.apply(h, w, b, t, 0.9, 6, None, 1.0, ("entropy",))
    theirs = kernels.ChunkedLogProbFunction.apply(h, w, b, t, 0.9, 6, None, 1.0, ("entropy",))
    assert torch.allclose(ours[0], theirs[0], atol=1e-5) and torch.allclose(ours[1], theirs[1], atol=1e-5)


def test_the_compat_layer_names_the_base_it_chose():
    import trl

    from trainers import trl_compat

    has = hasattr(trl, "DistillationTrainer")
    assert trl_compat.TRL_BASE == ("trl" if has else "opd")
    if not has:
        from trainers.text_distill_trainer import DistillationTrainer

        assert trl_compat.DistillationTrainer is DistillationTrainer


def test_text_only_base_pads_and_splits_like_trls_distillation_trainer(tmp_path):
    """Where TRL has ``DistillationTrainer``, the text-only base gives the same padded batch from the same seeded
    generation (same prompts, same model, same seed): the two are interchangeable under OPDTrainer."""
    trl = pytest.importorskip("trl")
    if not hasattr(trl, "DistillationTrainer"):
        pytest.skip("this TRL has no DistillationTrainer to compare with")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from data_tools.models import resolve_model
    from trainers.text_distill_config import DistillationConfig as OurConfig
    from trainers.text_distill_trainer import DistillationTrainer as Ours

    tok = AutoTokenizer.from_pretrained(resolve_model(None), padding_side="left")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    prompts = ["What is 1 + 1?", "Name a prime.", "2 * 3 =", "Say hi."]
    ds = Dataset.from_dict({"prompt": prompts})
    out = {}
    for name, T, C in (("trl", trl.DistillationTrainer, trl.DistillationConfig), ("opd", Ours, OurConfig)):
        torch.manual_seed(0)
        student, teacher = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
        args = C(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_completion_length=7,
                 use_cpu=True, report_to=[], seed=3, gradient_checkpointing=False)
        tr = T(model=student, teacher_model=teacher, args=args, train_dataset=ds, processing_class=tok)
        tr.model.train()
        torch.manual_seed(5)
        out[name] = tr._generate_and_score_completions([{"prompt": p} for p in prompts])
        assert tr.eos_token_ids and tr.generation_config.max_new_tokens == 7
    for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch"):
        assert torch.equal(out["trl"][k], out["opd"][k]), k
