"""Loss terms against plain references written from the formulas (docs/design.md section 5), and the sampler contract."""

from __future__ import annotations

import math

import pytest
import torch

from trainers import losses
from trainers.sampler import CurriculumSampler, epoch_order

torch.manual_seed(0)


def _plain_logits(h, W, b=None, T=1.0):
    z = h @ W.t()
    if b is not None:
        z = z + b
    return z / T


def _rand(n=11, H=6, V=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g, dtype=torch.float64).float()
    W = torch.randn(V, H, generator=g).float()
    b = torch.randn(V, generator=g).float() * 0.1
    y = torch.randint(0, V, (n,), generator=g)
    return h, W, b, y


# ---------------------------------------------------------------- advantages


def test_group_advantages_hand_made():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    a = losses.group_advantages(r, 4, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as GRPO
    assert torch.allclose(a[:4], (torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.5) / std)
    assert torch.equal(a[4:8], torch.zeros(4))  # zero-variance group -> 0 (not NaN, even with eps=0)
    assert torch.allclose(a[8:], (r[8:] - 0.25) / r[8:].std())
    a2 = losses.group_advantages(r, 4, scale_by_std=False)
    assert torch.allclose(a2[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(losses.group_advantages(torch.zeros(4), 4), torch.zeros(4))
    with pytest.raises(ValueError):
        losses.group_advantages(r, 5)


# ---------------------------------------------------------------- log-probs


def test_token_logprobs_matches_log_softmax_with_grads():
    h, W, b, y = _rand()
    h1, W1 = h.clone().requires_grad_(), W.clone().requires_grad_()
    lp, ent = losses.token_logprobs(h1, W1, b, y, temperature=0.7, with_entropy=True, chunk_size=8)
    h2, W2 = h.clone().requires_grad_(), W.clone().requires_grad_()
    logz = torch.log_softmax(_plain_logits(h2, W2, b, 0.7), -1)
    ref = logz.gather(1, y[:, None]).squeeze(1)
    ref_ent = -(logz.exp() * logz).sum(-1)
    assert torch.allclose(lp, ref, atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    w = torch.randn(len(y))
    (lp * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5) and torch.allclose(W1.grad, W2.grad, atol=1e-5)


# ---------------------------------------------------------------- sampled mode


def test_sampled_token_loss_gradient_is_policy_gradient_form():
    """grad of the loss == grad of -sum_t a_t log p(y_t) / N with a_t = -w_kl*(lp_s - lp_t) + w_r*A."""
    h, W, b, y = _rand()
    _, Wt, bt, _ = _rand(seed=1)
    A = torch.randn(len(y))
    N = 17.0  # global token count (> local n): normalisation is by it, not the local count
    w_kl, w_r = 0.7, 1.3

    W1 = W.clone().requires_grad_()
    lp = torch.log_softmax(_plain_logits(h, W1, b), -1).gather(1, y[:, None]).squeeze(1)
    lt = torch.log_softmax(_plain_logits(h, Wt, bt), -1).gather(1, y[:, None]).squeeze(1)
    loss, parts = losses.sampled_token_loss(lp, lp.detach(), lt, A, N, w_kl=w_kl, w_reward=w_r)
    loss.backward()

    W2 = W.clone().requires_grad_()
    lp2 = torch.log_softmax(_plain_logits(h, W2, b), -1).gather(1, y[:, None]).squeeze(1)
    a = -w_kl * (lp2.detach() - lt) + w_r * A
    ref = -(a * lp2).sum() / N
    ref.backward()
    assert torch.allclose(W1.grad, W2.grad, atol=1e-6)
    # the surrogate's value at ratio 1 is -sum a / N; its parts add up to it
    assert math.isclose(float(loss.detach()), float(-a.sum() / N), rel_tol=1e-5)
    assert math.isclose(parts.loss_kl + parts.loss_reward, float(loss.detach()), rel_tol=1e-5, abs_tol=1e-7)
    assert torch.allclose(parts.k1, lp.detach() - lt)
    assert parts.clipped == 0


def test_sampled_loss_global_token_normalisation_across_micro_batches():
    """Two micro-batches each divided by the global N give the full batch's gradient (TRL's num_items_in_batch)."""
    h, W, b, y = _rand(n=10)
    _, Wt, bt, _ = _rand(n=10, seed=2)
    A = torch.randn(10)
    lt = torch.log_softmax(_plain_logits(h, Wt, bt), -1).gather(1, y[:, None]).squeeze(1)

    def grad(parts_idx, norm):
        Wg = W.clone().requires_grad_()
        for idx in parts_idx:
            lp = torch.log_softmax(_plain_logits(h[idx], Wg, b), -1).gather(1, y[idx, None]).squeeze(1)
            loss, _ = losses.sampled_token_loss(lp, lp.detach(), lt[idx], A[idx], norm(idx))
            loss.backward()
        return Wg.grad

    full = grad([torch.arange(10)], lambda idx: 10)
    split = [torch.arange(0, 3), torch.arange(3, 10)]  # unequal micro-batches
    assert torch.allclose(grad(split, lambda idx: 10), full, atol=1e-6)
    assert not torch.allclose(grad(split, lambda idx: len(idx)), full, atol=1e-4)  # per-micro-batch mean differs


def test_sampled_loss_ppo_clip_and_teacher_clamp():
    torch.manual_seed(3)
    n = 9
    lp = torch.randn(n).requires_grad_()
    old = lp.detach() + torch.randn(n) * 0.5
    lt = torch.randn(n) - 3.0
    lt[0] = -50.0  # near-impossible for the teacher: clamped to -10
    A = torch.randn(n)
    loss, parts = losses.sampled_token_loss(lp, old, lt, A, 12.0, w_kl=0.5, w_reward=2.0, teacher_logprob_min=-10.0,
                                            epsilon_low=0.2, epsilon_high=0.28)
    a = -0.5 * (lp.detach() - lt.clamp(min=-10.0)) + 2.0 * A
    ratio = torch.exp(lp - old)
    ref = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a).sum() / 12.0
    assert torch.allclose(loss, ref)
    g1 = torch.autograd.grad(loss, lp, retain_graph=True)[0]
    g2 = torch.autograd.grad(ref, lp)[0]
    assert torch.allclose(g1, g2)
    assert parts.clipped == int((ratio * a > ratio.clamp(0.8, 1.28) * a).sum())
    assert parts.k1[0] == lp[0].detach() + 10.0


def test_k1_clamped_on_both_sides():
    """k1 = lp_s - max(lp_t, floor) clipped to [-c, c]: a token the student finds near-impossible (k1 << 0)
    is bounded too, not only one the teacher does."""
    lp = torch.tensor([-0.5, -30.0, -1.0, -2.0]).requires_grad_()
    lt = torch.tensor([-40.0, -0.1, -1.5, -25.0])
    A = torch.tensor([0.3, -0.2, 0.0, 1.0])
    loss, parts = losses.sampled_token_loss(lp, lp.detach(), lt, A, 4.0, teacher_logprob_min=-20.0, k1_clamp=10.0)
    k1 = torch.tensor([-0.5 - -20.0, -30.0 + 0.1, -1.0 + 1.5, -2.0 + 20.0])  # floor first: 19.5, -29.9, 0.5, 18
    k1c = torch.tensor([10.0, -10.0, 0.5, 10.0])
    assert torch.allclose(k1.clamp(-10, 10), k1c)
    assert torch.allclose(parts.k1, k1c) and parts.k1_clamped == 3
    assert torch.allclose(loss, -(-k1c + A).sum() / 4.0)
    unclamped, _ = losses.sampled_token_loss(lp, lp.detach(), lt, A, 4.0, teacher_logprob_min=-20.0)
    assert torch.allclose(unclamped, -(-k1 + A).sum() / 4.0)


def test_rollout_is_weights_truncated_ratio():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.2])
    roll = torch.tensor([-1.0, -2.5, -2.0, -1.0, float("nan")])
    w = losses.rollout_is_weights(lp, roll, cap=2.0)
    ref = [min(math.exp(a - b), 2.0) if not math.isnan(b) else 1.0 for a, b in zip(lp.tolist(), roll.tolist())]
    assert w.tolist() == pytest.approx(ref)
    assert w[2] == 2.0 and w[3] == pytest.approx(math.exp(-2.0)) and w[4] == 1.0


def test_is_weights_scale_each_token_in_both_modes():
    """Sampled mode: loss and gradient are -sum_t w_t a_t (log p) / N; full mode: each term weighted per token."""
    h, W, b, y = _rand()
    _, Wt, bt, _ = _rand(seed=1)
    A = torch.randn(len(y))
    w = torch.rand(len(y)) * 2
    N = 15.0
    W1 = W.clone().requires_grad_()
    lp = torch.log_softmax(_plain_logits(h, W1, b), -1).gather(1, y[:, None]).squeeze(1)
    lt = torch.log_softmax(_plain_logits(h, Wt, bt), -1).gather(1, y[:, None]).squeeze(1)
    loss, parts = losses.sampled_token_loss(lp, lp.detach(), lt, A, N, is_weights=w)
    a = -(lp.detach() - lt) + A
    ref = -(w * a * lp).sum() / N
    g1 = torch.autograd.grad(loss, W1, retain_graph=True)[0]
    g2 = torch.autograd.grad(ref, W1)[0]
    assert torch.allclose(g1, g2, atol=1e-6)
    assert float(loss) == pytest.approx(float(-(w * a).sum() / N), rel=1e-5)
    assert parts.loss_kl + parts.loss_reward == pytest.approx(float(loss), rel=1e-5)

    kl = torch.rand(len(y)).requires_grad_()
    full, kl_term, r_term = losses.full_vocab_loss(kl, lp, A, N, w_kl=0.5, w_reward=2.0, is_weights=w)
    assert torch.allclose(full, (0.5 * (w * kl).sum() - 2.0 * (w * A * lp).sum()) / N)
    assert torch.allclose(kl_term + r_term, full.detach())


# ---------------------------------------------------------------- full mode


def _plain_rkl(zs, zt):
    ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def test_full_reverse_kl_matches_plain():
    h, W, b, y = _rand()
    ht, Wt, bt, _ = _rand(seed=4)
    h1 = h.clone().requires_grad_()
    kl, ent = losses.full_reverse_kl(h1, W, b, ht, Wt, bt, temperature=0.9)
    h2 = h.clone().requires_grad_()
    ref = _plain_rkl(_plain_logits(h2, W, b, 0.9), _plain_logits(ht, Wt, bt, 0.9))
    assert torch.allclose(kl, ref, atol=1e-5)
    kl.sum().backward()
    ref.sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    with pytest.raises(ValueError):
        losses.full_reverse_kl(h, W, b, ht, Wt[:-2], bt[:-2])


def test_full_vocab_loss_formula_and_topk():
    h, W, b, y = _rand()
    ht, Wt, bt, _ = _rand(seed=5)
    A = torch.randn(len(y))
    N = 20.0
    zs, zt = _plain_logits(h, W, b), _plain_logits(ht, Wt, bt)
    kl = _plain_rkl(zs, zt)
    lp = torch.log_softmax(zs, -1).gather(1, y[:, None]).squeeze(1)
    loss, kl_term, r_term = losses.full_vocab_loss(kl, lp, A, N, w_kl=0.5, w_reward=2.0)
    assert torch.allclose(loss, 0.5 * kl.sum() / N - 2.0 * (A * lp).sum() / N)
    assert torch.allclose(kl_term + r_term, loss)
    # top-k with k = V is the exact full KL; small k matches a plain renormalised reference
    full_k = losses.topk_reverse_kl(h, W, b, ht, Wt, bt, k=W.shape[0], chunk=4)
    assert torch.allclose(full_k, kl, atol=1e-5)
    k = 5
    idx = zs.topk(k, -1).indices
    ref = _plain_rkl(zs.gather(1, idx), zt.gather(1, idx))
    h1 = h.clone().requires_grad_()
    got = losses.topk_reverse_kl(h1, W, b, ht, Wt, bt, k=k, chunk=4)
    assert torch.allclose(got, ref, atol=1e-5)
    got.sum().backward()  # gradient flows through the checkpointed chunks
    assert h1.grad is not None and torch.isfinite(h1.grad).all()


def test_vocab_slice_gives_same_loss_as_smaller_teacher():
    """A teacher head with 2 extra rows, sliced to the shared range, equals the smaller teacher."""
    h, W, b, y = _rand()
    ht, Wt, bt, _ = _rand(seed=6)
    Wt_big = torch.cat([Wt, torch.full((2, Wt.shape[1]), 5.0)])  # extra rows with large logits
    bt_big = torch.cat([bt, torch.full((2,), 3.0)])
    V = W.shape[0]
    kl_small, _ = losses.full_reverse_kl(h, W, b, ht, Wt, bt)
    kl_big, _ = losses.full_reverse_kl(h, W, b, ht, Wt_big[:V], bt_big[:V])
    assert torch.equal(kl_small, kl_big)
    lt_small, _ = losses.token_logprobs(ht, Wt, bt, y)
    lt_big_sliced, _ = losses.token_logprobs(ht, Wt_big[:V], bt_big[:V], y)
    lt_big_full, _ = losses.token_logprobs(ht, Wt_big, bt_big, y)
    assert torch.equal(lt_small, lt_big_sliced)
    assert not torch.allclose(lt_small, lt_big_full)  # the extra rows would have mattered


# ---------------------------------------------------------------- sampler


def test_sampler_repeat_contract_and_coverage():
    buckets = [2, 0, 1, 0, 2, 1, 0]
    order = list(range(7))
    G, P, R = 3, 2, 4  # group size, prompts per generation batch, GA x num_iterations
    s = CurriculumSampler(buckets, order, prompts_per_batch=P, num_generations=G, repeat_count=R, seed=1)
    idx = list(s)
    assert len(idx) == len(s) == math.ceil(7 / P) * P * G * R
    block = P * G
    blocks = [idx[i : i + block] for i in range(0, len(idx), block)]
    for i in range(0, len(blocks), R):
        assert all(blocks[j] == blocks[i] for j in range(i, i + R))  # each generation batch R times in a row
        b = blocks[i]
        for g in range(0, block, G):
            assert len(set(b[g : g + G])) == 1  # a prompt's G samples are consecutive
    distinct = [blocks[i][g] for i in range(0, len(blocks), R) for g in range(0, block, G)]
    assert set(distinct) == set(range(7))  # every row once per epoch (+ wrap-around to fill the last batch)
    firsts = distinct[:7]
    assert [buckets[i] for i in firsts] == sorted(buckets)  # ordered: easy buckets first
    # epochs differ (shuffle within bucket), but are reproducible given the epoch
    s.set_epoch(5)
    e5 = list(s)
    s.set_epoch(5)
    assert list(s) == e5
    # a data set smaller than one batch still fills it
    tiny = CurriculumSampler([0], [0], prompts_per_batch=3, num_generations=2, repeat_count=1)
    assert list(tiny) == [0] * 6


def test_epoch_order_modes():
    b = [i % 4 for i in range(400)]
    o = list(range(400))
    strict = epoch_order(b, o, shuffle_within_bucket=False)
    assert [b[i] for i in strict] == sorted(b) and strict[:3] == [0, 4, 8]
    sh = epoch_order(b, o, mode="shuffled", seed=0, epoch=0)
    assert sorted(sh) == o and sh != strict
    mixed = epoch_order(b, o, mode="mixed", mix=0.5, seed=0, shuffle_within_bucket=False)
    changed = sum(x != y for x, y in zip(mixed, strict)) / 400
    assert 0.3 < changed < 0.6
    with pytest.raises(ValueError):
        epoch_order(b, o, mode="bogus")
    with pytest.raises(ValueError):
        epoch_order(b, o, mode="mixed", mix=1.5)
