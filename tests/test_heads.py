"""Head kernels (trainers.heads) and the trainer's head path against plain full-logits references (fp32).

CPU: the trainer's loss, entropy and gradients in both KL modes with a teacher of more vocabulary rows
(teacher forward before the student's, heads passed whole or as views), the summed-KL form of
``full_vocab_loss``, the dispatch rules and the config checks. GPU (marker ``gpu``): Liger-Kernel's
fused kernels against the same references.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_trainer import curriculum_path, make_trainer, tiny_model, tokenizer  # noqa: F401 - fixtures
from trainers import heads, losses

CUDA = torch.cuda.is_available()
#: the Liger GPU tests need a CUDA device and liger_kernel (not in requirements/: pip install liger-kernel==0.8.5;
#: bench/offline_gpu.sh prepare carries it)
_LIGER_MISSING = heads.liger_unavailable()
NEEDS_LIGER = pytest.mark.skipif(_LIGER_MISSING is not None, reason=str(_LIGER_MISSING))


def _rand(n=13, H=8, V=41, seed=0, device="cpu", Ht=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.5
    ht = torch.randn(n, Ht or H, generator=g)
    Wt = torch.randn(V + 3, Ht or H, generator=g) * 0.5  # teacher: 3 more rows (sliced away)
    y = torch.randint(0, V, (n,), generator=g)
    return [t.to(device) for t in (h, W, ht, Wt, y)]


def _plain_logp(z, y):
    return torch.log_softmax(z, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def _plain_rkl(zs, zt):
    ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


# ---------------------------------------------------------------- trainer head path (CPU)


def _poisoned_big_teacher(tokenizer, seed=2):
    """A teacher with 2 extra embedding rows of large logits: any read past the shared range shows."""
    t = tiny_model(tokenizer, seed=seed)
    V = t.get_output_embeddings().weight.shape[0]
    t.resize_token_embeddings(V + 2)
    with torch.no_grad():
        t.get_output_embeddings().weight[V:] = 3.0
    return t, V


def _reference(tr, out, V, *, full: bool):
    """Plain loss and entropy sum from full-logits forwards of both models (teacher logits cut to V)."""
    model = tr.accelerator.unwrap_model(tr.model)
    K = out["completion_ids"].size(1)
    m = out["completion_mask"].bool()
    y = out["completion_ids"][m]
    zs = model(input_ids=torch.cat([out["prompt_ids"], out["completion_ids"]], 1),
               attention_mask=torch.cat([out["prompt_mask"], out["completion_mask"]], 1)).logits[:, -K - 1:-1]
    with torch.no_grad():
        zt = tr.teacher_model(input_ids=torch.cat([out["teacher_prompt_ids"], out["completion_ids"]], 1),
                              attention_mask=torch.cat([out["teacher_prompt_mask"], out["completion_mask"]], 1)
                              ).logits[:, -K - 1:-1, :V]
    T = tr.temperature
    zs, zt = zs[m].float() / T, zt[m].float() / T
    lp_s, lp_t = _plain_logp(zs, y), _plain_logp(zt, y)
    A = out["advantages"].unsqueeze(1).expand_as(m)[m]
    N = float(m.sum())
    if full:
        loss = _plain_rkl(zs, zt).sum() / N - (A * lp_s).sum() / N
    else:  # rho = pi / stopgrad(pi) = 1: value -sum_t a_t / N, gradient -sum_t a_t grad log pi / N, a_t = A - k1
        k1 = lp_s.detach() - lp_t
        loss = -((A - k1) * torch.exp(lp_s - lp_s.detach())).sum() / N
    p = torch.softmax(zs, -1)
    entropy = -(p * torch.log_softmax(zs, -1)).sum(-1).sum()
    return loss, entropy


@pytest.mark.parametrize("kl_mode", ["sampled", "full"])
def test_trainer_head_path_equals_plain_reference(tmp_path, tokenizer, curriculum_path, kl_mode):  # noqa: F811
    """Loss, entropy sum and every parameter's gradient = plain full-logits formulas (teacher 2 rows wider)."""
    teacher, V = _poisoned_big_teacher(tokenizer)
    student = tiny_model(tokenizer, seed=1)
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=student, teacher=teacher, kl_mode=kl_mode,
                      teacher_context="teacher", temperature=0.8)
    assert tr.shared_vocab == V
    model = tr.accelerator.unwrap_model(tr.model)
    torch.manual_seed(0)
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    out["advantages"] = torch.linspace(-1, 1, 8)
    N = int(out["completion_mask"].sum())
    params = [p for p in model.parameters() if p.requires_grad]
    loss, ent_sum, n_tok = tr._compute_loss(model, out, N)
    got = torch.autograd.grad(loss, params)
    ref_loss, ref_ent = _reference(tr, out, V, full=kl_mode == "full")
    want = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent_sum, ref_ent, rtol=1e-5, atol=1e-5)
    assert int(n_tok) == N
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    assert any(float(w.abs().max()) > 0 for w in want)


def test_teacher_forward_runs_before_the_student_forward(tmp_path, tokenizer, curriculum_path):  # noqa: F811
    """Peak memory: the teacher's no-grad forward happens before the student's graph is built."""
    teacher = tiny_model(tokenizer, seed=2)
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, seed=1), teacher=teacher,
                      teacher_context="teacher")
    order = []
    tr.accelerator.unwrap_model(tr.teacher_model).model.register_forward_hook(lambda *a: order.append("teacher"))
    model = tr.accelerator.unwrap_model(tr.model)
    model.model.register_forward_hook(lambda *a: order.append("student"))
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    order.clear()
    tr._compute_loss(model, out, out["num_items_in_batch"])
    assert order == ["teacher", "student"]


def test_heads_whole_when_full_width_views_when_sliced(tmp_path, tokenizer, curriculum_path):  # noqa: F811
    teacher, V = _poisoned_big_teacher(tokenizer)
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, seed=1), teacher=teacher,
                      teacher_context="teacher")
    s, t = tr.accelerator.unwrap_model(tr.model), tr.accelerator.unwrap_model(tr.teacher_model)
    (ws, bs), (wt, bt) = heads.shared_head(s, tr.shared_vocab), heads.shared_head(t, tr.shared_vocab)
    assert ws is s.get_output_embeddings().weight  # student already V rows: no slice (and no SliceBackward)
    full_t = t.get_output_embeddings().weight
    assert wt.shape[0] == V and wt.data_ptr() == full_t.data_ptr() and wt._base is full_t  # a view, not a copy


def _plain_liger_logprobs(h, W, b, y):  # Liger's contract (T = 1), in plain torch
    z = h.float() @ W.float().t() + (0 if b is None else b.float())
    return _plain_logp(z, y)


def _plain_liger_kl_sum(hs, ws, ht, wt, *, temperature=1.0):
    return _plain_rkl(hs.float() @ ws.float().t() / temperature, ht.float() @ wt.float().t() / temperature).sum()


@pytest.mark.parametrize("kl_mode,temperature", [("full", 1.0), ("sampled", 1.0), ("full", 0.8)])
def test_trainer_liger_wiring_equals_trl(tmp_path, tokenizer, curriculum_path, monkeypatch,  # noqa: F811
                                         kl_mode, temperature):
    """head_kernel=liger in the trainer (Liger's kernels replaced by plain torch of the same contract, CPU):
    loss, entropy, gradients and the kl/full_mean accumulator equal head_kernel=trl's; at T != 1 the
    log-probs stay on TRL's kernel."""
    import trainers.opd_config as opd_config

    monkeypatch.setattr(opd_config, "liger_unavailable", lambda: None)
    calls = []
    monkeypatch.setattr(heads, "liger_token_logprobs", lambda *a: calls.append("lp") or _plain_liger_logprobs(*a))
    monkeypatch.setattr(heads, "liger_reverse_kl_sum",
                        lambda *a, **k: calls.append("kl") or _plain_liger_kl_sum(*a, **k))
    teacher, V = _poisoned_big_teacher(tokenizer)
    student = tiny_model(tokenizer, seed=1)
    res = {}
    for kernel in ("trl", "liger"):
        tr = make_trainer(tmp_path / kernel, tokenizer, curriculum_path, model=copy.deepcopy(student),
                          teacher=copy.deepcopy(teacher), kl_mode=kl_mode, teacher_context="teacher",
                          temperature=temperature, head_kernel=kernel)
        torch.manual_seed(0)
        rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
        out = tr._generate_and_score_completions(rows)
        out["advantages"] = torch.linspace(-1, 1, 8)
        model = tr.accelerator.unwrap_model(tr.model)
        loss, ent, _ = tr._compute_loss(model, out, int(out["completion_mask"].sum()))
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        res[kernel] = (loss, ent, grads, tr.steps.acc.get("kl_full_sum", 0.0), out["completion_ids"])
    assert torch.equal(res["trl"][4], res["liger"][4])  # same completions
    torch.testing.assert_close(res["liger"][0], res["trl"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res["liger"][1], res["trl"][1], rtol=1e-5, atol=1e-5)
    for g, w in zip(res["liger"][2], res["trl"][2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    assert res["liger"][3] == pytest.approx(res["trl"][3], rel=1e-4)
    want = (["lp", "lp"] if temperature == 1.0 else []) + (["kl"] if kl_mode == "full" else [])
    assert sorted(calls) == sorted(want)


# ---------------------------------------------------------------- losses / dispatch (CPU)


def test_full_vocab_loss_accepts_a_summed_kl():
    h, W, ht, Wt, y = _rand()
    zs, zt = h @ W.t(), ht @ Wt[: W.shape[0]].t()
    kl = _plain_rkl(zs, zt)
    lp = _plain_logp(zs, y)
    A = torch.randn(len(y))
    per_tok = losses.full_vocab_loss(kl, lp, A, 30.0, w_kl=0.7, w_reward=1.3)
    summed = losses.full_vocab_loss(kl.sum(), lp, A, 30.0, w_kl=0.7, w_reward=1.3)
    for a, b in zip(per_tok, summed):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="importance weights"):
        losses.full_vocab_loss(kl.sum(), lp, A, 30.0, is_weights=torch.ones(len(y)))


def test_trl_dispatch_equals_losses_and_plain():
    h, W, ht, Wt, y = _rand()
    V = W.shape[0]
    h1 = h.clone().requires_grad_()
    lp, ent = heads.token_logprobs(h1, W, None, y, kernel="trl", temperature=0.9, with_entropy=True)
    h2 = h.clone().requires_grad_()
    ref = _plain_logp(h2 @ W.t() / 0.9, y)
    torch.testing.assert_close(lp, ref)
    (lp * torch.arange(len(y))).sum().backward()  # per-token weights, as -A * logp
    (ref * torch.arange(len(y))).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    kl = heads.reverse_kl(h, W, None, ht, Wt[:V], None, kernel="trl", temperature=0.9)
    torch.testing.assert_close(kl, _plain_rkl(h @ W.t() / 0.9, ht @ Wt[:V].t() / 0.9))
    with pytest.raises(ValueError, match="head kernel"):
        heads.token_logprobs(h, W, None, y, kernel="cuda")


def test_liger_fits_only_where_the_maths_is_the_same():
    assert heads.liger_fits("logprob", temperature=1.0, scales=(1.0,), softcaps=(None,))
    assert not heads.liger_fits("logprob", temperature=0.7)  # no temperature in Liger's cross-entropy
    assert not heads.liger_fits("logprob", scales=(2.0,))
    assert not heads.liger_fits("logprob", softcaps=(30.0,))
    assert heads.liger_fits("kl", temperature=0.7, biases=(None, None))  # the JSD kernel takes T
    assert not heads.liger_fits("kl", biases=(None, torch.zeros(3)))
    assert not heads.liger_fits("kl", is_weights=torch.ones(3))  # one mean over rows: no per-token weights
    with pytest.raises(ValueError):
        heads.liger_fits("entropy")


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_config_refuses_liger_without_cuda(tmp_path):
    from tests.test_trainer import make_args

    with pytest.raises(ValueError, match="head_kernel=liger cannot run here: no CUDA"):
        make_args(tmp_path, head_kernel="liger")
    with pytest.raises(ValueError, match="head_kernel must be one of"):
        make_args(tmp_path, head_kernel="fused")
    assert make_args(tmp_path).head_kernel == "trl"


# ---------------------------------------------------------------- Liger on the GPU

@pytest.mark.gpu
@NEEDS_LIGER
def test_liger_token_logprobs_values_and_weighted_grads():
    """Liger's fused cross-entropy (reduction none) = plain log-softmax, gradients under per-token weights."""
    assert heads.liger_unavailable() is None
    h, W, ht, Wt, y = _rand(n=300, H=64, V=1000, device="cuda", Ht=96)
    V = W.shape[0]
    wts = torch.randn(len(y), device="cuda")  # -A_t: any per-token weight
    h1, W1 = h.clone().requires_grad_(), W.clone().requires_grad_()
    lp, ent = heads.token_logprobs(h1, W1, None, y, kernel="liger", with_entropy=True)
    (wts * lp).sum().backward()
    h2, W2 = h.clone().requires_grad_(), W.clone().requires_grad_()
    z = h2 @ W2.t()
    ref = _plain_logp(z, y)
    (wts * ref).sum().backward()
    torch.testing.assert_close(lp, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1).detach(),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the teacher's case: sliced head, no grad
        lt = heads.liger_token_logprobs(ht, Wt[:V], None, y)
    torch.testing.assert_close(lt, _plain_logp(ht @ Wt[:V].t(), y), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@NEEDS_LIGER
def test_liger_reverse_kl_sum_equals_plain():
    """Liger's fused JSD at beta = 1 = sum_t KL(p_s || p_t), teacher of another width, sliced head, T = 0.8."""
    h, W, ht, Wt, y = _rand(n=300, H=64, V=1000, device="cuda", Ht=96)
    V = W.shape[0]
    h1, W1 = h.clone().requires_grad_(), W.clone().requires_grad_()
    kl = heads.reverse_kl(h1, W1, None, ht, Wt[:V], None, kernel="liger", temperature=0.8)
    assert kl.dim() == 0
    (2.5 * kl).backward()  # an upstream scale other than 1 (w_kl / N)
    h2, W2 = h.clone().requires_grad_(), W.clone().requires_grad_()
    ref = _plain_rkl(h2 @ W2.t() / 0.8, ht @ Wt[:V].t() / 0.8).sum()
    (2.5 * ref).backward()
    torch.testing.assert_close(kl, ref.detach(), rtol=1e-4, atol=1e-4)
    # atol 1e-4 as in the log-prob test above: at 1e-5, 13 of 19,200 elements of h's gradient missed (by <= 2.6e-5,
    # on one H200, 2026-12-02): Liger's fused, chunked Triton kernel sums in another order than the plain matmul
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(W1.grad, W2.grad, rtol=1e-4, atol=1e-4)
    # with importance weights the dispatcher keeps TRL's per-token kernel
    per_tok = heads.reverse_kl(h, W, None, ht, Wt[:V], None, kernel="liger", temperature=0.8,
                               is_weights=torch.ones(len(y), device="cuda"))
    assert per_tok.shape == (len(y),)


@pytest.mark.gpu
@NEEDS_LIGER
def test_liger_and_trl_agree_in_bf16_at_qwen_width():
    """bf16 heads at a 151,936-row vocabulary: both kernels give the same log-probs and KL (bf16 tolerance)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, H, V = 512, 1536, 151_936
    h = torch.randn(n, H, device="cuda", generator=g).bfloat16()
    W = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    ht = torch.randn(n, 3584, device="cuda", generator=g).bfloat16()
    Wt = (torch.randn(V + 128, 3584, device="cuda", generator=g) * 0.02).bfloat16()
    y = torch.randint(0, V, (n,), device="cuda", generator=g)
    a = heads.token_logprobs(h, W, None, y, kernel="liger")[0]
    b = heads.token_logprobs(h, W, None, y, kernel="trl")[0]
    torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
    ka = heads.reverse_kl(h, W, None, ht, Wt[:V], None, kernel="liger")
    kb = heads.reverse_kl(h, W, None, ht, Wt[:V], None, kernel="trl").sum()
    torch.testing.assert_close(ka, kb, rtol=1e-2, atol=1e-2)



@pytest.mark.gpu
@NEEDS_LIGER
@pytest.mark.parametrize("kl_mode", ["sampled", "full"])
def test_trainer_liger_equals_trl_on_cuda(tmp_path, tokenizer, curriculum_path, kl_mode):  # noqa: F811
    """The trainer's micro-batch loss, entropy and gradients with head_kernel=liger = head_kernel=trl (fp32, CUDA,
    teacher 2 rows wider), on the same rollouts."""
    teacher, V = _poisoned_big_teacher(tokenizer)
    tr = make_trainer(tmp_path, tokenizer, curriculum_path, model=tiny_model(tokenizer, seed=1), teacher=teacher,
                      kl_mode=kl_mode, teacher_context="teacher", temperature=1.0, head_kernel="liger",
                      use_cpu=False, compile_layers=False, fast_generation=False)
    torch.manual_seed(0)
    rows = [tr.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    out = tr._generate_and_score_completions(rows)
    out["advantages"] = torch.linspace(-1, 1, 8, device=out["completion_ids"].device)
    model = tr.accelerator.unwrap_model(tr.model)
    params = [p for p in model.parameters() if p.requires_grad]
    N = int(out["completion_mask"].sum())
    res = {}
    for kernel in ("trl", "liger"):
        tr.args.head_kernel = kernel
        tr.steps.acc.clear()
        loss, ent, _ = tr._compute_loss(model, out, N)
        res[kernel] = (loss.detach(), ent, torch.autograd.grad(loss, params), tr.steps.acc.get("kl_full_sum", 0.0))
    torch.testing.assert_close(res["liger"][0], res["trl"][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res["liger"][1], res["trl"][1], rtol=1e-4, atol=1e-4)
    for g, w in zip(res["liger"][2], res["trl"][2]):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-6)
    assert res["liger"][3] == pytest.approx(res["trl"][3], rel=1e-4, abs=1e-6)
