"""Output-head kernels: the two terms over the vocabulary, by TRL's chunked kernels or by Liger-Kernel's fused ones.

``OPDConfig.head_kernel`` picks the implementation of two head computations of ``OPDTrainer._compute_loss``:

- the sampled-token log-probs ``log softmax(h W^T / T)[y]`` (student, with grad; teacher, no grad);
- the full-vocabulary reverse KL per token, ``sum_v p_s(v) (log p_s(v) - log p_t(v))`` (``kl_mode=full``).

``trl`` (default): ``trainers.losses.token_logprobs`` / ``full_reverse_kl`` (TRL 1.16's
``ChunkedLogProbFunction`` / ``ChunkedDivergenceFunction``); the ``(n, V)`` logits are never
materialised, gradients accumulate in fp32.

``liger``: Liger-Kernel 0.8.5's ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"``
(log-prob = -cross-entropy; per-token upstream gradients are folded in by recomputing the chunked
logits in backward, ``liger_kernel/ops/fused_linear_cross_entropy.py``) and
``LigerFusedLinearJSDFunction`` with ``jsd_beta=1`` (its kernel's reverse-KL branch:
``loss = sum_v exp(X) (X - Y)``, X / Y the student / teacher log-softmax at temperature T, averaged
over rows, ``liger_kernel/ops/jsd.py``). Liger is used only where it computes the same quantity;
each call falls back to TRL's kernel otherwise (``liger_fits``):

- Liger's cross-entropy has no temperature and no logit scale: the log-probs need T = 1, scale 1;
- Liger's JSD has no bias, logit scale or softcap, and returns one mean over the rows (no per-token
  values), so per-token weights (rollout importance weights) cannot enter it: the reverse KL needs
  no bias, scale 1, no softcap on either model and no importance weights.

The per-token entropy (a logged metric, ``entropy`` in TRL's metrics) is not among Liger's outputs:
on the Liger path it is computed by TRL's kernel under ``no_grad`` (one extra forward pass over the
vocabulary, no backward).
"""

from __future__ import annotations

import torch

from trainers import losses

HEAD_KERNELS = ("trl", "liger")


def liger_unavailable() -> str | None:
    """Why ``head_kernel="liger"`` cannot run in this process (no CUDA device, no ``liger_kernel``), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (Liger-Kernel's fused head kernels are Triton GPU kernels)"
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
        import liger_kernel.ops.fused_linear_jsd  # noqa: F401
    except Exception as e:  # ImportError, or a Triton / torch mismatch raised at import
        return f"liger_kernel is not importable ({type(e).__name__}: {e}); pip install liger-kernel==0.8.5"
    return None


def liger_fits(term: str, *, temperature: float = 1.0, biases=(), scales=(), softcaps=(),
               is_weights: torch.Tensor | None = None) -> bool:
    """True when Liger's kernel computes exactly ``term`` ("logprob" or "kl") for these settings.

    Args:
        term: ``"logprob"`` (fused linear cross-entropy) or ``"kl"`` (fused linear JSD, beta = 1).
        temperature: softmax temperature T.
        biases / scales / softcaps: each model's head bias (or None), logit scale and softcap (or None).
        is_weights: per-token weights the KL term is multiplied by (None = all 1).

    Raises:
        ValueError: unknown ``term``.
    """
    plain_logits = all(s == 1.0 for s in scales) and all(c is None for c in softcaps)
    if term == "logprob":  # bias is supported by Liger's cross-entropy, temperature is not
        return temperature == 1.0 and plain_logits
    if term == "kl":  # the JSD kernel takes a temperature but no bias and yields one mean over the rows
        return plain_logits and all(b is None for b in biases) and is_weights is None
    raise ValueError(f"unknown head term {term!r}")


def liger_split(*, temperature: float, biases, transforms, kl_mode: str, full_topk: int) -> tuple[str, str]:
    """Under ``head_kernel="liger"``: the kernel that computes the sampled-token log-probs and the one that computes
    the full reverse KL, for the two models' head ``biases`` and logit ``transforms`` (``(scale, softcap)`` each);
    the rest stay on TRL's kernels (``liger_fits``; a top-k KL is TRL's)."""
    scales, softcaps = [t[0] for t in transforms], [t[1] for t in transforms]
    lp = liger_fits("logprob", temperature=temperature, scales=scales, softcaps=softcaps)
    kl = liger_fits("kl", temperature=temperature, biases=biases, scales=scales, softcaps=softcaps)
    full = kl_mode == "full"
    return ("Liger" if lp else "TRL (temperature != 1 or a logit transform)",
            "Liger" if kl and full and not full_topk else "TRL" if full else "- (sampled mode)")


def shared_head(model, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model``'s output head ``(weight, bias)`` cut to its first ``rows`` rows (the vocabulary the student and
    teacher share; bias None where it has none). A row slice is a view; a head already ``rows`` wide is passed
    whole, since the backward of a slice allocates a zero gradient of the full (V, H) base before copying into it."""
    head = model.get_output_embeddings()
    cut = lambda t: None if t is None else (t if t.shape[0] == rows else t[:rows])  # noqa: E731
    return cut(head.weight), cut(head.bias)


def liger_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor) -> torch.Tensor:
    """``(n,)`` fp32 ``log softmax(hidden @ weight.T + bias)[targets]`` by Liger's fused linear cross-entropy.

    ``reduction="none"``: the per-token loss is ``-log p(target)``; gradients (to ``hidden``,
    ``weight``, ``bias``) take any per-token upstream gradient, accumulated in fp32 (``accum_dtype``)
    as TRL's kernel does. No temperature (T = 1). Under ``no_grad`` only the forward runs.

    Args:
        hidden: ``(n, H)``; weight: ``(V, H)``; bias: ``(V,)`` or None; targets: ``(n,)`` int64 < V.
    """
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32) + 0.0 * hidden.sum()
    loss, *_ = LigerFusedLinearCrossEntropyFunction.apply(
        hidden, weight, targets, bias, None, -100, 0.0, 0.0, "none", None, False, torch.float32)
    return -loss.float()


def liger_reverse_kl_sum(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                         teacher_weight: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Scalar ``sum_t KL(p_s(.|t) || p_t(.|t))`` over the n rows by Liger's fused linear JSD at beta = 1.

    Liger returns the mean over rows; times n it is the sum (gradient to the student's hidden states
    and weight, fp32 weight-gradient accumulation). Both heads sliced to the same V rows, no bias.

    Args:
        student_hidden: ``(n, H_s)``; student_weight ``(V, H_s)``; teacher_hidden ``(n, H_t)``;
            teacher_weight ``(V, H_t)``.

    Returns:
        0-dim fp32 tensor (nats, summed over rows).

    Raises:
        ValueError: the two heads have different row counts.
    """
    from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction

    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"vocab sizes differ ({student_weight.shape[0]} vs {teacher_weight.shape[0]}): "
                         "slice both heads to the shared range first")
    n = student_hidden.shape[0]
    if n == 0:
        return 0.0 * student_hidden.sum().float()
    # Liger multiplies each model's hidden states by its own weight: both operands of a GEMM share a dtype.
    mean = LigerFusedLinearJSDFunction.apply(student_hidden, student_weight, teacher_hidden.to(teacher_weight.dtype),
                                             teacher_weight, None, 1.0, -100, temperature, torch.float32)
    return mean.float() * n


def token_logprobs(hidden, weight, bias, targets, *, kernel: str = "trl", temperature: float = 1.0,
                   logit_scale: float = 1.0, softcap: float | None = None, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled-token log-probs (and entropy) by the chosen head kernel: ``(logp (n,), entropy (n,) or None)``.

    Same contract as ``trainers.losses.token_logprobs``; ``kernel="liger"`` uses Liger where
    ``liger_fits("logprob", ...)`` and TRL's kernel otherwise. The entropy is detached on the Liger
    path (TRL's kernel, ``no_grad``): it is a metric here.

    Raises:
        ValueError: unknown ``kernel``.
    """
    if kernel not in HEAD_KERNELS:
        raise ValueError(f"head kernel must be one of {HEAD_KERNELS}, got {kernel!r}")
    if kernel == "trl" or not liger_fits("logprob", temperature=temperature, scales=(logit_scale,),
                                         softcaps=(softcap,)):
        return losses.token_logprobs(hidden, weight, bias, targets, temperature=temperature,
                                     logit_scale=logit_scale, softcap=softcap, with_entropy=with_entropy)
    logp = liger_token_logprobs(hidden, weight, bias, targets)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = losses.token_logprobs(hidden.detach(), weight.detach(), None if bias is None else bias.detach(),
                                            targets, with_entropy=True)[1]
    return logp, entropy


def reverse_kl(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, *,
               kernel: str = "trl", temperature: float = 1.0, student_scale: float = 1.0,
               student_softcap: float | None = None, teacher_scale: float = 1.0,
               teacher_softcap: float | None = None, is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Full-vocabulary reverse KL by the chosen head kernel: ``(n,)`` per token (TRL) or its 0-dim sum (Liger).

    ``trainers.losses.full_vocab_loss`` takes either form. ``kernel="liger"`` uses Liger where
    ``liger_fits("kl", ...)`` (no bias / scale / softcap, ``is_weights`` None) and TRL's kernel otherwise.

    Raises:
        ValueError: unknown ``kernel``; heads of different row counts.
    """
    if kernel not in HEAD_KERNELS:
        raise ValueError(f"head kernel must be one of {HEAD_KERNELS}, got {kernel!r}")
    fits = liger_fits("kl", temperature=temperature, biases=(student_bias, teacher_bias),
                      scales=(student_scale, teacher_scale), softcaps=(student_softcap, teacher_softcap),
                      is_weights=is_weights)
    if kernel == "trl" or not fits:
        return losses.full_reverse_kl(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                                      teacher_bias, temperature=temperature, student_scale=student_scale,
                                      student_softcap=student_softcap, teacher_scale=teacher_scale,
                                      teacher_softcap=teacher_softcap)[0]
    return liger_reverse_kl_sum(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                temperature=temperature)
