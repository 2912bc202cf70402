"""Loss terms of on-policy distillation with a verifier reward (pure functions, no trainer state).

Objective (docs/design.md section 5), for a prompt x, G student samples y ~ pi_theta(.|x), a teacher
context c(x) and a verifier reward r(x, y) in {0, 1}:

- sampled reverse KL per token:   k1_t = log pi_theta(y_t | x, y_<t) - log pi_T(y_t | c, y_<t)
- group advantage:                A = (r - mean_G r) / (std_G r + eps)          (std optional)
- ``sampled`` mode (tinker / verl "k1 + policy gradient"), per-token advantage
  a_t = -w_kl * stopgrad(k1_t) + w_reward * A, and the PPO-clipped surrogate
  loss = -sum_t min(rho_t a_t, clip(rho_t, 1 - eps_low, 1 + eps_high) a_t) / N_tokens,
  rho_t = pi_theta(y_t) / pi_old(y_t). Without batch reuse pi_old = stopgrad(pi_theta), rho = 1
  and the gradient is exactly -sum_t a_t grad log pi_theta(y_t) / N_tokens.
- ``full`` mode: loss = w_kl * sum_t KL_t / N_tokens - w_reward * sum_t A log pi_theta(y_t) / N_tokens,
  KL_t = sum_v pi_theta(v|.) (log pi_theta(v|.) - log pi_T(v|.)) (TRL's chunked kernel, beta = 1),
  or over the student's top-k tokens renormalised (``topk_reverse_kl``).

Two per-token corrections: in ``sampled`` mode k1 (after the teacher floor) is clamped to
[-k1_clamp, k1_clamp] (verl clamps its KL estimates to +-10); in both modes, when a separate rollout
engine (vLLM) sampled the tokens, each token's terms are weighted by the truncated importance ratio
w_t = min(pi_trainer(y_t) / pi_rollout(y_t), cap) (``rollout_is_weights``).

N_tokens is the completion-token count of the *global* batch (all micro-batches and processes), as
in TRL's ``DistillationTrainer`` (``num_items_in_batch``), so gradient accumulation does not change
the objective. All functions work on flattened valid (unmasked) completion positions: ``n`` below
is the number of such positions in the local micro-batch, ``H`` the hidden width, ``V`` the vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# Vocabulary tile width for TRL's chunked log-prob kernel: a [4096, 8192] fp32 tile is 128 MiB.
LOGPROB_CHUNK = 8192


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Group-normalised advantages (GRPO, Shao et al. 2024, arXiv:2402.03300, eq. 3; TRL ``GRPOTrainer``).

    Args:
        rewards: ``(N,)`` float, N = n_groups * group_size, the G samples of one prompt contiguous.
        group_size: G.
        scale_by_std: divide by the group's (unbiased) standard deviation + ``eps``; off gives the
            Dr. GRPO form ``r - mean``.
        eps: added to the std. A zero-variance group (all correct or all wrong) gets advantage 0.

    Returns:
        ``(N,)`` float32 advantages.

    Raises:
        ValueError: ``N`` is not a multiple of ``group_size``.
    """
    rewards = rewards.float()
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        std = grouped.std(dim=1, keepdim=True)
        # a zero-variance group carries no signal: 0 exactly (also when eps = 0, where 0/0 would be NaN)
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.reshape(-1)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                   *, temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None,
                   with_entropy: bool = False, chunk_size: int = LOGPROB_CHUNK
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target token under ``softmax(transform(hidden @ weight.T + bias) / T)``.

    Uses TRL's ``ChunkedLogProbFunction`` (``trl/kernels/chunked_logprob.py``): the ``(n, V)``
    logits are never materialised (Triton on GPU, torch tiles elsewhere); gradients flow to
    ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: ``(n, H)`` backbone outputs at the positions predicting ``targets``.
        weight: ``(V, H)`` output embedding (pass a slice ``W[:V_shared]`` to restrict the vocabulary).
        bias: ``(V,)`` or None.
        targets: ``(n,)`` int64 token ids, all ``< V``.
        temperature: softmax temperature (TRL divides both models' logits by it).
        logit_scale / softcap: model-specific logit post-processing (Cohere scale, Gemma softcap).
        with_entropy: also return the per-token entropy (nats).

    Returns:
        ``(logp (n,), entropy (n,) or None)``, float32.
    """
    from trainers.trl_compat import ChunkedLogProbFunction

    outputs = ("entropy",) if with_entropy else ()
    logp, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                                     softcap, logit_scale, outputs)
    return logp, entropy


def full_reverse_kl(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
                    teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                    *, temperature: float = 1.0, student_scale: float = 1.0, student_softcap: float | None = None,
                    teacher_scale: float = 1.0, teacher_softcap: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token full-vocabulary reverse KL(pi_student || pi_teacher), via TRL's chunked kernel with beta = 1.

    ``trl/kernels/chunked_divergence.py`` (``ChunkedDivergenceFunction``), the kernel behind
    ``DistillationTrainer``'s loss; called here per token (not summed) so the caller can also
    form per-sequence values. Gradient flows to the student only.

    Args:
        student_hidden: ``(n, H_s)``; student_weight ``(V, H_s)``; student_bias ``(V,)`` or None.
        teacher_hidden: ``(n, H_t)``; teacher_weight ``(V, H_t)`` (same ``V``: slice both heads to the
            shared vocabulary first); teacher_bias ``(V,)`` or None.

    Returns:
        ``(kl (n,), student_entropy (n,))`` in nats, float32.
    """
    from trainers.trl_compat import ChunkedDivergenceFunction

    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"vocab sizes differ ({student_weight.shape[0]} vs {teacher_weight.shape[0]}): "
                         "slice both heads to the shared range first")
    return ChunkedDivergenceFunction.apply(student_hidden, student_weight, student_bias, teacher_hidden,
                                           teacher_weight, teacher_bias, 1.0, temperature, student_scale,
                                           student_softcap, teacher_scale, teacher_softcap)


def _logits(hidden, weight, bias, temperature, scale, softcap):
    z = hidden.float() @ weight.float().t()
    if bias is not None:
        z = z + bias.float()
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def topk_reverse_kl(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: torch.Tensor | None,
                    teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: torch.Tensor | None,
                    k: int, *, temperature: float = 1.0, student_scale: float = 1.0,
                    student_softcap: float | None = None, teacher_scale: float = 1.0,
                    teacher_softcap: float | None = None, chunk: int = 512) -> torch.Tensor:
    """Reverse KL restricted to the student's top-k tokens, both distributions renormalised over them.

    The support S_t = top-k of the (detached) student logits at position t; with p = softmax over S_t
    of the student logits and q the same for the teacher, KL_t = sum_{v in S_t} p_v (log p_v - log q_v)
    (the top-k approximation of verl's ``forward_kl_topk`` turned to the reverse direction; k = V
    gives the full reverse KL). Positions are processed ``chunk`` at a time under activation
    checkpointing, so peak memory is ``chunk x V`` logits per model rather than ``n x V``.

    Args: as ``full_reverse_kl``; ``k`` >= 1 (clipped to V).

    Returns:
        ``(n,)`` float32 per-token KL (gradient to the student).
    """
    V = student_weight.shape[0]
    k = min(int(k), V)

    def block(hs, ht):
        zs = _logits(hs, student_weight, student_bias, temperature, student_scale, student_softcap)
        with torch.no_grad():
            zt = _logits(ht, teacher_weight, teacher_bias, temperature, teacher_scale, teacher_softcap)
            idx = zs.detach().topk(k, dim=-1).indices
        ls = torch.log_softmax(zs.gather(-1, idx), dim=-1)
        lt = torch.log_softmax(zt.gather(-1, idx), dim=-1)
        return (ls.exp() * (ls - lt)).sum(-1)

    out = []
    for s in range(0, student_hidden.shape[0], chunk):
        hs, ht = student_hidden[s : s + chunk], teacher_hidden[s : s + chunk]
        out.append(checkpoint(block, hs, ht, use_reentrant=False) if hs.requires_grad else block(hs, ht))
    return torch.cat(out) if out else student_hidden.new_zeros(0, dtype=torch.float32)


def rollout_is_weights(logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights for tokens sampled by another engine: ``min(exp(logp - rollout_logp), cap)``.

    The rollout engine (vLLM) and the trainer compute different log-probs for the same tokens (kernels,
    precision); the policy gradient is then off-policy by that ratio. Form of TRL 1.16 ``GRPOTrainer``'s
    ``vllm_importance_sampling_mode="token_truncate"`` (``trl/trainer/grpo_trainer.py``; tokens whose
    rollout log-prob is NaN get weight 1) and verl's token-level rollout IS; truncated IS after Yao et
    al. 2025, "Your efficient RL framework secretly brings you off-policy RL training".

    Args:
        logp: ``(n,)`` trainer log-probs of the sampled tokens under the policy that sampled them
            (``pi_old``; no grad is taken through the weights).
        rollout_logp: ``(n,)`` the rollout engine's log-probs of the same tokens; NaN = unknown.
        cap: upper bound C > 0 on the weight.

    Returns:
        ``(n,)`` float32 weights in (0, cap], detached.
    """
    diff = torch.nan_to_num(logp.detach().float() - rollout_logp.float(), nan=0.0)
    return torch.exp(diff).clamp(max=cap)


@dataclass
class LossParts:
    """Detached pieces of a micro-batch loss, as *sums* over its tokens (callers divide by global counts).

    ``loss_kl`` / ``loss_reward``: the KL and reward terms' contributions to the loss (already divided
    by ``num_items``, so they add up over micro-batches); ``k1``: ``(n,)`` per-token sampled reverse
    KL; ``clipped``: tokens where the PPO clip was active; ``ratio_sum``: sum of rho_t; ``k1_clamped``:
    tokens whose k1 hit ``k1_clamp``.
    """

    loss_kl: float
    loss_reward: float
    k1: torch.Tensor
    clipped: int
    ratio_sum: float
    k1_clamped: int = 0


def sampled_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor,
                       advantages: torch.Tensor, num_items: torch.Tensor | float, *, w_kl: float = 1.0,
                       w_reward: float = 1.0, teacher_logprob_min: float | None = None,
                       k1_clamp: float | None = None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                       is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, LossParts]:
    """Sampled-token reverse KL plus verifier reward, in PPO-clipped policy-gradient form.

    k1_t = clip(logp_t - max(teacher_logp_t, teacher_logprob_min), -k1_clamp, k1_clamp) (stopgrad);
    a_t = -w_kl * k1_t + w_reward * A_seq(t);
    loss = -sum_t w_t min(rho_t a_t, clip(rho_t, 1-eps_low, 1+eps_high) a_t) / num_items, rho_t = exp(logp_t - old_logp_t),
    w_t the rollout importance weight (1 without one). Sources: Thinking Machines / tinker
    ``distillation/train_on_policy.py`` (per-token advantage -kl_coef * k1, discount 0); verl
    ``loss_mode=k1, use_policy_gradient=True`` (PPO clip, optional ``log_prob_min_clamp``, KL clamped
    to +-10); TRL GRPO (per-token loss times the vLLM IS ratio); docs/design.md section 5.

    Args:
        logp: ``(n,)`` student log-probs of the sampled tokens, with grad.
        old_logp: ``(n,)`` log-probs of the policy that sampled (no grad); pass ``logp.detach()`` when
            the batch is used once (then rho = 1 and no clipping happens).
        teacher_logp: ``(n,)`` teacher log-probs of the same tokens (no grad).
        advantages: ``(n,)`` the sequence advantage A broadcast to each of its tokens.
        num_items: global completion-token count N (tensor or number).
        teacher_logprob_min: floor on the teacher log-prob (verl uses -10) so one token the teacher
            finds near-impossible does not dominate the step; None = no clamp.
        k1_clamp: bound c > 0 on |k1| (after the floor), for tokens the *student* finds near-impossible
            too; None = no clamp.
        is_weights: ``(n,)`` rollout importance weights (``rollout_is_weights``), or None.

    Returns:
        ``(loss, LossParts)``; loss is a scalar with grad.
    """
    logp_t = teacher_logp.detach()
    if teacher_logprob_min is not None:
        logp_t = logp_t.clamp(min=teacher_logprob_min)
    k1 = logp.detach() - logp_t
    n_clamped = 0
    if k1_clamp is not None:
        n_clamped = int((k1.abs() > k1_clamp).sum())
        k1 = k1.clamp(-k1_clamp, k1_clamp)
    adv_kl = -w_kl * k1
    adv_r = w_reward * advantages.detach().to(k1.dtype)
    a = adv_kl + adv_r
    ratio = torch.exp(logp - old_logp.detach())
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token = torch.minimum(ratio * a, clipped_ratio * a)
    w = torch.ones_like(k1) if is_weights is None else is_weights.detach().to(k1.dtype)
    loss = -(w * per_token).sum() / num_items
    with torch.no_grad():
        n = float(num_items)
        parts = LossParts(
            loss_kl=float(-(w * ratio * adv_kl).sum() / n),
            loss_reward=float(-(w * ratio * adv_r).sum() / n),
            k1=k1,
            clipped=int((ratio * a > clipped_ratio * a).sum()),
            ratio_sum=float(ratio.sum()),
            k1_clamped=n_clamped,
        )
    return loss, parts


def full_vocab_loss(kl: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, num_items: torch.Tensor | float,
                    *, w_kl: float = 1.0, w_reward: float = 1.0, is_weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary reverse KL plus the reward policy-gradient term (docs/design.md section 5).

    loss = w_kl * sum_t w_t KL_t / N - w_reward * sum_t w_t A_seq(t) * log pi_theta(y_t) / N, w_t the
    rollout importance weight (1 without one): the positions were reached by the rollout engine's samples.

    Args:
        kl: ``(n,)`` per-token reverse KL with grad (``full_reverse_kl`` or ``topk_reverse_kl``), or its
            0-dim sum over the n tokens (``trainers.heads.liger_reverse_kl_sum``; only without ``is_weights``).
        logp: ``(n,)`` student log-probs of the sampled tokens, with grad.
        advantages: ``(n,)`` sequence advantage per token.
        num_items: global completion-token count N.
        is_weights: ``(n,)`` rollout importance weights (``rollout_is_weights``), or None.

    Returns:
        ``(loss, kl_term, reward_term)``: the scalar loss and its two detached terms.

    Raises:
        ValueError: a summed (0-dim) ``kl`` with ``is_weights``.
    """
    w = torch.ones_like(logp) if is_weights is None else is_weights.detach().to(logp.dtype)
    if kl.dim() == 0:
        if is_weights is not None:
            raise ValueError("a summed KL cannot take per-token importance weights: pass the (n,) per-token KL")
        kl_term = w_kl * kl / num_items
    else:
        kl_term = w_kl * (w * kl).sum() / num_items
    reward_term = -w_reward * (w * advantages.detach().to(logp.dtype) * logp).sum() / num_items
    return kl_term + reward_term, kl_term.detach(), reward_term.detach()
